"""Build hook: cffi compiles csrc/ into reverb_shm._core at install time (out-of-line API mode)."""
from setuptools import setup

setup(cffi_modules=["csrc/build_core.py:ffibuilder"])
