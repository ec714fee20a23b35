"""Checkpoint files: writing a consistent snapshot of a server, verifying, restoring.

A checkpoint is one directory, written under a temporary name, fsynced and renamed into place:

  MANIFEST       msgpack {"body": bytes, "sha256": hex of body}; body is a msgpack map with the
                 format name and version, creation time, server name, per-table configuration
                 (selectors, max_size, max_times_sampled, rate limiter, signature), counters and
                 item counts, and the size and sha256 of every other file. Written last.
  chunks.hdr     rs_chunk_hdr records (CHUNK_HDR), one per distinct chunk, in chunk-id order;
                 `nbytes` is the payload size saved in chunks.bin (numeric chunks are saved with
                 capacity == rows).
  chunks.bin     the chunks' payload bytes, concatenated in chunk-id order. A chunk referenced
                 by several tables is saved once.
  table-N.items  rs_item_rec records (chunks.ITEM_REC) of table N in insertion order; desc_off is
                 the byte offset of the item's descriptor in table-N.descs.
  table-N.descs  item descriptors (rs_desc_* layout) whose slices name chunk ids, not offsets.

Everything is little-endian raw bytes plus msgpack metadata; nothing is pickled. Thread-safe
(no shared state); several processes may checkpoint the same server at once.
"""
import dataclasses
import hashlib
import logging
import os
import time
from typing import Callable, Dict, List, Optional

import msgpack
import numpy as np

from reverb_shm import errors
from reverb_shm._internal import chunks
from reverb_shm._internal._lib import check, ffi, lib

__all__ = ["FORMAT", "VERSION", "MANIFEST", "CorruptCheckpointError", "Manifest", "write",
           "read_manifest", "verify", "restore", "table_config", "log_progress", "fsync_dir",
           "default_progress", "set_progress_factory"]

log = logging.getLogger("reverb_shm.checkpoint")

FORMAT = "reverb_shm.checkpoint"
VERSION = 1
MANIFEST = "MANIFEST"
CHUNK_HDR = np.dtype([("episode_id", "<u8"), ("start_step", "<u8"), ("row_bytes", "<u8"),
                      ("nbytes", "<u8"), ("data_offset", "<u8"), ("capacity", "<u4"),
                      ("rows", "<u4"), ("ndim", "<u4"), ("flags", "<u4"), ("shape", "<i8", (8,)),
                      ("dtype", "S16")])
_COUNTERS = ("size", "inserts", "samples", "deletes", "num_episodes", "num_deleted_episodes",
             "num_unique_samples")
_IO_BLOCK = 16 << 20       # bytes per write when streaming chunk data
_HOLD_BATCH = 4096         # chunks allocated (one pin each) before they are put under one hold
_HDR_BATCH = 8192          # chunk headers gathered per numpy fancy-index

if CHUNK_HDR.itemsize != ffi.sizeof("rs_chunk_hdr"):
  raise errors.CorruptError(f"CHUNK_HDR is {CHUNK_HDR.itemsize} bytes, rs_chunk_hdr is "
                            f"{ffi.sizeof('rs_chunk_hdr')}")

# progress(phase, done, total): phase is "snapshot", "chunks", "items", "verify" or "restore";
# done and total are bytes (or items for "items").
Progress = Callable[[str, int, int], None]


class CorruptCheckpointError(errors.ReverbError, ValueError):
  """A checkpoint directory is incomplete or damaged; the message names the reason."""


@dataclasses.dataclass
class Manifest:
  """A verified checkpoint's manifest body (see the module docstring)."""
  path: str
  body: dict

  @property
  def tables(self) -> List[dict]:
    return self.body["tables"]

  def table(self, name: str) -> Optional[dict]:
    return next((t for t in self.tables if t["name"] == name), None)


def log_progress(prefix: str = "checkpoint", every_s: float = 1.0) -> Progress:
  """A Progress callback logging one INFO line per phase at most every `every_s` seconds, once
  the operation has run for `every_s` (short saves and restores stay quiet)."""
  started = time.monotonic()
  last: dict = {}

  def report(phase: str, done: int, total: int) -> None:
    now = time.monotonic()
    if now - started < every_s or now - last.get(phase, -1e9) < every_s and done < total:
      return
    last[phase] = now
    unit, scale = ("items", 1) if phase == "items" else ("MiB", 1 << 20)
    pct = 100.0 * done / total if total else 100.0
    log.info("%s: %s %.1f/%.1f %s (%.0f%%)", prefix, phase, done / scale, total / scale, unit, pct)

  return report


