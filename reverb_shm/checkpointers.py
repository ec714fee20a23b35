"""Checkpointers: where checkpoints go, which one a new Server restores, retention.

A checkpoint is a directory ``<root>/<RFC 3339 UTC timestamp with ns>`` written by
:mod:`reverb_shm._checkpoint.io` under a temporary name and renamed into place, so a directory with
a checkpoint name is complete unless storage damaged it; damage (a missing file, a flipped byte,
an unreadable manifest) is detected by checksums, reported with a warning naming the reason, and
the next older checkpoint is tried.

Checkpoints are written by the process that asks for them (``client.checkpoint()``,
``reverb-shm checkpoint NAME``): a Server publishes its checkpointer's settings next to its
segment so that any process of the host can find them. Thread-safe.
"""
import abc
import errno
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import msgpack

from reverb_shm import errors, specs
from reverb_shm import rate_limiters as rate_limiters_lib
from reverb_shm import selectors as selectors_lib
from reverb_shm import table as table_lib
from reverb_shm._checkpoint import io as checkpoint_io
from reverb_shm._internal import shm

__all__ = ["CheckpointerBase", "DefaultCheckpointer", "TempDirCheckpointer",
           "default_checkpointer", "ON_CONFIG_MISMATCH", "effective_tables", "for_server"]

log = logging.getLogger("reverb_shm.checkpoint")

ON_CONFIG_MISMATCH = ("error", "prefer_code", "prefer_checkpoint")
_NAME_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}\+00:00")
_TMP_RE = re.compile(r"\.reverb_shm-tmp-(\d+)-[0-9a-f]+")


def _timestamp(ns: int) -> str:
  return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}+00:00"


class CheckpointerBase(abc.ABC):
  """Base class of checkpointers (Reverb's API)."""

  @abc.abstractmethod
  def internal_checkpointer(self):
    """The object doing the work (Reverb compatibility); here the checkpointer itself."""

  @abc.abstractmethod
  def save(self, segment, progress: Optional[checkpoint_io.Progress] = None) -> str:
    """Writes a checkpoint of every table of `segment`; returns its absolute path."""

  @abc.abstractmethod
  def load_latest(self) -> Optional[checkpoint_io.Manifest]:
    """The verified checkpoint a new server restores, or None to start empty."""

  def spec(self) -> Optional[dict]:
    """JSON-able settings from which :func:`for_server` rebuilds the checkpointer in another
    process, or None when it cannot be rebuilt (then only the server's process checkpoints)."""
    return None


