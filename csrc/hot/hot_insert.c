/*
 * One-call insert of a step (Client.insert) or a batch (SharedTable.insert) of a known layout,
 * one-call staging of a step (StepInserter.insert), and Client.mutate_priorities of a dict.
 *
 * An InsertPlan is made by Python (reverb_shm/_internal/hot_plans.py) for one table, one registration of
 * this process with the segment and one step layout that the Python path has already checked
 * against the table (structure, dtypes, shapes, signature). Its insert() matches the data
 * against that layout, takes each leaf's bytes (array data, or a scalar's value), and calls
 * rs_insert_rows once with the GIL released. It never raises for the data: anything it does
 * not handle exactly as the Python path would makes it return None having done nothing, and
 * the caller takes the Python path (which validates and raises). A failed core call returns
 * its status and partial-progress state for Python to finish or raise (reverb_shm/_internal/_lib.py).
 * A stager plan (StepInserter) also copies a matched step into a row of private staging arrays
 * (stage(); no core call).
 *
 * Layout template (built by hot_plans.template, also the plan cache key), pre-order:
 *   (0, sorted str keys, children)   a dict (exactly dict) with exactly these keys
 *   (1, children) / (2, children)    a list / tuple (exactly) of len(children)
 *   (3, "a", dtype, shape)           a numpy array (exactly ndarray) of that dtype and shape
 *                                    (batched plans: a leading batch dim before `shape`)
 *   (3, "v", dtype)                  a scalar of that native dtype: a numpy scalar of it, or a
 *                                    Python float / int / bool when that is float64 / int64 /
 *                                    bool (numpy's conversion of them)
 * Leaves are visited in dm-tree order (dict keys sorted), the order of structure.flatten.
 */
#include <math.h>
#include <pthread.h>

#include "hot.h"

#define HOT_MAX_COLS 64     /* ColumnWriter's limit */
#define HOT_MAX_NODES 256   /* template nodes (containers and leaves) */
#define HOT_STACK_PRIOS 64  /* batch priorities filled on the stack up to this many */

enum { NODE_DICT = 0, NODE_LIST = 1, NODE_TUPLE = 2, NODE_LEAF = 3 };
enum { LEAF_ARRAY = 0, LEAF_VALUE = 1 };
enum { PY_NONE = 0, PY_FLOAT, PY_INT, PY_BOOL };   /* Python type a value leaf also takes */

typedef struct {
  int kind;
  Py_ssize_t n;       /* children (containers) */
  PyObject **keys;    /* dict: n interned str keys, sorted (owned references) */
  int leaf;           /* NODE_LEAF: column index */
} hot_node;

typedef struct {
  int kind;                   /* LEAF_ARRAY / LEAF_VALUE */
  PyArray_Descr *descr;       /* owned */
  int ndim;                   /* item rank (arrays) */
  npy_intp dims[NPY_MAXDIMS]; /* item shape (arrays) */
  int py;                     /* value leaves: PY_* Python type also taken */
} hot_leaf;

typedef struct {
  PyObject_HEAD
  hot_node *nodes;
  Py_ssize_t nnodes;
  hot_leaf *leaves;
  uint32_t ncols;
  int batched;
  int prioritized;
  PyObject *segment;       /* the Segment: its _registration must still be `registration` */
  PyObject *registration;  /* (pid, slot, generation) tuple current at creation */
  PyObject *deadline_fn;   /* timeouts.deadline_from_ms */
  PyObject *context;       /* Python's state for finishing a failed call (keeps metas alive) */
  void *base;
  uint32_t slot, table, rows_flags;
  const rs_chunk_hdr *metas;
  const uint32_t *col_flags;
  int64_t slice_ns;
  unsigned long fork_epoch;   /* hot_fork_epoch when made */
  uint32_t capacity;       /* stagers (StepInserter): rows of each staging array; else 0 */
  uint8_t **stage_rows;    /* stagers: C-contiguous (capacity, *item shape) array per column */
  double *stage_prios;     /* stagers: float64[capacity] */
  /* Open chunks (see "open chunks" below): */
  uint32_t open_rows;      /* largest open-chunk capacity in rows; 0: every insert has its own */
  uint32_t open_flags;     /* rs_open_chunks flags (RS_ROWS_RANDOM_EPISODE for Client.insert) */
  uint32_t next_cap;       /* capacity of the next open chunks (doubles up to open_rows) */
  int refilling;           /* a thread is opening new chunks (GIL released meanwhile) ... */
  pthread_mutex_t refill;  /* ... holding this, which other threads wait on, GIL released */
  int refill_ready;        /* `refill` initialised */
  struct open_set *open;   /* the open chunks new rows go to, or NULL */
  PyObject *release_fn;    /* release(offs, pins, rows, capacity): shrinks, unpins a retired set */
} InsertPlan;

static PyObject *str_registration;

/* Strong references taken while matching, released after the core call. */
typedef struct {
  PyObject *held[HOT_MAX_NODES + HOT_MAX_COLS + 1];
  int nheld;
  const uint8_t *data[HOT_MAX_COLS];
  union { double d; int64_t i; npy_bool b; long double ld; char raw[32]; } values[HOT_MAX_COLS];
  npy_intp batch;          /* batched: rows of every leaf (-1 until the first leaf) */
} hot_gather;

static void release_held(hot_gather *g) {
  while (g->nheld > 0) Py_DECREF(g->held[--g->nheld]);
}

static int hold(hot_gather *g, PyObject *o) {
  if (g->nheld >= (int)(sizeof g->held / sizeof g->held[0])) return 0;
  Py_INCREF(o);
  g->held[g->nheld++] = o;
  return 1;
}

