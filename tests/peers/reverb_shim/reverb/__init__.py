"""`import reverb` resolved to reverb_shm, for running client code written for DeepMind's Reverb
(TF-Agents, Acme, ...) unchanged in a peer venv: put tests/peers/reverb_shim on PYTHONPATH
(before any installed dm-reverb).

Importing this package replaces `sys.modules['reverb']` with the `reverb_shm` module itself, so
`reverb.Client is reverb_shm.Client`. A meta-path finder makes `import reverb.X` (and
`from reverb import X`) return the module of reverb_shm that plays Reverb's `reverb.X`: the same
module object, never a second copy, so classes and isinstance checks agree.
"""
import importlib
import importlib.abc
import importlib.util
import sys

import reverb_shm

# Reverb's submodule -> the reverb_shm module that plays it (others map to reverb_shm.<same>).
_RENAMED = {
    "reverb.tf_client": "reverb_shm.tf.tf_client",
    "reverb.trajectory_dataset": "reverb_shm.tf.trajectory_dataset",
    "reverb.timestep_dataset": "reverb_shm.tf.timestep_dataset",
    "reverb.reverb_types": "reverb_shm.table",
}


class _AliasLoader(importlib.abc.Loader):

  def __init__(self, target: str):
    self._target = target

  def create_module(self, spec):
    module = importlib.import_module(self._target)
    self._spec = module.__spec__   # the import system sets __spec__ to the alias's: restored
    return module

  def exec_module(self, module):
    module.__spec__ = self._spec


class _AliasFinder(importlib.abc.MetaPathFinder):
  """Finds `reverb.X` as the already (or newly) imported reverb_shm module playing it."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname.startswith("reverb_shm."):
      # `from reverb import tf_client` looks for reverb_shm.tf_client (the module's __name__).
      name = _RENAMED.get("reverb." + fullname[len("reverb_shm."):])
      if name is None:
        return None
    elif fullname.startswith("reverb."):
      name = _RENAMED.get(fullname, "reverb_shm" + fullname[len("reverb"):])
    else:
      return None
    try:
      if importlib.util.find_spec(name) is None:
        return None
    except ModuleNotFoundError:
      return None
    is_package = hasattr(importlib.import_module(name), "__path__")
    return importlib.util.spec_from_loader(fullname, _AliasLoader(name), is_package=is_package)


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
  sys.meta_path.insert(0, _AliasFinder())
sys.modules[__name__] = reverb_shm
