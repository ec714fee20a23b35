"""cffi out-of-line API-mode build of the C core into the private module ``reverb_shm._core``.

Run by ``pip install`` through setuptools' ``cffi_modules``; never at import time.
"""
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = ["util.c", "lock.c", "layout.c", "slots.c", "arena.c", "index.c", "sumtree.c",
           "selectors.c", "limiter.c", "table.c", "table_check.c", "check.c", "snapshot.c",
           "layout_cache.c",
           "fastpath.c", "writer_items.c", "bridge_layout.c", "extent.c", "liveness.c", "counters.c",
           "table_wait.c", "gather_thread.c", "fd_spin.c"]

ffibuilder = FFI()
ffibuilder.cdef((HERE / "rs_api.h").read_text())
ffibuilder.set_source(
    "reverb_shm._core",
    '#include "rs_internal.h"',
    sources=[f"csrc/{name}" for name in SOURCES],
    include_dirs=["csrc"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-fno-strict-aliasing", "-fvisibility=hidden", "-flto"],
    extra_link_args=["-flto", "-O2"],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
