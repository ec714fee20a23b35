/*
 * TrajectoryWriter per-step fast paths: append of a step shaped like the previous one,
 * history[c][-k:] / history[c][i], and create_item of window items of the last item kind.
 *
 * The Python classes of reverb_shm/_internal/history.py and reverb_shm/trajectory_writer.py subclass the C types below, whose fields
 * are member descriptors: Python reads and writes `col.n`, `writer._hist_step`, ... as before
 * while C reads and writes the same fields directly. Each fast path either completes the common
 * case exactly as the Python general path would, or changes nothing and calls the Python method
 * (`_append`, `_create_item`, `_getitem`), which validates and raises. No core calls: rows are
 * published and items inserted by the Python flush (`_flush_batch`), which C calls when the
 * batch is full or earlier items wait for the rate limiter, as the Python path does.
 *
 * Types:
 *   ColumnBase  -> _Column            writer, open (run list or None), n, gen, floor, keep_alive
 *   HistoryBase -> _ColumnHistory     _column; mp_subscript fast cases, else self._getitem(i)
 *   WindowBase  -> TrajectoryColumn   _cells, _squeeze, _path and the window (_win)
 *   WriterBase  -> TrajectoryWriter   append / create_item fast paths and the fields they use
 *   FastAppend                        per-column row targets of the fast append
 *
 * Not thread-safe beyond the GIL (a writer is used by one thread at a time, as documented); no
 * fast path releases the GIL or calls Python code while it holds a borrowed reference.
 * Fork: a FastAppend made before a fork declines in the child (fork epoch, see below), as the
 * Python path's pid check did; the Python slow path then refuses the write.
 */
#include "hot.h"

#include <math.h>
#include <pthread.h>
#include <unistd.h>
#include <structmember.h>


/* TrajectoryColumn (a WindowBase subclass), set by writer_setup(); NULL until then. */
static PyTypeObject *window_type = NULL;

static PyObject *s_getitem, *s_append, *s_create_item, *s_flush_batch, *s_generation,
    *s_priority_bound, *s_renew_fast, *s_note_batch;

#define MAX_LEAVES 64   /* larger steps / items take the Python path */

/* ------------------------------------------------------------------------------------------ */
/* ColumnBase                                                                                 */

typedef struct {
  PyObject_HEAD
  PyObject *writer;      /* the TrajectoryWriter */
  PyObject *open;        /* open run [first_pos, holder, first_row, count] or None */
  Py_ssize_t n;          /* positions since the last clear */
  Py_ssize_t gen;        /* clear generation */
  Py_ssize_t floor;      /* positions below it expired (keep-alive shrunk) */
  Py_ssize_t keep_alive; /* steps kept referenceable */
} ColumnBase;

static int column_traverse(ColumnBase *self, visitproc visit, void *arg) {
  Py_VISIT(self->writer);
  Py_VISIT(self->open);
  return 0;
}

static int column_clear(ColumnBase *self) {
  Py_CLEAR(self->writer);
  Py_CLEAR(self->open);
  return 0;
}

static void column_dealloc(ColumnBase *self) {
  PyObject_GC_UnTrack(self);
  column_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef column_members[] = {
    {"writer", T_OBJECT, offsetof(ColumnBase, writer), 0, "The TrajectoryWriter."},
    {"open", T_OBJECT, offsetof(ColumnBase, open), 0,
     "The run appends extend ([first_pos, holder, first_row, count]) or None."},
    {"n", T_PYSSIZET, offsetof(ColumnBase, n), 0, "Positions since the last buffer clear."},
    {"gen", T_PYSSIZET, offsetof(ColumnBase, gen), 0, "Clear generation of the column."},
    {"floor", T_PYSSIZET, offsetof(ColumnBase, floor), 0, "Positions below it are expired."},
    {"keep_alive", T_PYSSIZET, offsetof(ColumnBase, keep_alive), 0,
     "Steps the column keeps referenceable."},
    {NULL}};

static PyTypeObject ColumnBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "reverb_shm._hot.ColumnBase",
    .tp_basicsize = sizeof(ColumnBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Fields of a TrajectoryWriter column that the C fast paths read and write.",
    .tp_traverse = (traverseproc)column_traverse,
    .tp_clear = (inquiry)column_clear,
    .tp_dealloc = (destructor)column_dealloc,
    .tp_members = column_members,
    .tp_new = PyType_GenericNew,
};

/* The last type found to be a ColumnBase subclass (the writer's _Column): an identity check
 * instead of an MRO walk per call. */
static PyTypeObject *known_column_type = NULL;

static int is_column(PyObject *o) {
  PyTypeObject *t = Py_TYPE(o);
  if (t == known_column_type) return 1;
  if (!PyType_IsSubtype(t, &ColumnBaseType)) return 0;
  Py_INCREF(t);   /* held: its address can then not be reused by another type */
  Py_XSETREF(known_column_type, t);
  return 1;
}

/* First position of the column's open run, or -1 when it has none (or it is malformed). */
static Py_ssize_t open_run_pos(ColumnBase *col) {
  PyObject *run = col->open;
  if (run == NULL || !PyList_CheckExact(run) || PyList_GET_SIZE(run) < 1) return -1;
  PyObject *pos = PyList_GET_ITEM(run, 0);
  if (!PyLong_CheckExact(pos)) return -1;
  Py_ssize_t p = PyLong_AsSsize_t(pos);
  if (p == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return -1;
  }
  return p;
}

/* Positions [first, col->n) are inside the open run and the keep-alive window. */
static int window_in_open_run(ColumnBase *col, Py_ssize_t first) {
  Py_ssize_t pos = open_run_pos(col);
  return pos >= 0 && first >= pos && first >= col->n - col->keep_alive && first >= col->floor;
}

/* ------------------------------------------------------------------------------------------ */
/* WindowBase                                                                                 */

typedef struct {
  PyObject_HEAD
  PyObject *cells;     /* _cells: list of CellRefs, or None for a window */
  PyObject *path;      /* _path */
  PyObject *wcol;      /* window column (ColumnBase), NULL when not a window */
  PyObject *windex;    /* the history index that made the window */
  Py_ssize_t wgen, wstart, wstop;
  char squeeze;        /* _squeeze */
} WindowBase;

static int window_traverse(WindowBase *self, visitproc visit, void *arg) {
  Py_VISIT(self->cells);
  Py_VISIT(self->path);
  Py_VISIT(self->wcol);
  Py_VISIT(self->windex);
  return 0;
}

static int window_clear(WindowBase *self) {
  Py_CLEAR(self->cells);
  Py_CLEAR(self->path);
  Py_CLEAR(self->wcol);
  Py_CLEAR(self->windex);
  return 0;
}

static void window_dealloc(WindowBase *self) {
  PyObject_GC_UnTrack(self);
  window_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *window_get_win(WindowBase *self, void *closure) {
  if (self->wcol == NULL) Py_RETURN_NONE;
  return Py_BuildValue("(OnnnO)", self->wcol, self->wgen, self->wstart, self->wstop,
                       self->windex ? self->windex : Py_None);
}

static int window_set_win(WindowBase *self, PyObject *value, void *closure) {
  if (value == NULL) {
    PyErr_SetString(PyExc_AttributeError, "_win cannot be deleted");
    return -1;
  }
  if (value == Py_None) {
    Py_CLEAR(self->wcol);
    Py_CLEAR(self->windex);
    return 0;
  }
  PyObject *col, *index;
  Py_ssize_t gen, start, stop;
  if (!PyTuple_Check(value) ||
      !PyArg_ParseTuple(value, "O!nnnO;_win must be None or (column, gen, start, stop, index)",
                        &ColumnBaseType, &col, &gen, &start, &stop, &index)) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "_win must be None or (column, gen, start, stop, index)");
    return -1;
  }
  Py_INCREF(col);
  Py_INCREF(index);
  Py_XSETREF(self->wcol, col);
  Py_XSETREF(self->windex, index);
  self->wgen = gen;
  self->wstart = start;
  self->wstop = stop;
  return 0;
}