/* 1 when leaf `lf` takes `obj` (its bytes recorded in g), else 0 (no Python error set). */
static int gather_leaf(const InsertPlan *p, const hot_leaf *lf, int col, PyObject *obj,
                       hot_gather *g) {
  PyTypeObject *t = Py_TYPE(obj);
  if (lf->kind == LEAF_VALUE) {
    if (t == lf->descr->typeobj) {
      PyArray_ScalarAsCtype(obj, g->values[col].raw);
    } else if (t == &PyFloat_Type && lf->py == PY_FLOAT) {
      g->values[col].d = PyFloat_AS_DOUBLE(obj);
    } else if (t == &PyLong_Type && lf->py == PY_INT) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
      if (overflow || (v == -1 && PyErr_Occurred())) {   /* numpy makes it uint64 or refuses */
        PyErr_Clear();
        return 0;
      }
      g->values[col].i = v;
    } else if (t == &PyBool_Type && lf->py == PY_BOOL) {
      g->values[col].b = obj == Py_True;
    } else {
      return 0;
    }
    g->data[col] = (const uint8_t *)g->values[col].raw;
    return 1;
  }
  if (t != &PyArray_Type) return 0;
  PyArrayObject *a = (PyArrayObject *)obj;
  PyArray_Descr *d = PyArray_DESCR(a);
  if (d != lf->descr && !PyArray_EquivTypes(d, lf->descr)) return 0;
  int skip = p->batched;
  if (PyArray_NDIM(a) != lf->ndim + skip) return 0;
  npy_intp *dims = PyArray_DIMS(a);
  if (skip) {
    if (g->batch < 0) g->batch = dims[0];
    else if (dims[0] != g->batch) return 0;
  }
  for (int i = 0; i < lf->ndim; i++)
    if (dims[i + skip] != lf->dims[i]) return 0;
  if (!PyArray_IS_C_CONTIGUOUS(a)) {   /* the Python path copies it too */
    PyObject *copy = PyArray_NewCopy(a, NPY_CORDER);
    if (copy == NULL) {
      PyErr_Clear();
      return 0;
    }
    int ok = hold(g, copy);
    Py_DECREF(copy);
    if (!ok) return 0;
    a = (PyArrayObject *)copy;
  }
  g->data[col] = (const uint8_t *)PyArray_DATA(a);
  return 1;
}

/* Matches `obj` against the template from node *ni on (advancing it); 1 on a match. Every
 * object reached is held, so Python code run by a lookup (a key's __eq__) frees none of them. */
static int match(const InsertPlan *p, Py_ssize_t *ni, PyObject *obj, hot_gather *g) {
  const hot_node *nd = &p->nodes[(*ni)++];
  switch (nd->kind) {
    case NODE_LEAF:
      return gather_leaf(p, &p->leaves[nd->leaf], nd->leaf, obj, g);
    case NODE_DICT:
      if (!PyDict_CheckExact(obj) || PyDict_GET_SIZE(obj) != nd->n) return 0;
      for (Py_ssize_t i = 0; i < nd->n; i++) {
        PyObject *v = PyDict_GetItemWithError(obj, nd->keys[i]);
        if (v == NULL) {
          PyErr_Clear();
          return 0;
        }
        if (!hold(g, v) || !match(p, ni, v, g)) return 0;
      }
      return 1;
    case NODE_LIST:
    case NODE_TUPLE:
      if (nd->kind == NODE_LIST ? !PyList_CheckExact(obj) : !PyTuple_CheckExact(obj)) return 0;
      for (Py_ssize_t i = 0; i < nd->n; i++) {
        /* (a list may change size while a nested lookup runs Python: checked per item) */
        if (PySequence_Fast_GET_SIZE(obj) != nd->n) return 0;
        PyObject *v = PySequence_Fast_GET_ITEM(obj, i);
        if (!hold(g, v) || !match(p, ni, v, g)) return 0;
      }
      return PySequence_Fast_GET_SIZE(obj) == nd->n;
  }
  return 0;
}

/* The priority as a double when it is a finite float, or an int a double holds exactly, and
 * admitted by the table's sign rule (>= 0 when prioritized); else 0 (the Python path decides). */
static int plain_priority(PyObject *obj, int prioritized, double *out) {
  double v;
  if (PyFloat_CheckExact(obj)) {
    v = PyFloat_AS_DOUBLE(obj);
  } else if (PyLong_CheckExact(obj)) {
    int overflow = 0;
    long long i = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (i == -1 && PyErr_Occurred()) || i <= -(1LL << 53) || i >= (1LL << 53)) {
      PyErr_Clear();
      return 0;
    }
    v = (double)i;
  } else {
    return 0;
  }
  if (!hot_priority_ok(v, prioritized)) return 0;
  *out = v;
  return 1;
}

static int one_priority(const InsertPlan *p, PyObject *obj, double *out) {
  return plain_priority(obj, p->prioritized, out);
}

/* The deadline of timeout_ms (None: -1) by Python's rules (the plan's deadline_fn): 1, or 0 for
 * an invalid timeout, which the Python path then raises. */
static int plan_deadline(const InsertPlan *p, PyObject *timeout_ms, int64_t *out) {
  *out = -1;
  if (timeout_ms == Py_None) return 1;
  PyObject *r = PyObject_CallOneArg(p->deadline_fn, timeout_ms);
  if (r != NULL) {
    *out = PyLong_AsLongLong(r);
    Py_DECREF(r);
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return 0;
  }
  return 1;
}

/* ---------------------------------------------------------------- open chunks
 * Small inserts (one step, or a batch of at most open_rows / 4 rows) append their rows to chunks
 * the plan holds open (one per column, pinned by this process's slot, capacity growing from 16
 * rows up to open_rows) instead of allocating chunks of their own, so consecutive items cost
 * their payload plus a share of the chunk headers, and share one descriptor block (the core
 * shares the previous item's block when only the row offset differs).
 * Every field below is read and written with the GIL held: a call reserves its rows (and counts
 * itself a user of the set) under the GIL, then copies and inserts with the GIL released. A set
 * that fills up is retired: the plan stops using it and the last user releases it (release_fn:
 * shrink to the rows reserved, drop the pins, both only while the plan's registration is
 * current). A process that dies holding a set loses nothing but the set's unused rows: its pins
 * are reclaimed by rs_reap, and rows written for items never inserted are never referenced. */
typedef struct open_set {
  uint64_t offs[HOT_MAX_COLS];
  uint32_t pins[HOT_MAX_COLS];
  uint32_t capacity, next_row, users;
  int retired;
} open_set;

