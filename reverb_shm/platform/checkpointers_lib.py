"""`reverb.platform.checkpointers_lib`: the same checkpointer classes as reverb_shm.checkpointers."""
from reverb_shm.checkpointers import CheckpointerBase, DefaultCheckpointer, TempDirCheckpointer

__all__ = ["CheckpointerBase", "DefaultCheckpointer", "TempDirCheckpointer"]