static PyGetSetDef window_getset[] = {
    {"_win", (getter)window_get_win, (setter)window_set_win,
     "(column, generation, start, stop, index) of a history window, else None.", NULL},
    {NULL}};

static PyMemberDef window_members[] = {
    {"_cells", T_OBJECT, offsetof(WindowBase, cells), 0, "CellRefs, or None for a window."},
    {"_path", T_OBJECT, offsetof(WindowBase, path), 0, "Where the column came from."},
    {"_squeeze", T_BOOL, offsetof(WindowBase, squeeze), 0, "The sample drops the time dim."},
    {NULL}};

static PyTypeObject WindowBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "reverb_shm._hot.WindowBase",
    .tp_basicsize = sizeof(WindowBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Fields of a TrajectoryColumn that the C fast paths build and read.",
    .tp_traverse = (traverseproc)window_traverse,
    .tp_clear = (inquiry)window_clear,
    .tp_dealloc = (destructor)window_dealloc,
    .tp_members = window_members,
    .tp_getset = window_getset,
    .tp_new = PyType_GenericNew,
};

/* A TrajectoryColumn over positions [start, stop) of col (stored and alive: the caller checked). */
static PyObject *make_window(ColumnBase *col, Py_ssize_t start, Py_ssize_t stop, int squeeze,
                             PyObject *index) {
  WindowBase *w = (WindowBase *)window_type->tp_alloc(window_type, 0);
  if (w == NULL) return NULL;
  Py_INCREF(Py_None);
  w->cells = Py_None;
  Py_INCREF(Py_None);
  w->path = Py_None;
  Py_INCREF(col);
  w->wcol = (PyObject *)col;
  Py_INCREF(index);
  w->windex = index;
  w->wgen = col->gen;
  w->wstart = start;
  w->wstop = stop;
  w->squeeze = (char)(squeeze != 0);
  return (PyObject *)w;
}

static PyObject *hot_new_window(PyObject *module, PyObject *args) {
  PyObject *col, *index;
  Py_ssize_t start, stop;
  int squeeze;
  if (!PyArg_ParseTuple(args, "O!nnpO:new_window", &ColumnBaseType, &col, &start, &stop,
                        &squeeze, &index))
    return NULL;
  if (window_type == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "writer_setup() was not called");
    return NULL;
  }
  return make_window((ColumnBase *)col, start, stop, squeeze, index);
}

/* ------------------------------------------------------------------------------------------ */
/* HistoryBase                                                                                */

typedef struct {
  PyObject_HEAD
  PyObject *column;    /* _column */
} HistoryBase;

static int history_traverse(HistoryBase *self, visitproc visit, void *arg) {
  Py_VISIT(self->column);
  return 0;
}

static int history_clear(HistoryBase *self) {
  Py_CLEAR(self->column);
  return 0;
}

static void history_dealloc(HistoryBase *self) {
  PyObject_GC_UnTrack(self);
  history_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An exact int as a long long; 0 (no error set) when it is not one or does not fit. */
static int exact_int(PyObject *o, long long *out) {
  if (!PyLong_CheckExact(o)) return 0;
  int overflow;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return 0;
  }
  *out = v;
  return 1;
}

static int column_behind_open_step(ColumnBase *col);

/* history[c][-k:] (k <= n) and history[c][i] when the steps are in the open run and alive: the
 * window directly; everything else (and every error) goes to the Python _getitem, also a column
 * that a partial step has not set yet (its history counts that step: Python's). */
static PyObject *history_subscript(HistoryBase *self, PyObject *index) {
  PyObject *c = self->column;
  if (c != NULL && window_type != NULL && is_column(c) &&
      !column_behind_open_step((ColumnBase *)c)) {
    ColumnBase *col = (ColumnBase *)c;
    long long v;
    if (PySlice_Check(index)) {
      PySliceObject *s = (PySliceObject *)index;
      if (s->stop == Py_None && s->step == Py_None && exact_int(s->start, &v) && v < 0 &&
          v >= -(long long)col->n) {
        Py_ssize_t first = col->n + (Py_ssize_t)v;
        if (window_in_open_run(col, first)) return make_window(col, first, col->n, 0, index);
      }
    } else if (exact_int(index, &v)) {
      long long p = v < 0 ? v + col->n : v;
      if (0 <= p && p < col->n && window_in_open_run(col, (Py_ssize_t)p))
        return make_window(col, (Py_ssize_t)p, (Py_ssize_t)p + 1, 1, index);
    }
  }
  return PyObject_CallMethodOneArg((PyObject *)self, s_getitem, index);
}

static PyMappingMethods history_mapping = {.mp_subscript = (binaryfunc)history_subscript};

static PyMemberDef history_members[] = {
    {"_column", T_OBJECT, offsetof(HistoryBase, column), 0, "The column (a ColumnBase)."},
    {NULL}};