/* Two new lists: the n chunk offsets and the n pins (ints); 0, or -1 (exception set, both NULL). */
static int held_lists(uint32_t n, const uint64_t *offs, const uint32_t *pins, PyObject **offs_out,
                      PyObject **pins_out) {
  PyObject *ol = PyList_New(n), *pl = PyList_New(n);
  int ok = ol != NULL && pl != NULL;
  for (uint32_t c = 0; ok && c < n; c++) {
    PyObject *o = PyLong_FromUnsignedLongLong(offs[c]), *q = PyLong_FromUnsignedLong(pins[c]);
    if (o == NULL || q == NULL) {
      Py_XDECREF(o);
      Py_XDECREF(q);
      ok = 0;
      break;
    }
    PyList_SET_ITEM(ol, c, o);
    PyList_SET_ITEM(pl, c, q);
  }
  if (!ok) {
    Py_XDECREF(ol);
    Py_XDECREF(pl);
    ol = pl = NULL;
  }
  *offs_out = ol;
  *pins_out = pl;
  return ok ? 0 : -1;
}

/* Drops set s (GIL held; any pending exception is kept). */
static void open_release(InsertPlan *p, open_set *s) {
  if (p->fork_epoch == hot_fork_epoch && p->release_fn != NULL) {   /* a fork child never touches them */
    PyObject *type, *value, *tb, *offs, *pins, *r = NULL;
    PyErr_Fetch(&type, &value, &tb);
    if (held_lists(p->ncols, s->offs, s->pins, &offs, &pins) == 0)
      r = PyObject_CallFunction(p->release_fn, "OOII", offs, pins, s->next_row, s->capacity);
    if (r == NULL) PyErr_WriteUnraisable(p->release_fn);
    Py_XDECREF(r);
    Py_XDECREF(offs);
    Py_XDECREF(pins);
    PyErr_Restore(type, value, tb);
  }
  PyMem_Free(s);
}

static void open_unuse(InsertPlan *p, open_set *s) {
  if (--s->users == 0 && s->retired) open_release(p, s);
}

/* The open set holding n more rows, rows [*row, *row + n) reserved in it for the caller (a user
 * until open_unuse); NULL when the caller should take the one-shot path instead (the chunks
 * could not be opened: that path allocates and reports) or on an internal error (Python
 * exception set). A thread finding another one opening chunks waits for it (GIL released). */
static open_set *open_reserve(InsertPlan *p, uint32_t n, uint32_t *row) {
  open_set *s = p->open;
  while (p->refilling) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->refill);
    pthread_mutex_unlock(&p->refill);
    Py_END_ALLOW_THREADS
    s = p->open;
  }
  if (s != NULL && s->capacity - s->next_row >= n) {
    *row = s->next_row;
    s->next_row += n;
    s->users++;
    return s;
  }
  /* Full: retired. Released here when it has no user now, else by its last user (who may do
   * so while the GIL is released below: `old` must not be read after that). */
  open_set *old = s != NULL && s->users == 0 ? s : NULL;
  p->open = NULL;
  if (s != NULL) s->retired = 1;
  uint32_t cap = p->next_cap;
  while (cap < n) cap *= 2;
  if (cap > p->open_rows) cap = p->open_rows;
  s = PyMem_Calloc(1, sizeof *s);
  if (s == NULL) {
    PyErr_NoMemory();
  } else {
    int rc;
    p->refilling = 1;
    pthread_mutex_lock(&p->refill);   /* (uncontended: only a refiller takes it, under the GIL) */
    Py_BEGIN_ALLOW_THREADS
    rc = hot_core.open_chunks(p->base, p->slot, p->ncols, p->metas, cap, 0, p->open_flags,
                              s->offs, s->pins);
    Py_END_ALLOW_THREADS
    if (rc == RS_OK) {
      s->capacity = cap;
      s->next_row = n;
      s->users = 1;
      *row = 0;
      p->open = s;
      p->next_cap = cap * 2 < p->open_rows ? cap * 2 : p->open_rows;
    } else {
      PyMem_Free(s);
      s = NULL;
    }
    p->refilling = 0;
    pthread_mutex_unlock(&p->refill);
  }
  if (old != NULL) open_release(p, old);   /* (may run Python) */
  return s;
}

/* Python's state for a core status other than RS_OK: (plan, status, done, deadline_ns, keys,
 * chunk offsets, pins) with the chunks still held (nheld of them: RS_EAGAIN of the one-shot
 * path), or none. NULL on an internal error. */
static PyObject *status_result(InsertPlan *p, int rc, uint32_t done_n, int64_t deadline,
                               PyObject *keys_array, uint64_t one_key, uint32_t nheld,
                               const uint64_t *offs, const uint32_t *pins) {
  PyObject *result = NULL, *offs_list, *pins_list;
  PyObject *keys_obj = p->batched ? Py_NewRef(keys_array) : PyLong_FromUnsignedLongLong(one_key);
  if (keys_obj != NULL && held_lists(nheld, offs, pins, &offs_list, &pins_list) == 0) {
    result = Py_BuildValue("(OiILOOO)", (PyObject *)p, rc, done_n, (long long)deadline, keys_obj,
                           offs_list, pins_list);
    Py_DECREF(offs_list);
    Py_DECREF(pins_list);
  }
  Py_XDECREF(keys_obj);
  return result;
}

/* Rows [row, row + n) of set s (reserved): copy and insert, waiting past rate-limiter slices
 * here (signals are checked between slices, as the Python path's loop does). Returns the core
 * status; *done_out = items inserted; -100 when a signal handler raised (exception set). */
#define OPEN_INTERRUPTED (-100)
static int open_insert(InsertPlan *p, open_set *s, uint32_t row, uint32_t n, uint64_t *keys,
                       const double *prios, const uint8_t *const *data, int64_t deadline,
                       uint32_t *done_out) {
  uint32_t flags = p->rows_flags & RS_ROWS_RANDOM_KEYS, total = 0, done_n = 0;
  int rc;
  for (;;) {
    Py_BEGIN_ALLOW_THREADS
    rc = hot_core.insert_rows_at(p->base, p->slot, p->table, n - total, keys + total,
                                 prios + total, p->ncols, s->offs, row + total, data,
                                 p->col_flags, flags, deadline, p->slice_ns, &done_n);
    Py_END_ALLOW_THREADS
    total += done_n;
    if (rc != RS_EAGAIN) break;
    data = NULL;   /* the rows are written: insert the rest */
    flags = 0;
    if (PyErr_CheckSignals() < 0) {
      rc = OPEN_INTERRUPTED;
      break;
    }
  }
  open_unuse(p, s);
  *done_out = total;
  return rc;
}