_progress_factory: Optional[Callable[[str], Progress]] = None


def set_progress_factory(factory: Optional[Callable[[str], Progress]]) -> None:
  """Makes default_progress() build progress callbacks with factory(prefix) (None: log lines).

  A command line sets this to draw progress bars on a terminal; the library itself only logs.
  """
  global _progress_factory
  _progress_factory = factory


def default_progress(prefix: str = "checkpoint") -> Progress:
  """The progress callback of a save, verify or restore that was given none: the factory set
  by set_progress_factory, else log_progress(prefix)."""
  factory = _progress_factory
  return factory(prefix) if factory is not None else log_progress(prefix)


def _no_progress(phase: str, done: int, total: int) -> None:
  del phase, done, total


# ---------------------------------------------------------------- table configuration
def table_config(seg, index: int) -> dict:
  """The configuration of table `index` of a live segment, as stored in a manifest."""
  s = seg.stats(index)
  return {"max_size": int(s["max_size"]), "max_times_sampled": int(s["max_times_sampled"]),
          "sampler": [int(s["sampler_kind"]), float(s["sampler_exponent"])],
          "remover": [int(s["remover_kind"]), float(s["remover_exponent"])],
          "rate_limiter": [float(s["samples_per_insert"]), int(s["min_size_to_sample"]),
                           float(s["min_diff"]), float(s["max_diff"])],
          "signature": seg.table_config(index).get("signature")}


# ---------------------------------------------------------------- writing
class _HashedFile:
  """A file being written, with its sha256 and size; fsynced on close."""

  def __init__(self, directory: str, name: str, files: dict):
    self._name = name
    self._files = files
    self._f = open(os.path.join(directory, name), "wb", buffering=0)
    self._sha = hashlib.sha256()
    self._size = 0

  def write(self, data) -> None:
    view = memoryview(data).cast("B")
    self._sha.update(view)
    while view:
      n = self._f.write(view)
      view = view[n:]
      self._size += n

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *_):
    try:
      if exc_type is None:
        os.fsync(self._f.fileno())
    finally:
      self._f.close()
    if exc_type is None:
      self._files[self._name] = {"size": self._size, "sha256": self._sha.hexdigest()}


def fsync_dir(path: str) -> None:
  """fsync of a directory (makes renames and new entries in it durable)."""
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _chunk_headers(seg, offs: np.ndarray) -> np.ndarray:
  """rs_chunk_hdr records of the chunks at `offs` (gathered with numpy, in batches)."""
  raw = np.frombuffer(seg.buf, np.uint8)
  out = np.empty(len(offs), CHUNK_HDR)
  flat = out.view(np.uint8).reshape(len(offs), CHUNK_HDR.itemsize)
  cols = np.arange(CHUNK_HDR.itemsize, dtype=np.int64)
  for lo in range(0, len(offs), _HDR_BATCH):
    flat[lo:lo + _HDR_BATCH] = raw[offs[lo:lo + _HDR_BATCH].astype(np.int64)[:, None] + cols]
  return out


def _saved_headers(hdrs: np.ndarray) -> np.ndarray:
  """Headers as saved: numeric chunks keep their published rows only."""
  saved = hdrs.copy()
  numeric = saved["row_bytes"] > 0
  saved["capacity"][numeric] = saved["rows"][numeric]
  saved["nbytes"][numeric] = saved["rows"][numeric].astype(np.uint64) * saved["row_bytes"][numeric]
  saved["rows"][~numeric] = saved["capacity"][~numeric]
  return saved


def _stream_chunks(seg, offs: np.ndarray, saved: np.ndarray, out: _HashedFile,
                   progress: Progress) -> None:
  """Writes every chunk's payload straight from shared memory (no lock held)."""
  total = int(saved["nbytes"].sum())
  starts = (offs + saved["data_offset"]).tolist()
  sizes = saved["nbytes"].tolist()
  done = 0
  progress("chunks", 0, total)
  pending, pending_bytes = [], 0
  for start, size in zip(starts, sizes):
    pending.append(seg.buf[start:start + size])
    pending_bytes += size
    if pending_bytes >= _IO_BLOCK:
      out.write(b"".join(pending) if len(pending) > 1 else pending[0])
      done += pending_bytes
      pending, pending_bytes = [], 0
      progress("chunks", done, total)
  if pending:
    out.write(b"".join(pending) if len(pending) > 1 else pending[0])
    done += pending_bytes
  progress("chunks", done, total)


