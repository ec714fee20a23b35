/*
 * Sampling fast paths (SharedTable.sample_batch, Client.sample): the Python objects around one
 * rs_sample_gather call, built in C.
 *
 * sample_gather: the info buffer, the call (GIL released, RS_EAGAIN retried) and the SampleInfo
 *   of five arrays viewing that buffer. The status code goes back to Python, which maps it.
 * split_batch: the ReplaySample of each row of a gathered batch (Python scalars for the info,
 *   row views of the batch arrays for the data), or with timesteps the list of each row's
 *   ReplaySample per time step, as Client.sample yields them.
 */
#include "hot.h"

/* The buffer layout rs_sample_gather's `info` argument expects, for a batch of n items: key u64[n],
 * probability f64[n], table_size i64[n], priority f64[n], times_sampled i32[n]. */
static const int info_types[5] = {NPY_UINT64, NPY_FLOAT64, NPY_INT64, NPY_FLOAT64, NPY_INT32};

/* A new array over `data` (nd dims, strides NULL: C order) that keeps `owner` alive; steals a
 * reference to `descr`. */
static PyObject *view_of(PyObject *owner, PyArray_Descr *descr, int nd, npy_intp *dims,
                         npy_intp *strides, void *data, int flags) {
  PyObject *v = PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, strides, data, flags, NULL);
  if (v == NULL) return NULL;
  Py_INCREF(owner);
  if (PyArray_SetBaseObject((PyArrayObject *)v, owner) < 0) {
    Py_DECREF(v);
    return NULL;
  }
  return v;
}

/* A new tuple of type `cls` (a NamedTuple: a tuple subclass with no fields of its own) of the
 * `len` references in items (stolen, also on failure). */
static PyObject *new_named(PyTypeObject *cls, PyObject **items, Py_ssize_t len) {
  PyObject *t = cls->tp_alloc(cls, len);
  if (t == NULL) {
    for (Py_ssize_t i = 0; i < len; i++) Py_XDECREF(items[i]);
    return NULL;
  }
  for (Py_ssize_t i = 0; i < len; i++) PyTuple_SET_ITEM(t, i, items[i]);
  return t;
}

static int is_named_tuple_type(PyObject *cls, Py_ssize_t fields) {
  if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) return 0;
  PyObject *f = PyObject_GetAttrString(cls, "_fields");
  if (f == NULL) {
    PyErr_Clear();
    return 0;
  }
  int ok = PyTuple_Check(f) && PyTuple_GET_SIZE(f) == fields;
  Py_DECREF(f);
  return ok;
}

PyObject *hot_sample_info(PyObject *buf, char *info, npy_intp got, uint32_t n,
                          PyTypeObject *info_type) {
  PyObject *fields[5];
  for (int k = 0; k < 5; k++) {   /* field k starts at k * 8 * n bytes */
    npy_intp count = got;
    fields[k] = view_of(buf, PyArray_DescrFromType(info_types[k]), 1, &count, NULL,
                        info + (size_t)k * 8 * n, NPY_ARRAY_CARRAY);
    if (fields[k] == NULL) {
      for (int j = 0; j < k; j++) Py_DECREF(fields[j]);
      return NULL;
    }
  }
  return new_named(info_type, fields, 5);
}

static PyObject *sample_gather(PyObject *self, PyObject *args) {
  unsigned long long address, cols_address;
  unsigned int slot, table, n, wait_n, ncols;
  long long deadline_ns, slice_ns;
  PyObject *info_type;
  if (!PyArg_ParseTuple(args, "KIIIILLIKO:sample_gather", &address, &slot, &table, &n, &wait_n,
                        &deadline_ns, &slice_ns, &ncols, &cols_address, &info_type))
    return NULL;
  if (!hot_core_bound) {
    PyErr_SetString(PyExc_RuntimeError, "reverb_shm._hot is not bound to the core");
    return NULL;
  }
  if (n == 0 || n >= (1u << 31) || !is_named_tuple_type(info_type, 5)) {
    PyErr_SetString(PyExc_ValueError, "sample_gather: n must be in [1, 2**31) and info_type a "
                    "NamedTuple of 5 fields");
    return NULL;
  }
  npy_intp words = ((npy_intp)9 * n + 1) / 2;   /* 36 bytes per item, 8-byte aligned */
  PyObject *buf = PyArray_SimpleNew(1, &words, NPY_UINT64);
  if (buf == NULL) return NULL;
  char *info = PyArray_BYTES((PyArrayObject *)buf);
  uint32_t got = 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  do {
    rc = hot_core.sample_gather((void *)(uintptr_t)address, slot, table, n, wait_n, deadline_ns,
                                slice_ns, ncols, (const rs_gather_col *)(uintptr_t)cols_address,
                                info, &got);
  } while (rc == RS_EAGAIN);
  Py_END_ALLOW_THREADS
  PyObject *infos = hot_sample_info(buf, info, got, n, (PyTypeObject *)info_type);
  Py_DECREF(buf);
  if (infos == NULL) return NULL;
  return Py_BuildValue("(iN)", rc, infos);
}