/* The plan's insert: Py_True (one step) / the uint64[n] keys (batched) on success; None when
 * not handled (nothing done); (plan, status, done, deadline_ns, keys, chunk offsets, pins) when
 * the core call returned another status; NULL only on an internal error (out of memory). */
static PyObject *plan_insert(InsertPlan *p, PyObject *data, PyObject *priorities,
                             PyObject *timeout_ms) {
  if (p->fork_epoch != hot_fork_epoch) Py_RETURN_NONE;
  PyObject *reg = PyObject_GetAttr(p->segment, str_registration);
  if (reg == NULL) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  Py_DECREF(reg);   /* (compared by identity only; the plan holds its own reference) */
  if (reg != p->registration) Py_RETURN_NONE;

  double one_prio = 0;
  PyArrayObject *prio_array = NULL;
  if (!one_priority(p, priorities, &one_prio)) {
    if (!p->batched || Py_TYPE(priorities) != &PyArray_Type) Py_RETURN_NONE;
    prio_array = (PyArrayObject *)priorities;   /* checked below, once the batch is known */
    PyArray_Descr *d = PyArray_DESCR(prio_array);
    if (d->type_num != NPY_DOUBLE || !PyArray_ISNBO(d->byteorder) || PyArray_NDIM(prio_array) != 1
        || !PyArray_IS_C_CONTIGUOUS(prio_array))
      Py_RETURN_NONE;
  }

  int64_t deadline;   /* (before any object of `data` is held) */
  if (!plan_deadline(p, timeout_ms, &deadline)) Py_RETURN_NONE;

  hot_gather g;
  g.nheld = 0;
  g.batch = -1;
  Py_ssize_t ni = 0;
  PyObject *result = NULL;
  PyObject *keys_array = NULL;
  double *prios_heap = NULL;
  if (!match(p, &ni, data, &g) || ni != p->nnodes) goto declined;
  uint32_t n = 1;
  if (p->batched) {
    if (g.batch < 1 || g.batch > (npy_intp)UINT32_MAX) goto declined;
    n = (uint32_t)g.batch;
  }
  double stack_prios[HOT_STACK_PRIOS];
  const double *prios = &one_prio;
  if (prio_array != NULL) {
    if (PyArray_DIM(prio_array, 0) != (npy_intp)n) goto declined;
    prios = (const double *)PyArray_DATA(prio_array);
    for (uint32_t i = 0; i < n; i++)
      if (!hot_priority_ok(prios[i], p->prioritized)) goto declined;
    if (!hold(&g, priorities)) goto declined;
  } else if (n > 1) {
    double *fill = stack_prios;
    if (n > HOT_STACK_PRIOS) {
      fill = prios_heap = PyMem_Malloc(sizeof(double) * n);
      if (fill == NULL) {
        PyErr_NoMemory();
        goto done;
      }
    }
    for (uint32_t i = 0; i < n; i++) fill[i] = one_prio;
    prios = fill;
  }
  uint64_t one_key = 0, *keys = &one_key;
  if (p->batched) {
    npy_intp dim = n;
    keys_array = PyArray_SimpleNew(1, &dim, NPY_UINT64);
    if (keys_array == NULL) goto done;
    keys = (uint64_t *)PyArray_DATA((PyArrayObject *)keys_array);
  }

  uint64_t offs[HOT_MAX_COLS];
  uint32_t pins[HOT_MAX_COLS], done_n = 0, row = 0, nheld = p->ncols;
  int rc;
  open_set *set = NULL;
  if (p->open_rows != 0 && (uint64_t)n * 4 <= p->open_rows) {
    set = open_reserve(p, n, &row);
    if (set == NULL && PyErr_Occurred()) goto done;
  }
  if (set != NULL) {
    rc = open_insert(p, set, row, n, keys, prios, g.data, deadline, &done_n);
    if (rc == OPEN_INTERRUPTED) goto done;
    nheld = 0;   /* the plan keeps the chunks */
  } else {
    Py_BEGIN_ALLOW_THREADS
    rc = hot_core.insert_rows(p->base, p->slot, p->table, n, keys, prios, p->ncols, p->metas,
                              g.data, p->col_flags, 0, p->rows_flags, deadline, p->slice_ns, offs,
                              pins, &done_n);
    Py_END_ALLOW_THREADS
  }
  if (rc == RS_OK) {
    if (p->batched) {
      result = keys_array;
      keys_array = NULL;
    } else {
      result = Py_NewRef(Py_True);
    }
    goto done;
  }
  /* Python finishes (RS_EAGAIN of the one-shot path: the held chunks' items) or raises (_lib). */
  result = status_result(p, rc, done_n, deadline, keys_array, one_key, nheld, offs, pins);
  goto done;
declined:
  result = Py_NewRef(Py_None);
done:
  release_held(&g);
  Py_XDECREF(keys_array);
  PyMem_Free(prios_heap);
  return result;
}

/* stage(step, priority, row): StepInserter.insert's staging of one step into row `row` of the
 * staging arrays; True when staged, False when not handled (nothing written). */
static PyObject *InsertPlan_stage(InsertPlan *p, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "stage(step, priority, row) takes 3 arguments");
    return NULL;
  }
  double prio;
  Py_ssize_t row = PyLong_AsSsize_t(args[2]);
  if (row == -1 && PyErr_Occurred()) return NULL;
  if (p->capacity == 0 || row < 0 || row >= (Py_ssize_t)p->capacity ||
      !one_priority(p, args[1], &prio))
    Py_RETURN_FALSE;
  hot_gather g;
  g.nheld = 0;
  g.batch = -1;
  Py_ssize_t ni = 0;
  int ok = match(p, &ni, args[0], &g) && ni == p->nnodes;
  if (ok) {
    for (uint32_t c = 0; c < p->ncols; c++) {
      uint64_t bytes = p->metas[c].row_bytes;
      memcpy(p->stage_rows[c] + (uint64_t)row * bytes, g.data[c], bytes);
    }
    p->stage_prios[row] = prio;
  }
  release_held(&g);
  return PyBool_FromLong(ok);
}

static PyObject *InsertPlan_insert(InsertPlan *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "insert(data, priorities, timeout_ms) takes 3 arguments");
    return NULL;
  }
  return plan_insert(self, args[0], args[1], args[2]);
}

static PyTypeObject InsertPlan_Type;

#define HOT_MAX_TABLES 16   /* tables of one Client.insert taken by multi_insert */

