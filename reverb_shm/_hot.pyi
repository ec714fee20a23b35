# Type stub of the compiled fast-path module reverb_shm._hot (csrc/hot/): its classes and
# functions are typed as Any for the type checker.
from typing import Any

def __getattr__(name: str) -> Any: ...
