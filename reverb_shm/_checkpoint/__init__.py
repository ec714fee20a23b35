"""Private checkpoint I/O: the on-disk format of checkpoints (`io`).

The public API is `reverb_shm.checkpointers` (and `Client.checkpoint`).
"""