/* 1 when plans p and q take exactly the same data (template nodes, leaves, column flags) into
 * tables of the same registration, so that rows p wrote may be referenced by q's items. */
static int same_layout(const InsertPlan *p, const InsertPlan *q) {
  if (q->segment != p->segment || q->registration != p->registration || q->base != p->base ||
      q->slot != p->slot || q->fork_epoch != p->fork_epoch || q->nnodes != p->nnodes ||
      q->ncols != p->ncols || q->batched || q->capacity != 0)
    return 0;
  for (Py_ssize_t i = 0; i < p->nnodes; i++) {
    const hot_node *a = &p->nodes[i], *b = &q->nodes[i];
    if (a->kind != b->kind || a->n != b->n || a->leaf != b->leaf) return 0;
    if (a->kind == NODE_DICT)   /* (interned keys: equal keys are the same objects) */
      for (Py_ssize_t k = 0; k < a->n; k++)
        if (a->keys[k] != b->keys[k]) return 0;
  }
  for (uint32_t c = 0; c < p->ncols; c++) {
    const hot_leaf *a = &p->leaves[c], *b = &q->leaves[c];
    if (a->kind != b->kind || a->ndim != b->ndim || a->py != b->py ||
        p->col_flags[c] != q->col_flags[c] ||
        (a->descr != b->descr && !PyArray_EquivTypes(a->descr, b->descr)))
      return 0;
    for (int d = 0; d < a->ndim; d++)
      if (a->dims[d] != b->dims[d]) return 0;
  }
  return 1;
}

/* Client.insert of one step into the 2..HOT_MAX_TABLES tables of `priorities` (in its order),
 * each through plans[table]: the step is written once, into a row of the first plan's open
 * chunks, and every table's item references that row (as the Python path's one write shared by
 * every table). Taken only when every table has a non-batched plan of the same layout whose
 * priority is valid (nothing is written otherwise); returns as plan_insert, with the status
 * result of the first table whose insert failed (the items of the tables before it stay). */
static PyObject *multi_insert(PyObject *plans, PyObject *data, PyObject *priorities,
                              PyObject *timeout_ms) {
  Py_ssize_t nt = PyDict_GET_SIZE(priorities), pos = 0, k = 0;
  if (nt > HOT_MAX_TABLES) Py_RETURN_NONE;
  InsertPlan *ps[HOT_MAX_TABLES];
  double prios[HOT_MAX_TABLES];
  PyObject *name, *prio;
  /* (exact str keys and exact float / int priorities: no Python code runs in this loop) */
  while (PyDict_Next(priorities, &pos, &name, &prio)) {
    if (k >= nt || !PyUnicode_CheckExact(name)) Py_RETURN_NONE;
    PyObject *plan = PyDict_GetItemWithError(plans, name);
    if (plan == NULL || Py_TYPE(plan) != &InsertPlan_Type) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    InsertPlan *q = (InsertPlan *)plan;
    if (q->batched || q->capacity != 0 || (k > 0 && !same_layout(ps[0], q)) ||
        !one_priority(q, prio, &prios[k]))
      Py_RETURN_NONE;
    ps[k++] = q;
  }
  InsertPlan *p = ps[0];
  if (k != nt || p->open_rows == 0 || p->fork_epoch != hot_fork_epoch) Py_RETURN_NONE;
  for (Py_ssize_t t = 0; t < nt; t++) Py_INCREF(ps[t]);   /* Python may run from here on */
  PyObject *result = NULL;
  hot_gather g;
  g.nheld = 0;
  g.batch = -1;
  PyObject *reg = PyObject_GetAttr(p->segment, str_registration);
  if (reg == NULL) PyErr_Clear();
  else Py_DECREF(reg);   /* (compared by identity only; the plan holds its own reference) */
  if (reg != p->registration) goto declined;
  for (Py_ssize_t t = 1; t < nt; t++)   /* (the first table's are checked by its insert) */
    if (hot_core.check_priorities(p->base, ps[t]->table, 1, &prios[t]) != RS_OK) goto declined;
  int64_t deadline;   /* (before any object of `data` is held) */
  if (!plan_deadline(p, timeout_ms, &deadline)) goto declined;
  Py_ssize_t ni = 0;
  if (!match(p, &ni, data, &g) || ni != p->nnodes) goto declined;
  uint32_t row = 0;
  open_set *set = open_reserve(p, 1, &row);
  if (set == NULL) {
    if (!PyErr_Occurred()) goto declined;   /* (the Python path allocates and reports) */
    goto done;
  }
  for (Py_ssize_t t = 0; t < nt; t++) {
    InsertPlan *q = ps[t];
    const uint8_t *const *rows = t == 0 ? g.data : NULL;   /* written once, by the first */
    uint32_t flags = RS_ROWS_RANDOM_KEYS, total = 0, done_n = 0;
    uint64_t key = 0;
    int rc;
    for (;;) {   /* waits past rate-limiter slices here, as open_insert */
      Py_BEGIN_ALLOW_THREADS
      rc = hot_core.insert_rows_at(q->base, q->slot, q->table, 1 - total, &key, &prios[t],
                                   q->ncols, set->offs, row, rows, q->col_flags, flags, deadline,
                                   q->slice_ns, &done_n);
      Py_END_ALLOW_THREADS
      total += done_n;
      if (rc != RS_EAGAIN) break;
      rows = NULL;
      flags = 0;
      if (PyErr_CheckSignals() < 0) {
        rc = OPEN_INTERRUPTED;
        break;
      }
    }
    if (rc == OPEN_INTERRUPTED) break;   /* (result NULL: the handler's exception) */
    if (rc != RS_OK) {
      result = status_result(q, rc, total, deadline, NULL, key, 0, NULL, NULL);
      break;
    }
    if (t == nt - 1) result = Py_NewRef(Py_True);
  }
  open_unuse(p, set);
  goto done;
declined:
  result = Py_NewRef(Py_None);
done:
  release_held(&g);
  for (Py_ssize_t t = 0; t < nt; t++) Py_DECREF(ps[t]);
  return result;
}

