/*
 * Client.mutate_priorities(table, updates={key: priority}) in one C call: the dict's keys and
 * priorities read into two arrays and one rs_mutate with the GIL released.
 *
 * Only plain entries are taken: keys that are Python ints in [0, 2**64) or numpy uint64
 * scalars, priorities that are finite Python floats or ints a double holds exactly (>= 0 on a
 * Prioritized table). For any other entry nothing is done and None is returned: the Python
 * path then converts or rejects the dict with its own messages.
 */
#include <math.h>

#include "hot.h"

#define HOT_MUTATE_STACK 512   /* entries read into arrays on the stack up to this many */

/* The key as a uint64 when it is a plain key (see above); 0 otherwise (no error set). */
static int plain_key(PyObject *obj, uint64_t *out) {
  if (PyLong_CheckExact(obj)) {
    /* (PyLong_AsUnsignedLong reads the digits directly; the long long variant goes through a
     * byte array, 3x slower) */
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

/* The priority as a double when it is a plain priority (see above); 0 otherwise. */
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
  if (!isfinite(v) || (v < 0 && prioritized)) return 0;
  *out = v;
  return 1;
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

static PyMethodDef mutate_methods[] = {
    {"mutate_dict", (PyCFunction)(void (*)(void))mutate_dict, METH_FASTCALL,
     "mutate_dict(address, table, updates, prioritized) -> (status, updated): rs_mutate of a "
     "dict {key: priority} of plain entries (int / numpy uint64 keys, finite float / int "
     "priorities, >= 0 when prioritized) with the GIL released; None, having done nothing, for "
     "any other entry or an empty dict."},
    {NULL, NULL, 0, NULL}};

int hot_mutate_init(PyObject *module) { return PyModule_AddFunctions(module, mutate_methods); }