static PyTypeObject HistoryBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "reverb_shm._hot.HistoryBase",
    .tp_basicsize = sizeof(HistoryBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A column history whose indexing takes the C fast path for the last steps.",
    .tp_traverse = (traverseproc)history_traverse,
    .tp_clear = (inquiry)history_clear,
    .tp_dealloc = (destructor)history_dealloc,
    .tp_members = history_members,
    .tp_as_mapping = &history_mapping,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------------------------------ */
/* WriterBase (fields; the methods follow FastAppend)                                          */

typedef struct {
  PyObject_HEAD
  PyObject *fast;        /* _fast: FastAppend or None */
  PyObject *tables;      /* _tables: name -> table handle */
  PyObject *batch;       /* _batch: list of (kind, priority, starts) */
  PyObject *pending;     /* _pending: deque of items behind the rate limiter */
  PyObject *item_keys;   /* _item_keys: sorted keys of the last flat-dict trajectory, or None */
  PyObject *last_kind;   /* _last_kind: the last item kind _kind() returned, or None */
  PyObject *table_kinds; /* _table_kinds: table name -> tuple of its last kinds, newest first */
  PyObject *structure;   /* _structure: union skeleton of the steps (history), or None */
  Py_ssize_t hist_step;  /* _hist_step */
  Py_ssize_t episode_steps;    /* _episode_steps */
  Py_ssize_t item_batch_size;  /* _item_batch_size */
  char closed;           /* _closed */
  char step_open;        /* _step_open: a partial append opened the current step */
  /* Exclusion with the background delivery thread (reverb_shm/_internal/delivery.py): `busy`
   * counts the writer's calls in progress (its owner's thread); the delivery thread claims an
   * idle writer (bg = 1, bg_pid = its process) and the owner's next call waits for it. */
  char bg;
  int busy;
  pid_t bg_pid;
} WriterBase;

/* Waits (GIL released) while the delivery thread holds the writer; a claim made before a fork
 * belongs to a thread that does not exist in the child: dropped. */
static void writer_wait_bg(WriterBase *w) {
  while (w->bg) {
    if (w->bg_pid != getpid()) {
      w->bg = 0;
      break;
    }
    Py_BEGIN_ALLOW_THREADS
    usleep(50);
    Py_END_ALLOW_THREADS
  }
}

static PyTypeObject WriterBaseType;

/* A partial step is open and has not set `col` yet: the column's history counts that step
 * (as Reverb's), one position past col->n. */
static int column_behind_open_step(ColumnBase *col) {
  PyObject *w = col->writer;
  if (w == NULL || !PyObject_TypeCheck(w, &WriterBaseType)) return 1;   /* let Python decide */
  WriterBase *wb = (WriterBase *)w;
  return wb->step_open && col->n <= wb->hist_step;
}

static int writer_traverse(WriterBase *self, visitproc visit, void *arg) {
  Py_VISIT(self->fast);
  Py_VISIT(self->tables);
  Py_VISIT(self->batch);
  Py_VISIT(self->pending);
  Py_VISIT(self->item_keys);
  Py_VISIT(self->last_kind);
  Py_VISIT(self->table_kinds);
  Py_VISIT(self->structure);
  return 0;
}

static int writer_clear(WriterBase *self) {
  Py_CLEAR(self->fast);
  Py_CLEAR(self->tables);
  Py_CLEAR(self->batch);
  Py_CLEAR(self->pending);
  Py_CLEAR(self->item_keys);
  Py_CLEAR(self->last_kind);
  Py_CLEAR(self->table_kinds);
  Py_CLEAR(self->structure);
  return 0;
}

static void writer_dealloc(WriterBase *self) {
  PyObject_GC_UnTrack(self);
  writer_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}


/* ------------------------------------------------------------------------------------------ */
/* FastAppend                                                                                 */

typedef struct {
  PyObject *col;           /* ColumnBase */
  PyObject *view;          /* writable rows of the column's open chunk from the next row on */
  PyArray_Descr *dtype;    /* the column's dtype */
  PyTypeObject *scalar;    /* dtype.type for element shape (), else NULL */
  Py_ssize_t scalar_off;   /* offset of such a scalar's value in the scalar object */
  char *rows;              /* view's data */
  npy_intp stride;         /* bytes between rows */
  npy_intp row_bytes;
  int ndim;
  npy_intp dims[NPY_MAXDIMS];
} fa_col;

typedef struct {
  PyObject_HEAD
  PyObject *cols_arg;      /* the (column, view, dtype) tuples it was made from */
  PyObject *treedef;       /* structure of the steps it applies to */
  PyObject *keys;          /* sorted str keys when steps are flat dicts, else NULL */
  PyObject *segment;       /* the writer's shm.Segment */
  PyObject *generation;    /* its registration generation when made */
  Py_ssize_t base;         /* writer._hist_step when made: row 0 of every view */
  Py_ssize_t limit;        /* first step it must not write (chunk full, a run to release) */
  unsigned long epoch;     /* hot_fork_epoch when made */
  Py_ssize_t ncols;
  fa_col *cols;
} FastAppend;

static int fast_traverse(FastAppend *self, visitproc visit, void *arg) {
  Py_VISIT(self->cols_arg);
  Py_VISIT(self->treedef);
  Py_VISIT(self->keys);
  Py_VISIT(self->segment);
  Py_VISIT(self->generation);
  for (Py_ssize_t i = 0; i < self->ncols; i++) {
    Py_VISIT(self->cols[i].col);
    Py_VISIT(self->cols[i].view);
  }
  return 0;
}

static int fast_clear(FastAppend *self) {
  Py_CLEAR(self->cols_arg);
  Py_CLEAR(self->treedef);
  Py_CLEAR(self->keys);
  Py_CLEAR(self->segment);
  Py_CLEAR(self->generation);
  for (Py_ssize_t i = 0; i < self->ncols; i++) {
    Py_CLEAR(self->cols[i].col);
    Py_CLEAR(self->cols[i].view);
    Py_CLEAR(self->cols[i].dtype);
  }
  return 0;
}

static void fast_dealloc(FastAppend *self) {
  PyObject_GC_UnTrack(self);
  fast_clear(self);
  PyMem_Free(self->cols);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject FastAppendType;

/* Offset of the value in a numpy scalar of dtype d's own type (its `obval`, elsize bytes), or
 * -1 for types whose scalars the fast append does not read directly. */
static Py_ssize_t scalar_value_offset(PyArray_Descr *d) {
  switch (d->type_num) {
    case NPY_BOOL: return offsetof(PyBoolScalarObject, obval);
    case NPY_BYTE: return offsetof(PyByteScalarObject, obval);
    case NPY_UBYTE: return offsetof(PyUByteScalarObject, obval);
    case NPY_SHORT: return offsetof(PyShortScalarObject, obval);
    case NPY_USHORT: return offsetof(PyUShortScalarObject, obval);
    case NPY_INT: return offsetof(PyIntScalarObject, obval);
    case NPY_UINT: return offsetof(PyUIntScalarObject, obval);
    case NPY_LONG: return offsetof(PyLongScalarObject, obval);
    case NPY_ULONG: return offsetof(PyULongScalarObject, obval);
    case NPY_LONGLONG: return offsetof(PyLongLongScalarObject, obval);
    case NPY_ULONGLONG: return offsetof(PyULongLongScalarObject, obval);
    case NPY_HALF: return offsetof(PyHalfScalarObject, obval);
    case NPY_FLOAT: return offsetof(PyFloatScalarObject, obval);
    case NPY_DOUBLE: return offsetof(PyDoubleScalarObject, obval);
    case NPY_CFLOAT: return offsetof(PyCFloatScalarObject, obval);
    case NPY_CDOUBLE: return offsetof(PyCDoubleScalarObject, obval);
    default: return -1;
  }
}

/* FastAppend(treedef, keys, cols, base, limit, segment, generation): cols is a tuple of
 * (column, view, dtype) with view a C-contiguous writable array of the column's rows. */
static PyObject *fast_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  PyObject *treedef, *keys, *cols, *segment, *generation;
  Py_ssize_t base, limit;
  static char *kwlist[] = {"treedef", "keys", "cols", "base", "limit", "segment", "generation",
                           NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!nnOO:FastAppend", kwlist, &treedef, &keys,
                                   &PyTuple_Type, &cols, &base, &limit, &segment, &generation))
    return NULL;
  Py_ssize_t ncols = PyTuple_GET_SIZE(cols);
  if (keys != Py_None && (!PyTuple_Check(keys) || PyTuple_GET_SIZE(keys) != ncols)) {
    PyErr_SetString(PyExc_TypeError, "FastAppend: keys must be None or a tuple, one per column");
    return NULL;
  }
  if (ncols < 1 || ncols > MAX_LEAVES) {
    PyErr_Format(PyExc_ValueError, "FastAppend: 1 to %d columns, got %zd", MAX_LEAVES, ncols);
    return NULL;
  }
  FastAppend *self = (FastAppend *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  self->cols = PyMem_Calloc((size_t)ncols, sizeof(fa_col));
  if (self->cols == NULL) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < ncols; i++) {
    PyObject *col, *view, *dtype;
    PyObject *item = PyTuple_GET_ITEM(cols, i);
    if (!PyTuple_Check(item) ||
        !PyArg_ParseTuple(item, "O!O!O!;FastAppend: cols must be (column, view, dtype) tuples",
                          &ColumnBaseType, &col, &PyArray_Type, &view, &PyArrayDescr_Type,
                          &dtype)) {
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "FastAppend: cols must be (column, view, dtype) tuples");
      Py_DECREF(self);
      return NULL;
    }
    PyArrayObject *arr = (PyArrayObject *)view;
    if (PyArray_NDIM(arr) < 1 || !PyArray_IS_C_CONTIGUOUS(arr) || !PyArray_ISWRITEABLE(arr) ||
        !PyArray_EquivTypes(PyArray_DESCR(arr), (PyArray_Descr *)dtype)) {
      PyErr_SetString(PyExc_ValueError,
                      "FastAppend: a view must be a writable C-contiguous array of the dtype");
      Py_DECREF(self);
      return NULL;
    }
    fa_col *fc = &self->cols[i];
    Py_INCREF(col);
    fc->col = col;
    Py_INCREF(view);
    fc->view = view;
    Py_INCREF(dtype);
    fc->dtype = (PyArray_Descr *)dtype;
    self->ncols = i + 1;
    fc->ndim = PyArray_NDIM(arr) - 1;
    fc->row_bytes = PyArray_ITEMSIZE(arr);
    for (int d = 0; d < fc->ndim; d++) {
      fc->dims[d] = PyArray_DIM(arr, d + 1);
      fc->row_bytes *= fc->dims[d];
    }
    fc->rows = PyArray_BYTES(arr);
    fc->stride = PyArray_STRIDE(arr, 0);
    /* A scalar is copied as its native value: only into native byte order columns. */
    fc->scalar_off = scalar_value_offset(fc->dtype);
    fc->scalar = (fc->ndim == 0 && fc->scalar_off > 0 && PyArray_ISNBO(fc->dtype->byteorder))
                     ? fc->dtype->typeobj
                     : NULL;
    if (PyArray_DIM(arr, 0) < limit - base) {
      PyErr_SetString(PyExc_ValueError, "FastAppend: a view has fewer rows than limit - base");
      Py_DECREF(self);
      return NULL;
    }
  }
  Py_INCREF(cols);
  self->cols_arg = cols;
  Py_INCREF(treedef);
  self->treedef = treedef;
  if (keys != Py_None) {
    Py_INCREF(keys);
    self->keys = keys;
  }
  Py_INCREF(segment);
  self->segment = segment;
  Py_INCREF(generation);
  self->generation = generation;
  self->base = base;
  self->limit = limit;
  self->epoch = hot_fork_epoch;
  return (PyObject *)self;
}