/* client_insert(plans, data, priorities, timeout_ms): Client.insert's fast path. */
static PyObject *hot_client_insert(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError,
                    "client_insert(plans, data, priorities, timeout_ms) takes 4 arguments");
    return NULL;
  }
  PyObject *plans = args[0], *priorities = args[2], *name, *prio;
  Py_ssize_t pos = 0;
  if (!PyDict_CheckExact(plans) || !PyDict_CheckExact(priorities)) Py_RETURN_NONE;
  if (PyDict_GET_SIZE(priorities) > 1) return multi_insert(plans, args[1], priorities, args[3]);
  if (PyDict_GET_SIZE(priorities) != 1 || !PyDict_Next(priorities, &pos, &name, &prio) ||
      !PyUnicode_CheckExact(name))
    Py_RETURN_NONE;
  PyObject *plan = PyDict_GetItemWithError(plans, name);   /* (exact str: no Python runs) */
  if (plan == NULL || Py_TYPE(plan) != &InsertPlan_Type || ((InsertPlan *)plan)->batched) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  Py_INCREF(plan);
  Py_INCREF(prio);
  PyObject *r = plan_insert((InsertPlan *)plan, args[1], prio, args[3]);
  Py_DECREF(prio);
  Py_DECREF(plan);
  return r;
}

/* ---------------------------------------------------------------- mutate_priorities(dict)
 * Client.mutate_priorities(table, updates={key: priority}) in one C call: the dict's keys and
 * priorities read into two arrays and one rs_mutate with the GIL released. Only plain entries
 * are taken (plain_key, plain_priority); for any other entry nothing is done and None is
 * returned: the Python path then converts or rejects the dict with its own messages. */
#define HOT_MUTATE_STACK 512   /* entries read into arrays on the stack up to this many */

/* The item key as a uint64 when it is a Python int in [0, 2**64) or a numpy uint64 scalar; 0
 * otherwise (no error set). */
static int plain_key(PyObject *obj, uint64_t *out) {
  if (PyLong_CheckExact(obj)) {
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    /* Before 3.12 an int is its signed digit count (Py_SIZE) and 30-bit digits, least
     * significant first: keys of up to three digits (all of [0, 2**64)) read here directly. */
    Py_ssize_t size = Py_SIZE(obj);
    const digit *d = ((PyLongObject *)obj)->ob_digit;
    if (size >= 0 && size <= 3 && (size < 3 || d[2] < (1u << 4))) {
      uint64_t v = 0;
      for (Py_ssize_t k = size - 1; k >= 0; k--) v = (v << PyLong_SHIFT) | d[k];
      *out = v;
      return 1;
    }
#endif
    /* (PyLong_AsUnsignedLong reads the digits; the long long variant goes through a byte
     * array, 3x slower) */
    unsigned long long v = sizeof(unsigned long) == 8 ? PyLong_AsUnsignedLong(obj)
                                                      : PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {   /* negative or >= 2**64 */
      PyErr_Clear();
      return 0;
    }
    *out = v;
    return 1;
  }
  if (Py_TYPE(obj) == &PyULongArrType_Type && sizeof(npy_ulong) == 8) {
    *out = PyArrayScalar_VAL(obj, ULong);
    return 1;
  }
  if (Py_TYPE(obj) == &PyULongLongArrType_Type && sizeof(npy_ulonglong) == 8) {
    *out = PyArrayScalar_VAL(obj, ULongLong);
    return 1;
  }
  return 0;
}

/* mutate_dict(address, table, updates, prioritized) -> (status, updated), or None. */
static PyObject *mutate_dict(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyLong_CheckExact(args[0]) || !PyLong_CheckExact(args[1]) ||
      !PyDict_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "mutate_dict(address, table, updates, prioritized) takes "
                    "two ints, a dict and a bool");
    return NULL;
  }
  void *base = PyLong_AsVoidPtr(args[0]);
  unsigned long table = PyLong_AsUnsignedLong(args[1]);
  int prioritized = PyObject_IsTrue(args[3]);
  if ((base == NULL && PyErr_Occurred()) || (table == (unsigned long)-1 && PyErr_Occurred()) ||
      prioritized < 0)
    return NULL;
  if (base == NULL || table > UINT32_MAX) {
    PyErr_SetString(PyExc_ValueError, "mutate_dict: null address or table index out of range");
    return NULL;
  }
  PyObject *updates = args[2];
  if (!hot_core_bound) {
    PyErr_SetString(PyExc_RuntimeError, "reverb_shm._hot is not bound to the core");
    return NULL;
  }
  Py_ssize_t n = PyDict_GET_SIZE(updates);
  if (n < 1 || n > (Py_ssize_t)UINT32_MAX / 2) Py_RETURN_NONE;
  uint64_t stack[2 * HOT_MUTATE_STACK];   /* keys, then priorities */
  uint64_t *keys = n <= HOT_MUTATE_STACK
                      ? stack : PyMem_Malloc((size_t)n * (sizeof(uint64_t) + sizeof(double)));
  if (keys == NULL) return PyErr_NoMemory();
  double *prios = (double *)(keys + n);
  Py_ssize_t pos = 0, i = 0;
  PyObject *key, *value;
  /* (no Python code runs in this loop: the dict cannot change under it) */
  while (PyDict_Next(updates, &pos, &key, &value)) {
    if (i >= n || !plain_key(key, &keys[i]) || !plain_priority(value, prioritized, &prios[i])) {
      if (keys != stack) PyMem_Free(keys);
      Py_RETURN_NONE;
    }
    i++;
  }
  uint32_t updated = 0, deleted = 0;
  uint64_t no_key = 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = hot_core.mutate(base, (uint32_t)table, (uint32_t)i, keys, prios, 0, &no_key, &updated,
                       &deleted);
  Py_END_ALLOW_THREADS
  if (keys != stack) PyMem_Free(keys);
  return Py_BuildValue("(iI)", rc, updated);
}

/* ---------------------------------------------------------------- construction */