class DefaultCheckpointer(CheckpointerBase):
  """Checkpoints in sub-directories of `path`.

  Args:
    path: root directory (created when the first checkpoint is written).
    group: must be '' (Reverb compatibility); anything else makes checkpointing fail.
    fallback_checkpoint_path: a checkpoint directory (not a root) loaded when `path` holds no
      usable checkpoint.
    keep_latest: how many of the newest checkpoints to keep in `path` (>= 1); older ones are
      deleted after each successful save. Only directories named like our checkpoints are
      ever deleted.

  Raises:
    TypeError: path is not a str / os.PathLike.
    ValueError: keep_latest < 1.
  """

  def __init__(self, path, group: str = "", fallback_checkpoint_path=None,
               keep_latest: int = 1):
    if not isinstance(path, (str, os.PathLike)):
      raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if isinstance(keep_latest, bool) or not isinstance(keep_latest, int) or keep_latest < 1:
      raise ValueError(f"keep_latest must be an int >= 1, got {keep_latest!r}")
    self._path = os.path.abspath(os.fspath(path))
    self._group = group
    self._fallback = (None if fallback_checkpoint_path is None
                      else os.path.abspath(os.fspath(fallback_checkpoint_path)))
    self._keep_latest = keep_latest

  path = property(lambda self: self._path)
  group = property(lambda self: self._group)
  fallback_checkpoint_path = property(lambda self: self._fallback)
  keep_latest = property(lambda self: self._keep_latest)

  def internal_checkpointer(self):
    return self

  def spec(self) -> dict:
    return {"path": self._path, "group": self._group, "fallback_checkpoint_path": self._fallback,
            "keep_latest": self._keep_latest}

  def __repr__(self):
    return (f"{type(self).__name__}(path={self._path!r}, fallback_checkpoint_path="
            f"{self._fallback!r}, keep_latest={self._keep_latest})")

  # ---- saving
  def save(self, segment, progress: Optional[checkpoint_io.Progress] = None) -> str:
    """Writes a checkpoint of every table of `segment` and applies retention.

    Returns:
      Absolute path of the new checkpoint directory.

    Raises:
      ValueError: a non-empty group.
      ResourceExhaustedError: the arena or pin log cannot hold the snapshot's chunk holds.
      OSError: the files could not be written (nothing is left under a checkpoint name).
    """
    if self._group:
      raise ValueError("Setting non-empty group is not supported")
    os.makedirs(self._path, exist_ok=True)
    tmp = os.path.join(self._path, f".reverb_shm-tmp-{os.getpid()}-{uuid.uuid4().hex}")
    started = time.monotonic()
    try:
      body = checkpoint_io.write(segment, tmp,
                                 progress=progress or checkpoint_io.default_progress())
      final = self._rename_into_place(tmp, body["created_at_ns"])
    except BaseException as e:
      shutil.rmtree(tmp, ignore_errors=True)
      if isinstance(e, OSError) and e.errno is not None:
        hint = " (free space there, or keep fewer checkpoints: keep_latest)" \
            if e.errno == errno.ENOSPC else ""
        raise OSError(e.errno, f"writing a checkpoint of server "
                               f"{errors.quoted_name(segment.name)} under "
                               f"{self._path}: {e.strerror}{hint}; nothing was kept",
                      e.filename) from e
      raise
    log.info("checkpoint of server %r written to %s: %.1f MiB in %.2f s (tables locked %.1f ms)",
             segment.name, final, body["chunk_bytes"] / 2**20, time.monotonic() - started,
             body["pause_ns"] / 1e6)
    self._apply_retention()
    return final

  def _rename_into_place(self, tmp: str, ns: int) -> str:
    while True:
      final = os.path.join(self._path, _timestamp(ns))
      try:
        os.rename(tmp, final)   # fails on an existing (non-empty) checkpoint directory
      except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
          raise
        ns += 1   # another checkpoint took that name in the same nanosecond
        continue
      checkpoint_io.fsync_dir(self._path)
      return final

  def checkpoints(self) -> List[str]:
    """Paths of the checkpoint directories in `path`, newest first."""
    try:
      names = os.listdir(self._path)
    except FileNotFoundError:
      return []
    return [os.path.join(self._path, n) for n in sorted(names, reverse=True)
            if _NAME_RE.fullmatch(n) and os.path.isdir(os.path.join(self._path, n))]

  def _apply_retention(self) -> None:
    for old in self.checkpoints()[self._keep_latest:]:
      shutil.rmtree(old, ignore_errors=True)
    for name in os.listdir(self._path):   # temporary dirs of checkpointing processes now dead
      m = _TMP_RE.fullmatch(name)
      if m and not _pid_alive(int(m.group(1))):
        shutil.rmtree(os.path.join(self._path, name), ignore_errors=True)

  # ---- loading
  def load_latest(self) -> Optional[checkpoint_io.Manifest]:
    """The newest verified checkpoint in `path`, else the fallback, else None.

    Damaged or incomplete checkpoints are skipped with a warning (warnings and logging)
    naming the reason.
    """
    for path in self.checkpoints():
      manifest = _load_verified(path)
      if manifest is not None:
        return manifest
    if self._fallback is not None and os.path.isdir(self._fallback):
      return _load_verified(self._fallback)
    return None


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


def _load_verified(path: str) -> Optional[checkpoint_io.Manifest]:
  try:
    manifest = checkpoint_io.read_manifest(path)
    checkpoint_io.verify(manifest, checkpoint_io.default_progress("verifying checkpoint"))
    return manifest
  except checkpoint_io.CorruptCheckpointError as e:
    message = f"skipping checkpoint: {e}"
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return None


class TempDirCheckpointer(DefaultCheckpointer):
  """DefaultCheckpointer whose root is a new directory under the system temp dir.

  The directory is created by the first checkpoint, so servers that never checkpoint leave
  nothing behind.
  """

  def __init__(self, group: str = "", fallback_checkpoint_path=None, keep_latest: int = 1):
    path = os.path.join(tempfile.gettempdir(), f"reverb_shm-checkpoints-{uuid.uuid4().hex}")
    super().__init__(path, group, fallback_checkpoint_path, keep_latest)


def default_checkpointer(group: Optional[str] = None) -> CheckpointerBase:
  """The checkpointer of a Server created without one: a TempDirCheckpointer."""
  return TempDirCheckpointer(group or "")


# ---------------------------------------------------------------- finding a server's checkpointer
def _spec_path(server_name: str) -> str:
  return shm.sidecar_path(server_name, "checkpointer")


def publish(server_name: str, checkpointer: CheckpointerBase) -> None:
  """Records the settings of `server_name`'s checkpointer for other processes (mode 0600)."""
  spec = checkpointer.spec()
  if spec is None:
    return
  path = _spec_path(server_name)
  # Hidden temporary name outside the sidecar pattern, so gc never prunes a half-published file.
  tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp{os.getpid()}")
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  with os.fdopen(fd, "w") as f:
    json.dump(spec, f)
  os.replace(tmp, path)


def unpublish(server_name: str) -> None:
  try:
    os.unlink(_spec_path(server_name))
  except FileNotFoundError:
    pass


def for_server(server_name: str) -> CheckpointerBase:
  """The checkpointer of running server `server_name`, rebuilt from its published settings.

  Raises:
    ValueError: the server published none (its checkpointer cannot be used from another
      process).
  """
  try:
    with open(_spec_path(server_name)) as f:
      spec = json.load(f)
  except FileNotFoundError:
    raise ValueError(
        f"server {errors.quoted_name(server_name)} has no checkpointer usable from another "
        f"process") from None
  return DefaultCheckpointer(**spec)


