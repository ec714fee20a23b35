"""Build hook: cffi compiles csrc/ into reverb_shm._core (out-of-line API mode), and setuptools
compiles csrc/hot/ into reverb_shm._hot (CPython-API fast paths over the core), at install time;
never at import time. In a checkout: `python setup.py build_ext --inplace`."""
import glob
import os

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, ExecError, LinkError, PlatformError

HOT = Extension(
    "reverb_shm._hot",
    sources=sorted(glob.glob("csrc/hot/*.c")),
    include_dirs=[numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    depends=sorted(glob.glob("csrc/hot/*.h")) + ["csrc/rs_api.h"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-Wno-missing-field-initializers", "-fno-strict-aliasing",
                        "-Werror=implicit-function-declaration"],
)


class BuildExt(build_ext):
  """build_ext whose compiler failures say what a source build of reverb_shm needs."""

  def build_extension(self, ext):
    try:
      super().build_extension(ext)
    except (CompileError, LinkError, ExecError, PlatformError) as e:
      compiler = os.environ.get("CC") or "the default C compiler (cc)"
      raise PlatformError(
          f"reverb_shm: building its C extension {ext.name} failed ({e}). A source build needs "
          f"a C11 compiler (gcc or clang) with the Python headers and, on Linux, -flto support; "
          f"the compiler used was {compiler}. Install one (Debian/Ubuntu: apt-get install gcc "
          f"python3-dev; Fedora: dnf install gcc python3-devel), or set CC to a working one, "
          f"then install again.") from e



setup(cffi_modules=["csrc/build_core.py:ffibuilder"], ext_modules=[HOT],
      cmdclass={"build_ext": BuildExt})