static void InsertPlan_dealloc(InsertPlan *self) {
  if (self->nodes != NULL) {
    for (Py_ssize_t i = 0; i < self->nnodes; i++) {
      hot_node *nd = &self->nodes[i];
      if (nd->kind == NODE_DICT && nd->keys != NULL) {
        for (Py_ssize_t k = 0; k < nd->n; k++) Py_XDECREF(nd->keys[k]);
        PyMem_Free(nd->keys);
      }
    }
    PyMem_Free(self->nodes);
  }
  if (self->leaves != NULL) {
    for (uint32_t c = 0; c < self->ncols; c++) Py_XDECREF(self->leaves[c].descr);
    PyMem_Free(self->leaves);
  }
  Py_XDECREF(self->segment);
  Py_XDECREF(self->registration);
  Py_XDECREF(self->deadline_fn);
  if (self->open != NULL) {   /* no call is using it: each holds a reference to the plan */
    open_set *s = self->open;
    self->open = NULL;
    s->retired = 1;
    if (s->users == 0) open_release(self, s);
  }
  if (self->refill_ready) pthread_mutex_destroy(&self->refill);
  Py_XDECREF(self->release_fn);
  Py_XDECREF(self->context);
  PyMem_Free(self->stage_rows);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int spec_error(const char *what) {
  PyErr_Format(PyExc_ValueError, "InsertPlan template: %s", what);
  return -1;
}

/* Appends the nodes (and leaves) of template `spec` in pre-order; -1 with an error set. */
static int compile_spec(InsertPlan *p, PyObject *spec, int batched) {
  if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 2) return spec_error("nodes are tuples");
  long kind = PyLong_AsLong(PyTuple_GET_ITEM(spec, 0));
  if (kind == -1 && PyErr_Occurred()) return -1;
  if (p->nnodes >= HOT_MAX_NODES) return spec_error("too many nodes");
  Py_ssize_t me = p->nnodes++;
  hot_node *nd = &p->nodes[me];
  nd->kind = (int)kind;
  if (kind == NODE_LEAF) {
    if (p->ncols >= HOT_MAX_COLS) return spec_error("too many leaves");
    PyObject *leaf_kind = PyTuple_GET_ITEM(spec, 1);
    if (!PyUnicode_Check(leaf_kind)) return spec_error("a leaf kind is 'a' or 'v'");
    hot_leaf *lf = &p->leaves[p->ncols];
    nd->leaf = (int)p->ncols++;
    if (PyTuple_GET_SIZE(spec) < 3 || !PyArray_DescrCheck(PyTuple_GET_ITEM(spec, 2)))
      return spec_error("a leaf needs a dtype");
    lf->descr = (PyArray_Descr *)Py_NewRef(PyTuple_GET_ITEM(spec, 2));
    if (!PyTypeNum_ISNUMBER(lf->descr->type_num) && lf->descr->type_num != NPY_BOOL)
      return spec_error("numeric dtypes only");
    if (PyUnicode_CompareWithASCIIString(leaf_kind, "a") == 0) {
      PyObject *shape = PyTuple_GET_SIZE(spec) == 4 ? PyTuple_GET_ITEM(spec, 3) : NULL;
      if (shape == NULL || !PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > NPY_MAXDIMS - 1)
        return spec_error("an array leaf needs a shape tuple");
      lf->kind = LEAF_ARRAY;
      lf->ndim = (int)PyTuple_GET_SIZE(shape);
      for (int i = 0; i < lf->ndim; i++) {
        lf->dims[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (lf->dims[i] == -1 && PyErr_Occurred()) return -1;
      }
      return 0;
    }
    if (PyUnicode_CompareWithASCIIString(leaf_kind, "v") != 0 || batched)
      return spec_error("leaves are 'a' (arrays) or 'v' (values, not batched)");
    if (!PyArray_ISNBO(lf->descr->byteorder)) return spec_error("values have native dtypes");
    lf->kind = LEAF_VALUE;
    int t = lf->descr->type_num;
    lf->py = t == NPY_DOUBLE ? PY_FLOAT : t == NPY_LONG && sizeof(long) == 8 ? PY_INT
           : t == NPY_BOOL ? PY_BOOL : PY_NONE;
    return 0;
  }
  PyObject *children = PyTuple_GET_ITEM(spec, PyTuple_GET_SIZE(spec) - 1);
  if (!PyTuple_Check(children)) return spec_error("children are a tuple");
  nd->n = PyTuple_GET_SIZE(children);
  if (kind == NODE_DICT) {
    PyObject *keys = PyTuple_GET_ITEM(spec, 1);
    if (PyTuple_GET_SIZE(spec) != 3 || !PyTuple_Check(keys) || PyTuple_GET_SIZE(keys) != nd->n)
      return spec_error("a dict node is (0, keys, children)");
    nd->keys = PyMem_Calloc(nd->n ? nd->n : 1, sizeof(PyObject *));
    if (nd->keys == NULL) {
      PyErr_NoMemory();
      return -1;
    }
    for (Py_ssize_t k = 0; k < nd->n; k++) {
      PyObject *key = PyTuple_GET_ITEM(keys, k);
      if (!PyUnicode_CheckExact(key)) return spec_error("dict keys are str");
      Py_INCREF(key);
      PyUnicode_InternInPlace(&key);
      p->nodes[me].keys[k] = key;
    }
  } else if (kind != NODE_LIST && kind != NODE_TUPLE) {
    return spec_error("unknown node kind");
  }
  for (Py_ssize_t i = 0; i < nd->n; i++)
    if (compile_spec(p, PyTuple_GET_ITEM(children, i), batched) < 0) return -1;
  return 0;
}

static PyObject *InsertPlan_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"template", "batched", "segment", "registration", "base", "slot",
                           "table", "metas", "col_flags", "rows_flags", "prioritized",
                           "slice_ns", "deadline_fn", "context", "stage_rows",
                           "stage_priorities", "capacity", "open_rows", "open_flags", "release",
                           NULL};
  PyObject *spec, *segment, *registration, *deadline_fn, *context, *stage_rows = Py_None;
  PyObject *release = Py_None;
  unsigned long long stage_prios = 0;
  unsigned int capacity = 0, open_rows = 0, open_flags = 0;
  int batched, prioritized;
  unsigned long long base, metas, col_flags;
  unsigned int slot, table, rows_flags;
  long long slice_ns;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OpOOKIIKKIpLOO|$OKIIIO", kwlist, &spec,
                                   &batched, &segment, &registration, &base, &slot, &table,
                                   &metas, &col_flags, &rows_flags, &prioritized, &slice_ns,
                                   &deadline_fn, &context, &stage_rows, &stage_prios,
                                   &capacity, &open_rows, &open_flags, &release))
    return NULL;
  if (!hot_core_bound) {
    PyErr_SetString(PyExc_RuntimeError, "reverb_shm._hot is not bound to the core");
    return NULL;
  }
  if (open_rows != 0 && (capacity != 0 || !PyCallable_Check(release))) {
    PyErr_SetString(PyExc_ValueError, "InsertPlan: open chunks need a release callable and no "
                    "staging");
    return NULL;
  }
  if (!base || !metas || !col_flags || !PyCallable_Check(deadline_fn) ||
      !PyTuple_Check(registration)) {
    PyErr_SetString(PyExc_ValueError, "InsertPlan: null address, deadline_fn not callable or "
                    "registration not a tuple");
    return NULL;
  }
  InsertPlan *p = (InsertPlan *)type->tp_alloc(type, 0);
  if (p == NULL) return NULL;
  p->nodes = PyMem_Calloc(HOT_MAX_NODES, sizeof(hot_node));
  p->leaves = PyMem_Calloc(HOT_MAX_COLS, sizeof(hot_leaf));
  p->segment = Py_NewRef(segment);
  p->registration = Py_NewRef(registration);
  p->deadline_fn = Py_NewRef(deadline_fn);
  p->context = Py_NewRef(context);
  if (p->nodes == NULL || p->leaves == NULL) {
    PyErr_NoMemory();
    goto fail;
  }
  p->batched = batched;
  if (compile_spec(p, spec, batched) < 0) goto fail;
  if (p->ncols == 0) {
    spec_error("no leaves");
    goto fail;
  }
  p->prioritized = prioritized;
  p->base = (void *)(uintptr_t)base;
  p->slot = slot;
  p->table = table;
  p->metas = (const rs_chunk_hdr *)(uintptr_t)metas;
  p->col_flags = (const uint32_t *)(uintptr_t)col_flags;
  p->rows_flags = rows_flags;
  p->slice_ns = slice_ns;
  p->fork_epoch = hot_fork_epoch;
  p->open_rows = open_rows;
  p->open_flags = open_flags;
  p->next_cap = open_rows < 16 ? open_rows : 16;
  if (pthread_mutex_init(&p->refill, NULL) != 0) {
    PyErr_SetString(PyExc_RuntimeError, "InsertPlan: pthread_mutex_init failed");
    goto fail;
  }
  p->refill_ready = 1;
  if (open_rows != 0) p->release_fn = Py_NewRef(release);
  if (capacity > 0) {   /* a stager: the staging arrays' addresses (kept alive by `context`) */
    if (batched || !PyTuple_Check(stage_rows) || PyTuple_GET_SIZE(stage_rows) != p->ncols ||
        !stage_prios) {
      PyErr_SetString(PyExc_ValueError, "InsertPlan: a stager takes one staging address per "
                      "column and a priorities address, and is not batched");
      goto fail;
    }
    p->stage_rows = PyMem_Calloc(p->ncols, sizeof(uint8_t *));
    if (p->stage_rows == NULL) {
      PyErr_NoMemory();
      goto fail;
    }
    for (uint32_t c = 0; c < p->ncols; c++) {
      p->stage_rows[c] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(stage_rows, c));
      if (p->stage_rows[c] == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "InsertPlan: null address");
        goto fail;
      }
    }
    p->stage_prios = (double *)(uintptr_t)stage_prios;
    p->capacity = capacity;
  }
  return (PyObject *)p;