/* The Python scalar of element i of a 1-d array of one of info_types. */
static PyObject *scalar_at(PyArrayObject *a, int type, npy_intp i) {
  const char *p = PyArray_BYTES(a) + i * PyArray_STRIDE(a, 0);
  switch (type) {
    case NPY_UINT64: return PyLong_FromUnsignedLongLong(*(const npy_uint64 *)p);
    case NPY_INT64: return PyLong_FromLongLong(*(const npy_int64 *)p);
    case NPY_INT32: return PyLong_FromLong(*(const npy_int32 *)p);
    default: return PyFloat_FromDouble(*(const double *)p);
  }
}

/* Row i of column c (a (b, ...) array): a view of shape c.shape[1:] owned by c. */
static PyObject *row_view(PyArrayObject *c, npy_intp i) {
  PyArray_Descr *d = PyArray_DESCR(c);
  Py_INCREF(d);
  return view_of((PyObject *)c, d, PyArray_NDIM(c) - 1, PyArray_DIMS(c) + 1,
                 PyArray_STRIDES(c) + 1, PyArray_BYTES(c) + i * PyArray_STRIDE(c, 0),
                 PyArray_FLAGS(c) & NPY_ARRAY_WRITEABLE);
}

/* Step t of row i of column c (a (b, T, ...) array): a view of shape c.shape[2:] owned by c. */
static PyObject *step_view(PyArrayObject *c, npy_intp i, npy_intp t) {
  PyArray_Descr *d = PyArray_DESCR(c);
  Py_INCREF(d);
  return view_of((PyObject *)c, d, PyArray_NDIM(c) - 2, PyArray_DIMS(c) + 2,
                 PyArray_STRIDES(c) + 2,
                 PyArray_BYTES(c) + i * PyArray_STRIDE(c, 0) + t * PyArray_STRIDE(c, 1),
                 PyArray_FLAGS(c) & NPY_ARRAY_WRITEABLE);
}

/* The SampleInfo of row i of the five info arrays (Python scalars); NULL with an error set. */
static PyObject *info_at(PyObject *info_type, PyObject *infos, npy_intp i) {
  PyObject *fields[5];
  for (int k = 0; k < 5; k++) {
    fields[k] = scalar_at((PyArrayObject *)PyTuple_GET_ITEM(infos, k), info_types[k], i);
    if (fields[k] == NULL) {
      for (int j = 0; j < k; j++) Py_DECREF(fields[j]);
      return NULL;
    }
  }
  return new_named((PyTypeObject *)info_type, fields, 5);
}

/* The data list of row i (step < 0) or of step `step` of row i: a view per column; passed
 * through unflatten(list) unless it is NULL. */
static PyObject *row_data(PyObject *columns, npy_intp i, npy_intp step, PyObject *unflatten) {
  Py_ssize_t ncols = PyList_GET_SIZE(columns);
  PyObject *data = PyList_New(ncols);
  if (data == NULL) return NULL;
  for (Py_ssize_t c = 0; c < ncols; c++) {
    PyArrayObject *col = (PyArrayObject *)PyList_GET_ITEM(columns, c);
    PyObject *v = step < 0 ? row_view(col, i) : step_view(col, i, step);
    if (v == NULL) {
      Py_DECREF(data);
      return NULL;
    }
    PyList_SET_ITEM(data, c, v);
  }
  if (unflatten == NULL) return data;
  PyObject *nest = PyObject_CallOneArg(unflatten, data);
  Py_DECREF(data);
  return nest;
}