def _ffi_bytes(ptr, n: int):
  return ffi.buffer(ptr, n) if n else b""


def write(seg, directory: str, *, progress: Optional[Progress] = None) -> dict:
  """Writes a consistent checkpoint of every table of `seg` into the new `directory`.

  The snapshot holds every table lock only while it lists items and counters and holds the
  chunks (rs_snapshot_take); the chunk data is then streamed from shared memory while inserts
  and samples go on. `directory` must not exist; the caller renames it into place afterwards.

  Args:
    seg: an attached :class:`~reverb_shm._internal.shm.Segment`.
    directory: path of the directory to create.
    progress: optional Progress callback.

  Returns:
    The manifest body (dict); body["pause_ns"] is how long the table locks were held.

  Raises:
    ResourceExhaustedError: no room in the arena or pin log for the chunk holds.
    OSError: the files could not be written.
  """
  progress = progress or _no_progress
  slot, _ = seg.registration()
  snap_p = ffi.new("rs_snapshot **")
  progress("snapshot", 0, 1)
  check(lib.rs_snapshot_take(seg.base, slot, snap_p), f"snapshotting server "
                                                      f"{errors.quoted_name(seg.name)}")
  snap = snap_p[0]
  try:
    progress("snapshot", 1, 1)
    os.mkdir(directory, 0o700)
    files: Dict[str, dict] = {}
    n = int(snap.n_chunks)
    offs = np.frombuffer(_ffi_bytes(snap.chunk_offs, 8 * n), np.uint64)
    saved = _saved_headers(_chunk_headers(seg, offs))
    with _HashedFile(directory, "chunks.hdr", files) as f:
      f.write(saved.tobytes())
    with _HashedFile(directory, "chunks.bin", files) as f:
      _stream_chunks(seg, offs, saved, f, progress)
    tables = []
    for i, name in enumerate(seg.table_names()):
      st = snap.tables[i]
      items_name, descs_name = f"table-{i}.items", f"table-{i}.descs"
      with _HashedFile(directory, items_name, files) as f:
        f.write(_ffi_bytes(st.items, int(st.n_items) * chunks.ITEM_REC.itemsize))
      with _HashedFile(directory, descs_name, files) as f:
        f.write(_ffi_bytes(st.descs, int(st.descs_len)))
      tables.append({"name": name, "config": table_config(seg, i),
                     "counters": {k: int(getattr(st.counters, k)) for k in _COUNTERS},
                     "num_items": int(st.n_items), "items": items_name, "descs": descs_name})
    now = time.time_ns()
    body = {"format": FORMAT, "version": VERSION, "created_at_ns": now, "server": seg.name,
            "num_chunks": n, "chunk_bytes": int(saved["nbytes"].sum()), "tables": tables,
            "files": files, "pause_ns": int(snap.locked_ns)}
    packed = msgpack.packb(body, use_bin_type=True)
    with open(os.path.join(directory, MANIFEST), "wb") as f:
      f.write(msgpack.packb({"body": packed, "sha256": hashlib.sha256(packed).hexdigest()},
                            use_bin_type=True))
      f.flush()
      os.fsync(f.fileno())
    fsync_dir(directory)
    return body
  finally:
    check(lib.rs_snapshot_release(seg.base, slot, snap), "releasing the checkpoint snapshot")