fail:
  Py_DECREF(p);
  return NULL;
}

static PyMethodDef InsertPlan_methods[] = {
    {"insert", (PyCFunction)(void (*)(void))InsertPlan_insert, METH_FASTCALL,
     "insert(data, priorities, timeout_ms): True / the uint64[n] keys (batched) when inserted; "
     "None when not handled (nothing done); (plan, status, done, deadline_ns, keys, chunk "
     "offsets, pins) when the core returned another status."},
    {"stage", (PyCFunction)(void (*)(void))InsertPlan_stage, METH_FASTCALL,
     "stage(step, priority, row): stagers only: copies the step into row `row` of the staging "
     "arrays and the priority into the priorities array; True when staged, False when not "
     "handled (nothing written)."},
    {NULL, NULL, 0, NULL}};

static PyObject *InsertPlan_get_context(InsertPlan *self, void *closure) {
  return Py_NewRef(self->context);
}

static PyObject *InsertPlan_get_ncols(InsertPlan *self, void *closure) {
  return PyLong_FromUnsignedLong(self->ncols);
}

static PyGetSetDef InsertPlan_getset[] = {
    {"context", (getter)InsertPlan_get_context, NULL, "the creator's context object", NULL},
    {"ncols", (getter)InsertPlan_get_ncols, NULL, "number of columns (leaves)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject InsertPlan_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reverb_shm._hot.InsertPlan",
    .tp_basicsize = sizeof(InsertPlan),
    .tp_dealloc = (destructor)InsertPlan_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "InsertPlan(template, batched, segment, registration, base, slot, table, metas, "
              "col_flags, rows_flags, prioritized, slice_ns, deadline_fn, context): one-call "
              "insert of data of one checked layout (made by reverb_shm.hot_plans).",
    .tp_methods = InsertPlan_methods,
    .tp_getset = InsertPlan_getset,
    .tp_new = InsertPlan_new,
};

static PyMethodDef insert_functions[] = {
    {"client_insert", (PyCFunction)(void (*)(void))hot_client_insert, METH_FASTCALL,
     "client_insert(plans, data, priorities, timeout_ms): Client.insert of one step into each "
     "table of `priorities` through plans[table] (non-batched InsertPlans; for several tables "
     "of one layout, the step written once); returns as InsertPlan.insert (None when not "
     "handled; for several tables, the status result of the first that failed)."},
    {"mutate_dict", (PyCFunction)(void (*)(void))mutate_dict, METH_FASTCALL,
     "mutate_dict(address, table, updates, prioritized) -> (status, updated): rs_mutate of a "
     "dict {key: priority} of plain entries (int / numpy uint64 keys, finite float / int "
     "priorities, >= 0 when prioritized) with the GIL released; None, having done nothing, for "
     "any other entry or an empty dict."},
    {NULL, NULL, 0, NULL}};

int hot_insert_init(PyObject *module) {
  str_registration = PyUnicode_InternFromString("_registration");
  if (str_registration == NULL || PyType_Ready(&InsertPlan_Type) < 0) return -1;
  if (PyModule_AddObjectRef(module, "InsertPlan", (PyObject *)&InsertPlan_Type) < 0) return -1;
  return PyModule_AddFunctions(module, insert_functions);
}
