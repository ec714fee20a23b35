"""`reverb.platform.checkpointers_lib`: the checkpointer classes of reverb_shm.checkpointers."""
from reverb_shm.checkpointers import CheckpointerBase, DefaultCheckpointer, TempDirCheckpointer

__all__ = ["CheckpointerBase", "DefaultCheckpointer", "TempDirCheckpointer"]
