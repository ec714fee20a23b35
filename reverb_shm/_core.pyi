# Type stub of the compiled C core reverb_shm._core (cffi, csrc/build_core.py).
from typing import Any

ffi: Any
lib: Any
