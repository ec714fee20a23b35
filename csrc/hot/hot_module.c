/* reverb_shm._hot module object: binding of the core's entry points, and feature registration. */
#define HOT_MODULE_MAIN
#include "hot.h"

#include <pthread.h>

hot_core_fns hot_core;
int hot_core_bound = 0;
volatile unsigned long hot_fork_epoch = 0;

static void bump_fork_epoch(void) { hot_fork_epoch++; }

/* Names of hot_core_fns' members' core functions, in member order. */
static const char *const core_names[] = {"rs_insert_rows", "rs_open_chunks", "rs_insert_rows_at",
                                            "rs_sample_gather", "rs_mutate",
                                            "rs_check_priorities"};
#define NCORE (sizeof(core_names) / sizeof(core_names[0]))

static PyObject *hot_bind(PyObject *self, PyObject *addresses) {
  if (!PyTuple_Check(addresses) || PyTuple_GET_SIZE(addresses) != (Py_ssize_t)NCORE) {
    PyErr_Format(PyExc_TypeError, "bind() takes a tuple of %d addresses (CORE_FUNCTIONS order)",
                 (int)NCORE);
    return NULL;
  }
  void *fns[NCORE];
  for (Py_ssize_t i = 0; i < (Py_ssize_t)NCORE; i++) {
    fns[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(addresses, i));
    if (fns[i] == NULL) {
      if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "bind(): null address for %s", core_names[i]);
      return NULL;
    }
  }
  _Static_assert(sizeof(hot_core) == sizeof(fns), "hot_core_fns must hold only the bound entries");
  memcpy(&hot_core, fns, sizeof(fns));
  hot_core_bound = 1;
  Py_RETURN_NONE;
}

static PyMethodDef hot_methods[] = {
    {"bind", hot_bind, METH_O,
     "bind(addresses): the C core's entry points (ints, CORE_FUNCTIONS order); called once by "
     "reverb_shm._lib at import."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef hot_def = {PyModuleDef_HEAD_INIT, "reverb_shm._hot",
                                     "CPython-API fast paths over reverb_shm._core (private).",
                                     -1, hot_methods};

PyMODINIT_FUNC PyInit__hot(void) {
  import_array();
  PyObject *m = PyModule_Create(&hot_def);
  if (m == NULL) return NULL;
  PyObject *names = PyTuple_New(NCORE);
  if (names == NULL) goto fail;
  for (Py_ssize_t i = 0; i < (Py_ssize_t)NCORE; i++) {
    PyObject *s = PyUnicode_FromString(core_names[i]);
    if (s == NULL) { Py_DECREF(names); goto fail; }
    PyTuple_SET_ITEM(names, i, s);
  }
  if (PyModule_AddObject(m, "CORE_FUNCTIONS", names) < 0) { Py_DECREF(names); goto fail; }
  if (pthread_atfork(NULL, NULL, bump_fork_epoch) != 0) {
    PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
    goto fail;
  }
  if (hot_insert_init(m) < 0 || hot_writer_init(m) < 0 || hot_sample_init(m) < 0 ||
      hot_prefetch_init(m) < 0)
    goto fail;
  return m;
fail:
  Py_DECREF(m);
  return NULL;
}