static PyObject *split_batch(PyObject *self, PyObject *args) {
  PyObject *sample_type, *info_type, *infos, *columns, *unflatten = Py_None;
  int timesteps = 0;
  if (!PyArg_ParseTuple(args, "OOO!O!|pO:split_batch", &sample_type, &info_type, &PyTuple_Type,
                        &infos, &PyList_Type, &columns, &timesteps, &unflatten))
    return NULL;
  if (unflatten == Py_None) {
    unflatten = NULL;
  } else if (!PyCallable_Check(unflatten)) {
    PyErr_SetString(PyExc_TypeError, "split_batch: unflatten must be None or callable");
    return NULL;
  }
  if (!is_named_tuple_type(sample_type, 2) || !is_named_tuple_type(info_type, 5) ||
      PyTuple_GET_SIZE(infos) != 5) {
    PyErr_SetString(PyExc_TypeError, "split_batch(ReplaySample, SampleInfo, info of 5 arrays, "
                    "list of column arrays[, timesteps[, unflatten]])");
    return NULL;
  }
  npy_intp b = -1;
  for (int k = 0; k < 5; k++) {
    PyObject *a = PyTuple_GET_ITEM(infos, k);
    if (!PyArray_Check(a) || PyArray_NDIM((PyArrayObject *)a) != 1 ||
        PyArray_TYPE((PyArrayObject *)a) != info_types[k] ||
        (b >= 0 && PyArray_DIM((PyArrayObject *)a, 0) != b)) {
      PyErr_Format(PyExc_TypeError, "split_batch: info field %d must be a 1-d array of the "
                   "SampleInfo dtype, all of one length", k);
      return NULL;
    }
    b = PyArray_DIM((PyArrayObject *)a, 0);
  }
  Py_ssize_t ncols = PyList_GET_SIZE(columns);
  npy_intp steps = -1;   /* timesteps: the time dim every column shares */
  for (Py_ssize_t c = 0; c < ncols; c++) {
    PyObject *a = PyList_GET_ITEM(columns, c);
    if (!PyArray_Check(a) || PyArray_NDIM((PyArrayObject *)a) < 1 ||
        PyArray_DIM((PyArrayObject *)a, 0) != b) {
      PyErr_Format(PyExc_TypeError, "split_batch: column %zd must be an array of %zd rows", c,
                   (Py_ssize_t)b);
      return NULL;
    }
    if (timesteps) {   /* no time dim, or not one shared by all: the caller's path says why */
      PyArrayObject *col = (PyArrayObject *)a;
      if (PyArray_NDIM(col) < 2 || (steps >= 0 && PyArray_DIM(col, 1) != steps)) Py_RETURN_NONE;
      steps = PyArray_DIM(col, 1);
    }
  }
  if (timesteps && steps < 0) Py_RETURN_NONE;
  PyObject *out = PyList_New(b);
  if (out == NULL) return NULL;
  for (npy_intp i = 0; i < b; i++) {
    PyObject *info = info_at(info_type, infos, i);
    if (info == NULL) goto fail;
    PyObject *item;
    if (!timesteps) {   /* ReplaySample(info, [row view of each column]) */
      PyObject *pair[2] = {info, row_data(columns, i, -1, unflatten)};
      if (pair[1] == NULL) {
        Py_DECREF(info);
        goto fail;
      }
      item = new_named((PyTypeObject *)sample_type, pair, 2);
    } else {   /* [ReplaySample(info, [view of step t of each column]) for each step t] */
      item = PyList_New(steps);
      for (npy_intp t = 0; item != NULL && t < steps; t++) {
        PyObject *pair[2] = {Py_NewRef(info), row_data(columns, i, t, unflatten)};
        PyObject *sample = pair[1] == NULL ? NULL : new_named((PyTypeObject *)sample_type, pair, 2);
        if (pair[1] == NULL) Py_DECREF(info);
        if (sample == NULL) Py_CLEAR(item);
        else PyList_SET_ITEM(item, t, sample);
      }
      Py_DECREF(info);
    }
    if (item == NULL) goto fail;
    PyList_SET_ITEM(out, i, item);
  }
  return out;
fail:
  Py_DECREF(out);
  return NULL;
}

static PyMethodDef sample_methods[] = {
    {"sample_gather", sample_gather, METH_VARARGS,
     "sample_gather(address, slot, table, n, wait_n, deadline_ns, slice_ns, ncols, cols_address, "
     "SampleInfo) -> (status, SampleInfo of 5 arrays of the B items gathered): rs_sample_gather "
     "with the GIL released (RS_EAGAIN retried)."},
    {"split_batch", split_batch, METH_VARARGS,
     "split_batch(ReplaySample, SampleInfo, info, columns, timesteps=False, unflatten=None) -> "
     "list of ReplaySample(SampleInfo of Python scalars, [row view of each column]) for each row "
     "of a gathered batch; with timesteps, a list per row of the ReplaySample of each step t "
     "(views of [row, t] of each column), or None when the columns do not share a time dim; "
     "each data list passed through unflatten(list) when given."},
    {NULL, NULL, 0, NULL}};

int hot_sample_init(PyObject *module) { return PyModule_AddFunctions(module, sample_methods); }
