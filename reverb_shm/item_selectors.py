"""Alias of :mod:`reverb_shm.selectors` (Reverb exposes both names)."""
from reverb_shm.selectors import *  # noqa: F401,F403
from reverb_shm.selectors import __all__  # noqa: F401