# ---------------------------------------------------------------- configuration on restore
def _code_config(table: table_lib.Table) -> dict:
  rl = table.rate_limiter
  signature = specs.encode_signature(table.signature)
  return {"max_size": table.max_size, "max_times_sampled": table.max_times_sampled,
          "sampler": [table.sampler.kind, float(table.sampler.exponent)],
          "remover": [table.remover.kind, float(table.remover.exponent)],
          "rate_limiter": [float(rl.samples_per_insert), int(rl.min_size_to_sample),
                           float(rl.min_diff), float(rl.max_diff)],
          # as it reads back from a manifest (msgpack turns tuples into lists)
          "signature": msgpack.unpackb(msgpack.packb(signature, use_bin_type=True), raw=False)}


def _table_from_config(table: table_lib.Table, config: dict) -> table_lib.Table:
  spi, min_size, min_diff, max_diff = config["rate_limiter"]
  return table_lib.Table(
      name=table.name, sampler=selectors_lib.from_kind(*config["sampler"]),
      remover=selectors_lib.from_kind(*config["remover"]), max_size=config["max_size"],
      rate_limiter=rate_limiters_lib.RateLimiter(spi, min_size, min_diff, max_diff),
      max_times_sampled=config["max_times_sampled"], extensions=table.extensions,
      signature=specs.decode_signature(config["signature"]))


def effective_tables(tables: Sequence[table_lib.Table], manifest: checkpoint_io.Manifest,
                     on_config_mismatch: str = "error") -> Tuple[List[table_lib.Table],
                                                                 Dict[str, int]]:
  """The tables a restoring server creates, and which checkpoint table goes where.

  Args:
    tables: the server's tables as given in code.
    manifest: the checkpoint to restore.
    on_config_mismatch: 'error' raises when a table's configuration differs from the
      checkpoint's; 'prefer_code' keeps the code's (but not a code signature that differs from
      the one a non-empty checkpoint table's items were written under); 'prefer_checkpoint'
      takes the checkpoint's (extensions always come from code). Differences are logged in
      every case.

  Returns:
    (tables to create, checkpoint table name -> index in them).

  Raises:
    ValueError: unknown policy, a checkpoint table missing from `tables` (the message lists the
      available ones), (policy 'error') differing configurations, naming every differing
      field with both values, or (policy 'prefer_code') a code signature other than the one the
      checkpoint's items were written under.
  """
  if on_config_mismatch not in ON_CONFIG_MISMATCH:
    raise ValueError(f"on_config_mismatch must be one of {ON_CONFIG_MISMATCH}, got "
                     f"{on_config_mismatch!r}")
  by_name = {t.name: i for i, t in enumerate(tables)}
  missing = [t["name"] for t in manifest.tables if t["name"] not in by_name]
  if missing:
    raise ValueError(f"checkpoint {manifest.path} holds table(s) {missing} that the server does "
                     f"not have; available tables: {sorted(by_name)}")
  result = list(tables)
  problems = []
  for saved in manifest.tables:
    i = by_name[saved["name"]]
    code = _code_config(tables[i])
    diffs = [f"{k}: code {code[k]!r} vs checkpoint {saved['config'][k]!r}"
             for k in code if code[k] != saved["config"].get(k)]
    if not diffs:
      continue
    text = f"table {errors.quoted_name(saved['name'])}: " + "; ".join(diffs)
    problems.append(text)
    log.warning("configuration differs from checkpoint %s (%s): %s", manifest.path,
                on_config_mismatch, text)
    if on_config_mismatch == "prefer_checkpoint":
      result[i] = _table_from_config(tables[i], saved["config"])
    elif (on_config_mismatch == "prefer_code" and code["signature"] is not None
          and code["signature"] != saved["config"].get("signature") and saved.get("num_items")):
      raise ValueError(
          f"table {errors.quoted_name(saved['name'])}: checkpoint {manifest.path} holds "
          f"{saved['num_items']} items "
          f"written under signature {saved['config'].get('signature')!r}, which the code's "
          f"signature {code['signature']!r} does not describe; on_config_mismatch='prefer_code' "
          "keeps the code's signature and so cannot restore them (restore with "
          "'prefer_checkpoint', or give the table its checkpointed signature or none)")
  if problems and on_config_mismatch == "error":
    raise ValueError(f"the tables given differ from checkpoint {manifest.path} (pass "
                     "on_config_mismatch='prefer_code' or 'prefer_checkpoint' to choose): "
                     + " | ".join(problems))
  return result, {t["name"]: by_name[t["name"]] for t in manifest.tables}


def restore_into(segment, manifest: checkpoint_io.Manifest, table_indices: Dict[str, int]) -> None:
  """Restores `manifest` into a new segment, logging progress."""
  started = time.monotonic()
  checkpoint_io.restore(segment, manifest, table_indices,
                        checkpoint_io.default_progress("restoring checkpoint"))
  log.info("restored checkpoint %s into server %r: %.1f MiB in %.2f s", manifest.path,
           segment.name, manifest.body["chunk_bytes"] / 2**20, time.monotonic() - started)