#define FAST_AT_LIMIT 2

/* Writes leaves[i] as the next row of column i and closes the step: 1; 0 when the step does
 * not qualify (nothing the Python path reads changed: rows past the columns' ends are unused);
 * FAST_AT_LIMIT (nothing changed) when the step is the FastAppend's limit (see _renew_fast);
 * -1 with an exception set (only on interpreter errors such as MemoryError). */
static int fast_write(FastAppend *fa, WriterBase *w, PyObject *const *leaves) {
  Py_ssize_t step = w->hist_step;
  if (step < fa->base || step > fa->limit || fa->epoch != hot_fork_epoch) return 0;
  PyObject *gen = PyObject_GetAttr(fa->segment, s_generation);
  if (gen == NULL) {
    PyErr_Clear();
    return 0;
  }
  int same = gen == fa->generation ? 1 : PyObject_RichCompareBool(gen, fa->generation, Py_EQ);
  Py_DECREF(gen);
  if (same != 1) {
    PyErr_Clear();
    return 0;
  }
  if (step == fa->limit) return FAST_AT_LIMIT;
  Py_ssize_t k = step - fa->base;
  for (Py_ssize_t i = 0; i < fa->ncols; i++) {
    fa_col *fc = &fa->cols[i];
    PyObject *leaf = leaves[i];
    char *dst = fc->rows + k * fc->stride;
    if (PyArray_CheckExact(leaf)) {
      PyArrayObject *arr = (PyArrayObject *)leaf;
      if (PyArray_NDIM(arr) != fc->ndim || !PyArray_IS_C_CONTIGUOUS(arr)) return 0;
      for (int d = 0; d < fc->ndim; d++)
        if (PyArray_DIM(arr, d) != fc->dims[d]) return 0;
      PyArray_Descr *dt = PyArray_DESCR(arr);
      if (dt != fc->dtype && !PyArray_EquivTypes(dt, fc->dtype)) return 0;
      memcpy(dst, PyArray_BYTES(arr), (size_t)fc->row_bytes);
    } else if (fc->scalar != NULL && Py_TYPE(leaf) == fc->scalar) {
      memcpy(dst, (char *)leaf + fc->scalar_off, (size_t)fc->row_bytes);
    } else {
      return 0;
    }
  }
  step += 1;
  for (Py_ssize_t i = 0; i < fa->ncols; i++) ((ColumnBase *)fa->cols[i].col)->n = step;
  w->hist_step = step;
  w->episode_steps += 1;
  return 1;
}