# ---------------------------------------------------------------- reading and verifying
def read_manifest(path: str) -> Manifest:
  """Reads and checks the MANIFEST of checkpoint directory `path` (not the other files).

  Raises:
    CorruptCheckpointError: missing/unreadable manifest, checksum mismatch, unknown format or
      version (the message says which).
  """
  try:
    with open(os.path.join(path, MANIFEST), "rb") as f:
      outer = msgpack.unpackb(f.read(), raw=False)
    packed, digest = outer["body"], outer["sha256"]
  except FileNotFoundError:
    raise CorruptCheckpointError(f"{path}: no {MANIFEST} (incomplete checkpoint)") from None
  except (OSError, ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
    raise CorruptCheckpointError(f"{path}: unreadable {MANIFEST} ({e})") from None
  if not isinstance(packed, bytes) or hashlib.sha256(packed).hexdigest() != digest:
    raise CorruptCheckpointError(f"{path}: {MANIFEST} checksum mismatch")
  body = msgpack.unpackb(packed, raw=False, strict_map_key=False)
  if not isinstance(body, dict):
    raise CorruptCheckpointError(f"{path}: {MANIFEST} body is a {type(body).__name__}, expected "
                                 "a map")
  if body.get("format") != FORMAT:
    raise CorruptCheckpointError(f"{path}: not a reverb_shm checkpoint (format "
                                 f"{body.get('format')!r})")
  if body.get("version") != VERSION:
    raise CorruptCheckpointError(f"{path}: checkpoint format version {body.get('version')}, this "
                                 f"reverb_shm reads version {VERSION}")
  problem = _body_problem(body)
  if problem:
    raise CorruptCheckpointError(f"{path}: malformed {MANIFEST}: {problem}")
  return Manifest(path, body)


_BODY_FIELDS: Dict[str, type] = {"chunk_bytes": int, "num_chunks": int, "tables": list,
                                 "files": dict, "created_at_ns": int}
_TABLE_FIELDS: Dict[str, type] = {"name": str, "config": dict, "counters": dict,
                                  "num_items": int, "items": str, "descs": str}


def _body_problem(body: dict) -> Optional[str]:
  """What is missing or of the wrong type in a manifest body (None when it has what reading,
  verifying and restoring use)."""
  for key, kind in _BODY_FIELDS.items():
    if not isinstance(body.get(key), kind):
      return f"{key!r} is {body.get(key)!r:.60}, expected a {kind.__name__}"
  for name, meta in body["files"].items():
    if not (isinstance(name, str) and isinstance(meta, dict) and isinstance(meta.get("size"), int)
            and isinstance(meta.get("sha256"), str)):
      return f"file entry {name!r:.60}: {meta!r:.60}, expected {{'size': int, 'sha256': str}}"
    if os.path.basename(name) != name or name in ("", ".", ".."):
      return f"file entry {name!r:.60} is not a file name in the checkpoint directory"
  for name in ("chunks.hdr", "chunks.bin"):
    if name not in body["files"]:
      return f"{name} is not among the files listed"
  for i, table in enumerate(body["tables"]):
    if not isinstance(table, dict):
      return f"table {i} is {table!r:.60}, expected a map"
    for key, kind in _TABLE_FIELDS.items():
      if not isinstance(table.get(key), kind):
        return f"table {i}: {key!r} is {table.get(key)!r:.60}, expected a {kind.__name__}"
    for key in ("items", "descs"):
      if table[key] not in body["files"]:
        return f"table {i}: {key} file {table[key]!r:.60} is not among the files listed"
  return None


def verify(manifest: Manifest, progress: Optional[Progress] = None) -> None:
  """Checks the size and sha256 of every file the manifest lists.

  Raises:
    CorruptCheckpointError: a file is missing, has the wrong size or checksum.
  """
  progress = progress or _no_progress
  files = manifest.body["files"]
  total = sum(v["size"] for v in files.values())
  done = 0
  for name, meta in sorted(files.items()):
    path = os.path.join(manifest.path, name)
    try:
      size = os.stat(path).st_size
      if size != meta["size"]:
        raise CorruptCheckpointError(f"{manifest.path}: {name} is {size} bytes, the manifest "
                                     f"says {meta['size']}")
      with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    except FileNotFoundError:
      raise CorruptCheckpointError(f"{manifest.path}: {name} is missing") from None
    except OSError as e:
      raise CorruptCheckpointError(f"{manifest.path}: cannot read {name} ({e})") from None
    if digest != meta["sha256"]:
      raise CorruptCheckpointError(f"{manifest.path}: {name} checksum mismatch (damaged file)")
    done += size
    progress("verify", done, total)


# ---------------------------------------------------------------- restoring
def _restore_chunks(seg, manifest: Manifest, slot: int, generation: int,
                    progress: Progress):
  """Allocates and fills every chunk; returns (chunk offsets by id, hold pins)."""
  with open(os.path.join(manifest.path, "chunks.hdr"), "rb") as f:
    hdrs = np.frombuffer(f.read(), CHUNK_HDR)
  n = len(hdrs)
  total = int(hdrs["nbytes"].sum())
  chunk_map = np.zeros(n, np.uint64)
  hold_ids = []
  meta = ffi.new("rs_chunk_hdr *")
  meta_buf = ffi.buffer(meta)
  off_p, pin_p, hold_p = ffi.new("uint64_t *"), ffi.new("uint32_t *"), ffi.new("uint32_t *")
  done = 0
  try:
    with open(os.path.join(manifest.path, "chunks.bin"), "rb", buffering=0) as data:
      for lo in range(0, n, _HOLD_BATCH):
        batch = hdrs[lo:lo + _HOLD_BATCH]
        batch_pins = []   # writer pins, dropped once the batch is under a hold
        try:
          for j, h in enumerate(batch):
            meta_buf[:] = h.tobytes()
            meta.rows = 0
            if h["row_bytes"]:
              meta.nbytes = 0
            check(lib.rs_chunk_alloc(seg.base, slot, meta, off_p, pin_p), "restoring a chunk")
            batch_pins.append(pin_p[0])
            off = off_p[0]
            chunk_map[lo + j] = off
            start = off + ffi.cast("rs_chunk_hdr *", seg.address + off).data_offset
            size = int(h["nbytes"])
            view = seg.buf[start:start + size]
            while view:
              got = data.readinto(view)
              if not got:
                raise CorruptCheckpointError(f"{manifest.path}: chunks.bin ends early")
              view = view[got:]
            check(lib.rs_chunk_publish_rows(seg.base, off, int(h["rows"])), "restoring a chunk")
            done += size
          ids = np.ascontiguousarray(chunk_map[lo:lo + len(batch)])
          check(lib.rs_hold_chunks(seg.base, slot, len(batch), ffi.from_buffer("uint64_t[]", ids),
                                   hold_p), "holding restored chunks")
          hold_ids.append(hold_p[0])
        finally:
          chunks.Pins(seg, generation, np.array(batch_pins, np.uint32)).release()
        progress("restore", done, total)
  except BaseException:
    chunks.Pins(seg, generation, np.array(hold_ids, np.uint32)).release()
    raise
  return chunk_map, chunks.Pins(seg, generation, np.array(hold_ids, np.uint32))


def restore(seg, manifest: Manifest, table_indices: Dict[str, int],
            progress: Optional[Progress] = None) -> None:
  """Restores a verified checkpoint into the empty tables of a new segment.

  Args:
    seg: the new server's Segment (its tables empty).
    manifest: from read_manifest (and verify) of the checkpoint.
    table_indices: checkpoint table name -> table index in `seg` (tables to restore).
    progress: optional Progress callback.

  Raises:
    ValueError: an item does not fit the table's configuration (more items than max_size,
      times_sampled >= max_times_sampled, negative priority on a Prioritized table).
    ResourceExhaustedError: the arena cannot hold the checkpoint's data.
    CorruptCheckpointError: a file is shorter than the manifest says.
  """
  progress = progress or _no_progress
  slot, generation = seg.registration()
  chunk_map, holds = _restore_chunks(seg, manifest, slot, generation, progress)
  try:
    map_c = ffi.from_buffer("uint64_t[]", chunk_map) if len(chunk_map) else ffi.NULL
    for t in manifest.tables:
      index = table_indices.get(t["name"])
      if index is None:
        continue
      with open(os.path.join(manifest.path, t["items"]), "rb") as f:
        items = f.read()
      with open(os.path.join(manifest.path, t["descs"]), "rb") as f:
        descs = f.read()
      n = len(items) // chunks.ITEM_REC.itemsize
      if n != t["num_items"]:
        raise CorruptCheckpointError(f"{manifest.path}: {t['items']} holds {n} items, the "
                                     f"manifest says {t['num_items']}")
      progress("items", 0, n)
      items_c = ffi.cast("rs_item_rec *", ffi.from_buffer(items)) if n else ffi.NULL
      descs_c = ffi.from_buffer("uint8_t[]", descs) if descs else ffi.NULL
      check(lib.rs_restore_items(seg.base, index, n, items_c, descs_c, len(descs), map_c,
                                 len(chunk_map)),
            f"restoring table {errors.quoted_name(t['name'])} from {manifest.path}")
      counters = ffi.new("rs_table_counters *", [t["counters"][k] for k in _COUNTERS])
      check(lib.rs_restore_counters(seg.base, index, counters),
            f"restoring the counters of table {errors.quoted_name(t['name'])} from {manifest.path}")
      progress("items", n, n)
  finally:
    holds.release()
