"""Build hook: cffi compiles csrc/ into reverb_shm._core (out-of-line API mode), and setuptools
compiles csrc/hot/ into reverb_shm._hot (CPython-API fast paths over the core), at install time;
never at import time. In a checkout: `python setup.py build_ext --inplace`."""
import glob

import numpy
from setuptools import Extension, setup

HOT = Extension(
    "reverb_shm._hot",
    sources=sorted(glob.glob("csrc/hot/*.c")),
    include_dirs=[numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    depends=sorted(glob.glob("csrc/hot/*.h")) + ["csrc/rs_api.h"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-Wno-missing-field-initializers", "-fno-strict-aliasing"],
)

setup(cffi_modules=["csrc/build_core.py:ffibuilder"], ext_modules=[HOT])