static PyObject *fast_write_method(FastAppend *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyObject_TypeCheck(args[0], &WriterBaseType) ||
      !PySequence_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "write(writer, leaves) takes a TrajectoryWriter and a list");
    return NULL;
  }
  PyObject *seq = PySequence_Fast(args[1], "write(): leaves must be a sequence");
  if (seq == NULL) return NULL;
  int r = 0;
  if (PySequence_Fast_GET_SIZE(seq) == self->ncols)
    r = fast_write(self, (WriterBase *)args[0], PySequence_Fast_ITEMS(seq));
  Py_DECREF(seq);
  if (r < 0) return NULL;
  return PyBool_FromLong(r == 1);
}

static PyMethodDef fast_methods[] = {
    {"write", (PyCFunction)(void (*)(void))fast_write_method, METH_FASTCALL,
     "write(writer, leaves) -> bool: appends the flattened step `leaves` (one per column, in "
     "column order) as a complete step when it qualifies; False changes nothing."},
    {NULL}};

static PyMemberDef fast_members[] = {
    {"treedef", T_OBJECT, offsetof(FastAppend, treedef), READONLY,
     "Structure of the steps it applies to."},
    {"keys", T_OBJECT, offsetof(FastAppend, keys), READONLY,
     "Sorted keys of its flat-dict steps, or None."},
    {"cols", T_OBJECT, offsetof(FastAppend, cols_arg), READONLY,
     "The (column, view, dtype) tuples it was made from."},
    {"limit", T_PYSSIZET, offsetof(FastAppend, limit), READONLY,
     "First history step it does not write."},
    {NULL}};

static PyTypeObject FastAppendType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "reverb_shm._hot.FastAppend",
    .tp_basicsize = sizeof(FastAppend),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "FastAppend(treedef, keys, cols, base, limit, segment, generation): row targets "
              "of TrajectoryWriter's fast append (a step shaped like the previous one while "
              "every column's chunk has room).",
    .tp_traverse = (traverseproc)fast_traverse,
    .tp_clear = (inquiry)fast_clear,
    .tp_dealloc = (destructor)fast_dealloc,
    .tp_new = fast_new,
    .tp_methods = fast_methods,
    .tp_members = fast_members,
};

/* ------------------------------------------------------------------------------------------ */
/* WriterBase methods                                                                         */

/* Calls self.<name>(*args, **kwnames) (the Python general path) with the same arguments. */
static PyObject *call_general(PyObject *self, PyObject *name, PyObject *const *args,
                              Py_ssize_t nargs, PyObject *kwnames) {
  Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
  PyObject *small[8];
  PyObject **stack = total + 1 <= 8 ? small : PyMem_Malloc((size_t)(total + 1) * sizeof(*stack));
  if (stack == NULL) return PyErr_NoMemory();
  stack[0] = self;
  for (Py_ssize_t i = 0; i < total; i++) stack[i + 1] = args[i];
  PyObject *r = PyObject_VectorcallMethod(name, stack, (size_t)(nargs + 1), kwnames);
  if (stack != small) PyMem_Free(stack);
  return r;
}

/* Strong references to d[keys[i]]; 0 when d is not such a dict (no error set). */
static int dict_leaves(PyObject *d, PyObject *keys, PyObject **out) {
  Py_ssize_t n = PyTuple_GET_SIZE(keys);
  if (!PyDict_CheckExact(d) || PyDict_GET_SIZE(d) != n || n > MAX_LEAVES) return 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *v = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(keys, i));
    if (v == NULL) {
      PyErr_Clear();
      for (Py_ssize_t j = 0; j < i; j++) Py_DECREF(out[j]);
      return 0;
    }
    Py_INCREF(v);
    out[i] = v;
  }
  return 1;
}

static void release_leaves(PyObject **leaves, Py_ssize_t n) {
  for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(leaves[i]);
}

static PyObject *writer_append_impl(WriterBase *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames);
static PyObject *writer_create_item_impl(WriterBase *self, PyObject *const *args,
                                         Py_ssize_t nargs, PyObject *kwnames);

static PyObject *writer_append(WriterBase *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
  if (self->bg) writer_wait_bg(self);
  self->busy++;
  PyObject *r = writer_append_impl(self, args, nargs, kwnames);
  self->busy--;
  return r;
}

static PyObject *writer_create_item(WriterBase *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames) {
  if (self->bg) writer_wait_bg(self);
  self->busy++;
  PyObject *r = writer_create_item_impl(self, args, nargs, kwnames);
  self->busy--;
  return r;
}

static PyObject *writer_append_impl(WriterBase *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames) {
  PyObject *fast = self->fast;
  if (nargs == 1 && kwnames == NULL && fast != NULL && Py_TYPE(fast) == &FastAppendType) {
    FastAppend *fa = (FastAppend *)fast;
    PyObject *leaves[MAX_LEAVES];
    if (fa->keys != NULL && dict_leaves(args[0], fa->keys, leaves)) {
      Py_ssize_t n = fa->ncols;
      Py_INCREF(fast);    /* the writer's _fast may change while it is in use */
      int r = fast_write(fa, self, leaves);
      if (r == FAST_AT_LIMIT) {    /* runs to release or a full chunk: renew, then retry */
        PyObject *next = PyObject_CallMethodNoArgs((PyObject *)self, s_renew_fast);
        r = next == NULL ? -1 : 0;
        if (next != NULL && Py_TYPE(next) == &FastAppendType &&
            ((FastAppend *)next)->ncols == n && ((FastAppend *)next)->keys != NULL)
          r = fast_write((FastAppend *)next, self, leaves) == 1;
        Py_XDECREF(next);
      }
      release_leaves(leaves, n);
      Py_DECREF(fast);
      if (r < 0) return NULL;
      if (r > 0) Py_RETURN_NONE;
    }
  }
  return call_general((PyObject *)self, s_append, args, nargs, kwnames);
}

/* 1 when `kind` (an item kind: (handle, sig, ...)) is of table `handle` and its sig matches the n
 * leaves: each a live window of the sig's column, of its length and squeeze; else 0. Runs no
 * Python code. */
