/*
 * reverb_shm._hot: CPython-API fast paths for per-step Python calls (Client.insert of one step,
 * TrajectoryWriter.append / history / create_item).
 *
 * Why a second compiled module: cffi cannot take or build Python objects, so a per-step call
 * that goes through cffi pays for flattening a dict, checking each leaf and converting a dozen
 * arguments in Python (about 10 us). This module does only that object work in C and then calls
 * the C core through function pointers taken from reverb_shm._core (one copy of the core, one
 * thread-local error message). It holds no policy: every function either completes the common
 * case or returns a "not handled" / status-code result, and the Python layer takes its general
 * path, which validates and raises (reverb_shm/_internal/_lib.py stays the one place where core status
 * codes become exceptions).
 */
#ifndef RS_HOT_H
#define RS_HOT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

/* Python 3.9 (the oldest supported) lacks 3.10's reference helpers: the same, from 3.9's API.
 * setup.py makes an implicit declaration an error, so a newer API cannot slip in unnoticed. */
#if PY_VERSION_HEX < 0x030A0000
static inline PyObject *Py_NewRef(PyObject *o) {
  Py_INCREF(o);
  return o;
}
static inline int PyModule_AddObjectRef(PyObject *module, const char *name, PyObject *value) {
  Py_INCREF(value);
  if (PyModule_AddObject(module, name, value) < 0) {   /* steals the reference on success only */
    Py_DECREF(value);
    return -1;
  }
  return 0;
}
#endif

/* numpy's C API: one table per module, imported by hot_module.c (which defines HOT_MODULE_MAIN). */
#define PY_ARRAY_UNIQUE_SYMBOL rs_hot_ARRAY_API
#ifndef HOT_MODULE_MAIN
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>
#include <numpy/arrayscalars.h>

#include "../rs_api.h"

/* The fast paths' priority rule, as the core applies it: finite, and >= 0 on a table whose
 * sampler is prioritized. A fast path declines (the Python path raises the error) otherwise. */
static inline int hot_priority_ok(double v, int prioritized) {
  return isfinite(v) && !(prioritized && v < 0);
}

/* The C core's entry points, bound once at import by reverb_shm/_internal/_lib.py (hot_module.c lists
 * their names in CORE_FUNCTIONS, in this order). */
typedef struct {
  int (*insert_rows)(void *base, uint32_t slot, uint32_t table, uint32_t n, uint64_t *keys,
                     const double *priorities, uint32_t ncols, const rs_chunk_hdr *metas,
                     const uint8_t *const *data, const uint32_t *col_flags, uint64_t episode_id,
                     uint32_t flags, int64_t deadline_ns, int64_t slice_ns,
                     uint64_t *chunk_offs_out, uint32_t *pins_out, uint32_t *done_out);
  int (*open_chunks)(void *base, uint32_t slot, uint32_t ncols, const rs_chunk_hdr *metas,
                     uint32_t capacity, uint64_t episode_id, uint32_t flags, uint64_t *offs_out,
                     uint32_t *pins_out);
  int (*insert_rows_at)(void *base, uint32_t slot, uint32_t table, uint32_t n, uint64_t *keys,
                        const double *priorities, uint32_t ncols, const uint64_t *chunk_offs,
                        uint32_t first_row, const uint8_t *const *data, const uint32_t *col_flags,
                        uint32_t flags, int64_t deadline_ns, int64_t slice_ns, uint32_t *done_out);
  int (*sample_gather)(void *base, uint32_t slot, uint32_t table, uint32_t n, uint32_t wait_n,
                       int64_t deadline_ns, int64_t slice_ns, uint32_t ncols,
                       const rs_gather_col *cols, void *info, uint32_t *got_io);
  int (*mutate)(void *base, uint32_t table, uint32_t n_upd, const uint64_t *upd_keys,
                const double *upd_prios, uint32_t n_del, const uint64_t *del_keys,
                uint32_t *updated_out, uint32_t *deleted_out);
  int (*check_priorities)(void *base, uint32_t table, uint32_t n, const double *priorities);
} hot_core_fns;

extern hot_core_fns hot_core;
extern int hot_core_bound;

/* Bumped in the child of every fork (pthread_atfork, registered once by hot_module.c: any
 * fork(), not only those that run Python's hooks). An object caching process-local state (an
 * insert plan, a writer's fast append) records the epoch it was made in and is never used in a
 * child. */
extern volatile unsigned long hot_fork_epoch;

/* Each feature file adds its functions and types to the module; 0 on success, -1 with a Python
 * exception set. */
int hot_insert_init(PyObject *module);
int hot_writer_init(PyObject *module);
int hot_sample_init(PyObject *module);
int hot_prefetch_init(PyObject *module);

/* The SampleInfo (info_type, a NamedTuple of 5 fields) of `got` items whose info rs_sample_gather
 * wrote at `info` (inside array `buf`, which the five arrays keep alive) for a batch of n. */
PyObject *hot_sample_info(PyObject *buf, char *info, npy_intp got, uint32_t n,
                          PyTypeObject *info_type);

#endif
