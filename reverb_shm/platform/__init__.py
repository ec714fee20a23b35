"""Reverb's `reverb.platform` namespace (only what user code imports from it)."""
from reverb_shm.platform import checkpointers_lib

__all__ = ["checkpointers_lib"]