static int kind_matches(WriterBase *self, PyObject *kind, PyObject *handle, PyObject **leaves,
                        Py_ssize_t n) {
  if (kind == NULL || !PyTuple_Check(kind) || PyTuple_GET_SIZE(kind) < 2 ||
      PyTuple_GET_ITEM(kind, 0) != handle)
    return 0;
  PyObject *sig = PyTuple_GET_ITEM(kind, 1);
  if (!PyTuple_Check(sig) || PyTuple_GET_SIZE(sig) != n || n == 0) return 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *leaf = leaves[i];
    if (Py_TYPE(leaf) != window_type) return 0;
    WindowBase *w = (WindowBase *)leaf;
    if (w->wcol == NULL || !is_column(w->wcol)) return 0;
    ColumnBase *col = (ColumnBase *)w->wcol;
    if (col->writer != (PyObject *)self || w->wgen != col->gen ||
        w->wstart < col->n - col->keep_alive || w->wstart < col->floor)
      return 0;    /* not alive: the general path says why */
    PyObject *entry = PyTuple_GET_ITEM(sig, i);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3 ||
        PyTuple_GET_ITEM(entry, 0) != w->wcol ||
        PyTuple_GET_ITEM(entry, 2) != (w->squeeze ? Py_True : Py_False))
      return 0;
    long long length;
    if (!exact_int(PyTuple_GET_ITEM(entry, 1), &length) || length != w->wstop - w->wstart)
      return 0;
  }
  return 1;
}

/* The window entry of create_item(table, priority, trajectory) appended to the batch: 1; 0 when
 * the item does not qualify (nothing changed); -1 with an exception set. Qualifies: an open
 * writer, a known table, a finite non-negative float priority within the table's bound, a flat
 * dict of the last flat-dict trajectory's keys whose every value is a live window of one of this
 * writer's columns, matching the last item kind or one of the last kinds of that table
 * (_table_kinds: items alternating between tables or kinds). */
static int create_item_fast(WriterBase *self, PyObject *table, PyObject *priority,
                            PyObject *trajectory) {
  if (self->closed || !PyUnicode_CheckExact(table) || self->tables == NULL ||
      !PyDict_CheckExact(self->tables) || !PyFloat_CheckExact(priority))
    return 0;
  double p = PyFloat_AS_DOUBLE(priority);
  if (!(p >= 0.0 && p < INFINITY)) return 0;   /* NaN too */
  PyObject *handle = PyDict_GetItemWithError(self->tables, table);   /* str keys: no Python */
  if (handle == NULL) {
    PyErr_Clear();
    return 0;
  }
  Py_INCREF(handle);   /* held from here on (the lookups below may run Python code) */
  PyObject *bound = PyObject_GetAttr(handle, s_priority_bound);
  if (bound == NULL) {
    int missing = PyErr_ExceptionMatches(PyExc_AttributeError);
    PyErr_Clear();   /* missing: no bound (the remote table checks); else Python raises it */
    if (!missing) {
      Py_DECREF(handle);
      return 0;
    }
  } else {
    int ok = PyFloat_CheckExact(bound) && p <= PyFloat_AS_DOUBLE(bound);
    Py_DECREF(bound);
    if (!ok) {
      Py_DECREF(handle);
      return 0;
    }
  }
  /* Read after the attribute lookup, which may have run Python code. */
  PyObject *keys = self->item_keys;
  if (keys == NULL || !PyTuple_Check(keys) || self->batch == NULL ||
      !PyList_CheckExact(self->batch)) {
    Py_DECREF(handle);
    return 0;
  }
  Py_INCREF(keys);   /* a key lookup may run Python code (a colliding key's __eq__) */
  PyObject *leaves[MAX_LEAVES];
  Py_ssize_t n = PyTuple_GET_SIZE(keys);
  int r = 0;
  int found = dict_leaves(trajectory, keys, leaves);
  Py_DECREF(keys);
  if (!found) {
    Py_DECREF(handle);
    return 0;
  }
  /* The kind: the last one, else one of this table's last ones (no Python code runs here). */
  PyObject *kind = NULL, *starts = NULL;
  if (kind_matches(self, self->last_kind, handle, leaves, n)) {
    kind = self->last_kind;
  } else if (self->table_kinds != NULL && PyDict_CheckExact(self->table_kinds)) {
    PyObject *recent = PyDict_GetItemWithError(self->table_kinds, table);   /* str keys */
    if (recent == NULL) PyErr_Clear();
    else if (PyTuple_Check(recent))
      for (Py_ssize_t k = 0; kind == NULL && k < PyTuple_GET_SIZE(recent); k++)
        if (kind_matches(self, PyTuple_GET_ITEM(recent, k), handle, leaves, n))
          kind = PyTuple_GET_ITEM(recent, k);
  }
  if (kind == NULL) goto done;
  Py_INCREF(kind);
  starts = PyTuple_New(n);
  if (starts == NULL) {
    r = -1;
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *s = PyLong_FromSsize_t(((WindowBase *)leaves[i])->wstart);
    if (s == NULL) {
      r = -1;
      goto done;
    }
    PyTuple_SET_ITEM(starts, i, s);
  }
  PyObject *item = PyTuple_Pack(3, kind, priority, starts);
  if (item == NULL || PyList_Append(self->batch, item) < 0) {
    Py_XDECREF(item);
    r = -1;
    goto done;
  }
  Py_DECREF(item);
  r = 1;
done:
  Py_XDECREF(starts);
  Py_XDECREF(kind);
  release_leaves(leaves, n);
  Py_DECREF(handle);
  return r;
}

static PyObject *writer_create_item_impl(WriterBase *self, PyObject *const *args,
                                         Py_ssize_t nargs, PyObject *kwnames) {
  if (nargs == 3 && kwnames == NULL && window_type != NULL) {
    int r = create_item_fast(self, args[0], args[1], args[2]);
    if (r < 0) return NULL;
    if (r > 0) {
      if (PyList_GET_SIZE(self->batch) == 1) {   /* a new batch: the delivery thread hears */
        PyObject *n = PyObject_CallMethodNoArgs((PyObject *)self, s_note_batch);
        if (n == NULL) return NULL;
        Py_DECREF(n);
      }
      int flush = self->batch != NULL && PyList_CheckExact(self->batch) &&
                  PyList_GET_SIZE(self->batch) >= self->item_batch_size;
      if (!flush && self->pending != NULL) {
        flush = PyObject_IsTrue(self->pending);
        if (flush < 0) return NULL;
      }
      if (flush) return PyObject_CallMethodNoArgs((PyObject *)self, s_flush_batch);
      Py_RETURN_NONE;
    }
  }
  return call_general((PyObject *)self, s_create_item, args, nargs, kwnames);
}

static PyMethodDef writer_methods[] = {
    {"append", (PyCFunction)(void (*)(void))writer_append, METH_FASTCALL | METH_KEYWORDS,
     "append(data, *, partial_step=False)\n--\n\n"
     "Appends one step (or part of one) to the episode.\n\n"
     "Args:\n"
     "  data: a nest (dict/list/tuple/namedtuple) of arrays or Python values. Leaves that are\n"
     "    None are omitted from the step. New fields may appear at any step.\n"
     "  partial_step: leave the step open so that later appends add fields to it.\n\n"
     "Raises:\n"
     "  ValueError: a value's dtype or shape differs from its column's (message names the\n"
     "    path), an unsupported dtype, or a field already set in the open step. Nothing is\n"
     "    written.\n"
     "  ResourceExhaustedError: the chunk arena is full. Nothing is written.\n"
     "  TableClosedError: the server stopped, or the writer was made before a fork.\n"
     "  RuntimeError: the writer is closed.\n"},
    {"create_item", (PyCFunction)(void (*)(void))writer_create_item,
     METH_FASTCALL | METH_KEYWORDS,
     "create_item(table, priority, trajectory)\n--\n\n"
     "Creates an item referencing the given steps.\n\n"
     "Items whose every column is a contiguous window of one column's steps\n"
     "(`history[c][a:b]`, `history[c][i]`) are batched: they are inserted with one C call at\n"
     "the next chunk boundary, every `item_batch_size` (256) items, or at `flush`,\n"
     "`end_episode`, `close` or `num_pending_items` (Reverb's items also reach the table when\n"
     "their chunks are finalised). Other items, and every item while earlier ones wait for the\n"
     "rate limiter, are inserted at once. An item the rate limiter does not admit right away\n"
     "waits in a FIFO queue (see `flush`); with more than 1024 items queued, this call blocks\n"
     "on the oldest.\n\n"
     "Args:\n"
     "  table: name of the table.\n"
     "  priority: finite float (non-negative on tables with a Prioritized selector).\n"
     "  trajectory: nest whose leaves are TrajectoryColumns (from `history`). The sample's\n"
     "    data has one column per leaf in nest-flatten order.\n\n"
     "Raises:\n"
     "  TypeError: a leaf is not a TrajectoryColumn.\n"
     "  ValueError: empty trajectory, bad priority, unknown table, expired refs, mixed\n"
     "    dtypes/shapes in a column, or (validate_items) a signature mismatch.\n"
     "  TableClosedError: the server stopped.\n"},
    {NULL}};

static PyMemberDef writer_members[] = {
    {"_fast", T_OBJECT, offsetof(WriterBase, fast), 0, "FastAppend of the last step, or None."},
    {"_tables", T_OBJECT, offsetof(WriterBase, tables), 0, "Table name -> handle."},
    {"_batch", T_OBJECT, offsetof(WriterBase, batch), 0,
     "(kind, priority, starts) of window items not yet inserted."},
    {"_pending", T_OBJECT, offsetof(WriterBase, pending), 0,
     "Items waiting for their rate limiter."},
    {"_item_keys", T_OBJECT, offsetof(WriterBase, item_keys), 0,
     "Sorted keys of the last flat-dict trajectory, or None."},
    {"_last_kind", T_OBJECT, offsetof(WriterBase, last_kind), 0,
     "The item kind _kind() returned last, or None."},
    {"_table_kinds", T_OBJECT, offsetof(WriterBase, table_kinds), 0,
     "Table name -> the item kinds _kind() returned last for that table (a tuple, newest "
     "first)."},
    {"_structure", T_OBJECT, offsetof(WriterBase, structure), 0,
     "Union structure of the appended steps (leaves: column histories), or None."},
    {"_hist_step", T_PYSSIZET, offsetof(WriterBase, hist_step), 0,
     "Closed steps since the last clear."},
    {"_episode_steps", T_PYSSIZET, offsetof(WriterBase, episode_steps), 0,
     "Non-partial appends since the last end_episode."},
    {"_item_batch_size", T_PYSSIZET, offsetof(WriterBase, item_batch_size), 0,
     "Window items batched before an insert."},
    {"_closed", T_BOOL, offsetof(WriterBase, closed), 0, "close() was called."},
    {"_step_open", T_BOOL, offsetof(WriterBase, step_open), 0,
     "A partial append opened the current step."},
    {NULL}};

static PyObject *s_no_history;

/* writer.history: _structure, or the Python _no_history() (which raises) before any append. */
static PyObject *writer_get_history(WriterBase *self, void *closure) {
  if (self->structure != NULL && self->structure != Py_None) {
    Py_INCREF(self->structure);
    return self->structure;
  }
  return PyObject_CallMethodNoArgs((PyObject *)self, s_no_history);
}

static PyGetSetDef writer_getset[] = {
    {"history", (getter)writer_get_history, NULL,
     "Union structure of the appended steps; its leaves are column histories.\n\n"
     "Raises:\n"
     "  RuntimeError: nothing has been appended yet.\n",
     NULL},
    {NULL}};

static PyTypeObject WriterBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "reverb_shm._hot.WriterBase",
    .tp_basicsize = sizeof(WriterBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "TrajectoryWriter's per-step fast paths (append, create_item) and their fields.",
    .tp_traverse = (traverseproc)writer_traverse,
    .tp_clear = (inquiry)writer_clear,
    .tp_dealloc = (destructor)writer_dealloc,
    .tp_methods = writer_methods,
    .tp_members = writer_members,
    .tp_getset = writer_getset,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------------------------------ */
/* Module                                                                                     */

static PyObject *hot_writer_setup(PyObject *module, PyObject *arg) {
  if (!PyType_Check(arg) || !PyType_IsSubtype((PyTypeObject *)arg, &WindowBaseType) ||
      ((PyTypeObject *)arg)->tp_basicsize != WindowBaseType.tp_basicsize) {
    PyErr_SetString(PyExc_TypeError,
                    "writer_setup() takes TrajectoryColumn: a WindowBase subclass with no slots "
                    "or __dict__ of its own");
    return NULL;
  }
  Py_INCREF(arg);
  Py_XSETREF(window_type, (PyTypeObject *)arg);
  Py_RETURN_NONE;
}


/* batch_run(batch, i) -> (j, positions, priorities): the run of batch entries (kind, priority,
 * starts) from i on that share entry i's kind object; positions int64 (j - i, len(starts)),
 * priorities float64 (j - i,). */
static PyObject *hot_batch_run(PyObject *module, PyObject *args) {
  PyObject *batch;
  Py_ssize_t i;
  if (!PyArg_ParseTuple(args, "O!n:batch_run", &PyList_Type, &batch, &i)) return NULL;
  Py_ssize_t len = PyList_GET_SIZE(batch);
  if (i < 0 || i >= len) {
    PyErr_SetString(PyExc_IndexError, "batch_run: start outside the batch");
    return NULL;
  }
  PyObject *first = PyList_GET_ITEM(batch, i);
  if (!PyTuple_Check(first) || PyTuple_GET_SIZE(first) != 3 ||
      !PyTuple_Check(PyTuple_GET_ITEM(first, 2))) {
    PyErr_SetString(PyExc_TypeError, "batch_run: entries must be (kind, priority, starts)");
    return NULL;
  }
  PyObject *kind = PyTuple_GET_ITEM(first, 0);
  Py_ssize_t ncols = PyTuple_GET_SIZE(PyTuple_GET_ITEM(first, 2));
  Py_ssize_t j = i + 1;
  while (j < len) {
    PyObject *e = PyList_GET_ITEM(batch, j);
    if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 3 || PyTuple_GET_ITEM(e, 0) != kind) break;
    j++;
  }
  npy_intp dims[2] = {j - i, ncols};
  PyObject *pos = PyArray_SimpleNew(2, dims, NPY_INT64);
  PyObject *prio = PyArray_SimpleNew(1, dims, NPY_FLOAT64);
  if (pos == NULL || prio == NULL) goto fail;
  int64_t *p = (int64_t *)PyArray_DATA((PyArrayObject *)pos);
  double *q = (double *)PyArray_DATA((PyArrayObject *)prio);
  /* Entries are read again by index: converting a value may run Python code (__index__). */
  for (Py_ssize_t k = i; k < j; k++) {
    if (k >= PyList_GET_SIZE(batch)) goto changed;
    PyObject *e = PyList_GET_ITEM(batch, k);
    Py_INCREF(e);
    PyObject *starts = PyTuple_Check(e) && PyTuple_GET_SIZE(e) == 3 ? PyTuple_GET_ITEM(e, 2)
                                                                  : NULL;
    int bad = starts == NULL || !PyTuple_Check(starts) || PyTuple_GET_SIZE(starts) != ncols;
    double v = bad ? 0.0 : PyFloat_AsDouble(PyTuple_GET_ITEM(e, 1));
    bad = bad || (v == -1.0 && PyErr_Occurred());
    q[k - i] = v;
    for (Py_ssize_t c = 0; !bad && c < ncols; c++) {
      long long s = PyLong_AsLongLong(PyTuple_GET_ITEM(starts, c));
      bad = s == -1 && PyErr_Occurred();
      p[(k - i) * ncols + c] = s;
    }
    Py_DECREF(e);
    if (bad) {
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "batch_run: entries must be (kind, priority, starts)");
      goto fail;
    }
  }
  return Py_BuildValue("(nNN)", j, pos, prio);
changed:
  PyErr_SetString(PyExc_RuntimeError, "batch_run: the batch changed while it was read");
fail:
  Py_XDECREF(pos);
  Py_XDECREF(prio);
  return NULL;
}

static WriterBase *as_writer(PyObject *o) {
  if (!PyObject_TypeCheck(o, &WriterBaseType)) {
    PyErr_SetString(PyExc_TypeError, "expected a TrajectoryWriter");
    return NULL;
  }
  return (WriterBase *)o;
}

static PyObject *hot_writer_enter(PyObject *module, PyObject *o) {
  WriterBase *w = as_writer(o);
  if (w == NULL) return NULL;
  if (w->bg) writer_wait_bg(w);
  w->busy++;
  Py_RETURN_NONE;
}

static PyObject *hot_writer_exit(PyObject *module, PyObject *o) {
  WriterBase *w = as_writer(o);
  if (w == NULL) return NULL;
  if (w->busy > 0) w->busy--;
  Py_RETURN_NONE;
}

static PyObject *hot_writer_claim(PyObject *module, PyObject *o) {
  WriterBase *w = as_writer(o);
  if (w == NULL) return NULL;
  if (w->bg && w->bg_pid != getpid()) w->bg = 0;
  if (w->busy || w->bg) Py_RETURN_FALSE;
  w->bg = 1;
  w->bg_pid = getpid();
  Py_RETURN_TRUE;
}

static PyObject *hot_writer_unclaim(PyObject *module, PyObject *o) {
  WriterBase *w = as_writer(o);
  if (w == NULL) return NULL;
  w->bg = 0;
  Py_RETURN_NONE;
}

static PyMethodDef writer_module_methods[] = {
    {"writer_enter", hot_writer_enter, METH_O,
     "writer_enter(writer): a call of the writer's owner begins (waits while the delivery "
     "thread holds it)."},
    {"writer_exit", hot_writer_exit, METH_O, "writer_exit(writer): that call ended."},
    {"writer_claim", hot_writer_claim, METH_O,
     "writer_claim(writer) -> bool: the delivery thread takes the writer if no call of its "
     "owner is in progress (the GIL makes the check and the claim one step)."},
    {"writer_unclaim", hot_writer_unclaim, METH_O, "writer_unclaim(writer): gives it back."},
    {"writer_setup", hot_writer_setup, METH_O,
     "writer_setup(TrajectoryColumn): the window type the C paths create (once, at import)."},
    {"new_window", hot_new_window, METH_VARARGS,
     "new_window(column, start, stop, squeeze, index) -> TrajectoryColumn over positions "
     "[start, stop) of column (the caller checked that they are stored and alive)."},
    {"batch_run", hot_batch_run, METH_VARARGS,
     "batch_run(batch, i) -> (j, positions, priorities): entries i..j-1 of the writer's batch "
     "of (kind, priority, starts) share entry i's kind; positions int64 [j - i, ncols] (their "
     "starts), priorities float64 [j - i]."},
    {NULL}};

int hot_writer_init(PyObject *module) {
  struct { PyObject **slot; const char *text; } names[] = {
      {&s_getitem, "_getitem"}, {&s_append, "_append"}, {&s_create_item, "_create_item"},
      {&s_flush_batch, "_flush_batch"}, {&s_generation, "_generation"},
      {&s_priority_bound, "priority_bound"}, {&s_no_history, "_no_history"},
      {&s_renew_fast, "_renew_fast"}, {&s_note_batch, "_note_batch"}};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
    if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) ==
                                      NULL)
      return -1;
  }
  struct { PyTypeObject *type; const char *name; } types[] = {
      {&ColumnBaseType, "ColumnBase"}, {&WindowBaseType, "WindowBase"},
      {&HistoryBaseType, "HistoryBase"}, {&WriterBaseType, "WriterBase"},
      {&FastAppendType, "FastAppend"}};
  for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
    if (PyType_Ready(types[i].type) < 0) return -1;
    Py_INCREF(types[i].type);
    if (PyModule_AddObject(module, types[i].name, (PyObject *)types[i].type) < 0) {
      Py_DECREF(types[i].type);
      return -1;
    }
  }
  return PyModule_AddFunctions(module, writer_module_methods);
}
