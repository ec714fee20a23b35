"""Chunks (column data written once into the arena), item descriptors, pins and reads.

Layouts shared with the C core (csrc/rs_api.h):
  item descriptor blob = rs_desc_hdr, ncols x rs_desc_col, nslices x rs_desc_slice;
  numeric chunk payload = `capacity` rows of `row_bytes`, C-contiguous;
  object chunk payload (dtype "O", row_bytes 0; only Python reads it) =
    uint64 end[capacity] (end of row i, relative to the first row byte), then the rows, each
    the msgpack encoding of the row's flattened elements (bytes / str / numbers).
"""
import itertools
import math
import os
import struct
from typing import Any, List, Optional, Sequence, Tuple

import msgpack
import numpy as np

from reverb_shm import errors
from reverb_shm._internal._lib import check, ffi, lib

__all__ = ["Chunk", "ColumnWriter", "Pins", "alloc_chunk", "object_chunk", "encode_descriptor",
           "join_descriptors", "encode_row_descriptors", "read_item", "read_items", "row_buffers",
           "gather_column", "item_columns", "desc_blocks", "DESC_HDR", "DESC_COL", "DESC_SLICE",
           "SAMPLE_REC", "ITEM_REC"]

DESC_HDR = np.dtype([("ncols", "<u4"), ("nslices", "<u4")])
DESC_COL = np.dtype([("first_slice", "<u4"), ("nslices", "<u4"), ("flags", "<u4"),
                     ("_pad", "<u4")])
DESC_SLICE = np.dtype([("chunk_off", "<u8"), ("row_offset", "<u4"), ("nrows", "<u4")])
SAMPLE_REC = np.dtype([("key", "<u8"), ("probability", "<f8"), ("table_size", "<i8"),
                       ("priority", "<f8"), ("times_sampled", "<i4"), ("pin", "<u4"),
                       ("desc_off", "<u8")])
ITEM_REC = np.dtype([("key", "<u8"), ("priority", "<f8"), ("times_sampled", "<i8"),
                     ("insert_seq", "<u8"), ("update_seq", "<u8"), ("inserted_at_ns", "<i8"),
                     ("desc_off", "<u8")])
SQUEEZE = 1
_NUMERIC_KINDS = "biufc"
_OBJECT = np.dtype(object)


def _check_layouts():
  for dt, ctype in ((DESC_HDR, "rs_desc_hdr"), (DESC_COL, "rs_desc_col"),
                    (DESC_SLICE, "rs_desc_slice"), (SAMPLE_REC, "rs_sample_rec"),
                    (ITEM_REC, "rs_item_rec")):
    if dt.itemsize != ffi.sizeof(ctype):
      raise errors.CorruptError(f"numpy layout of {ctype} ({dt.itemsize} bytes) does not match "
                                f"the C core ({ffi.sizeof(ctype)} bytes)")


_check_layouts()
_DESC_DATA_OFFSET = int(lib.rs_desc_data_offset())
if _DESC_DATA_OFFSET % 8:  # read_items reads descriptors as aligned uint32 words
  raise errors.CorruptError(f"descriptor data offset {_DESC_DATA_OFFSET} is not 8-byte aligned")
# An item's desc_off is an item reference: the DESC block offset in the low bits, a row shift
# (added to every slice's row_offset) above them; items of one batch share their DESC block.
_REF_OFF_BITS = int(lib.rs_desc_ref_off_bits())
_REF_OFF_MASK = (1 << _REF_OFF_BITS) - 1


def _split_ref(ref: int) -> Tuple[int, int]:
  """(DESC block offset, row shift) of an item reference."""
  ref = int(ref)
  return ref & _REF_OFF_MASK, ref >> _REF_OFF_BITS


def desc_blocks(desc_offs) -> np.ndarray:
  """uint64[B] DESC block offsets of B item references (desc_off of items and samples); items
  of one inserted batch share one block."""
  return np.asarray(desc_offs, np.uint64) & np.uint64(_REF_OFF_MASK)


# ---------------------------------------------------------------- pins
class OwnedPins:
  """Pins (chunk holds or sampled-item pins) taken by this process under one registration,
  released only by :meth:`release`: by their owner's close(), or, if that never runs, when this
  process ends (a dead process's pins are reclaimed). For chunks whose owner's own finaliser
  still needs them: in a reference cycle the collector may finalise the pins before the owner.

  Releasing is a no-op once that registration is over (Segment.close() or Server.stop()
  dropped every pin of the slot; in a forked child the pins belong to the parent).
  Thread-safe.

  Args:
    seg: the Segment.
    generation: the registration generation the pins were taken under (see
      Segment.registration).
    pins: uint32 pin ids.
  """

  __slots__ = ("_seg", "_generation", "_pins", "__weakref__")

  def __init__(self, seg, generation: int, pins: np.ndarray):
    self._seg = seg
    self._generation = generation
    self._pins: Optional[np.ndarray] = np.ascontiguousarray(pins, dtype=np.uint32)

  def __len__(self):
    return 0 if self._pins is None else len(self._pins)

  @property
  def released(self) -> bool:
    return self._pins is None

  def release(self) -> None:
    """Drops the pins (idempotent; a no-op when their registration is over)."""
    pins, self._pins = self._pins, None
    if pins is not None and len(pins):
      self._seg.unpin(self._generation, pins)


class Pins(OwnedPins):
  """OwnedPins that are also released when garbage collected; arrays viewing pinned data keep
  this object alive through their `.base`."""

  __slots__ = ()

  def __del__(self):
    try:
      self.release()
    except Exception:  # pylint: disable=broad-except  (never raise from a finaliser)
      pass


class _PinnedMemory:
  """Exposes pinned shared memory to numpy; the array's `.base` keeps the pins alive."""

  __slots__ = ("__array_interface__", "_pins", "_seg")

  def __init__(self, seg, pins: Pins, address: int, shape: tuple, dtype: np.dtype):
    self._seg = seg  # keeps the mapping alive
    self._pins = pins
    self.__array_interface__ = {"data": (address, True), "shape": shape,
                                "typestr": dtype.str, "version": 3}


def _pinned_view(seg, pins: Pins, address: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
  return np.asarray(_PinnedMemory(seg, pins, address, shape, dtype))


# ---------------------------------------------------------------- chunk headers
_DTYPES: dict = {}  # rs_chunk_hdr.dtype code -> np.dtype
_CHUNK_HDR_SIZE = ffi.sizeof("rs_chunk_hdr")


def _damaged(seg, what: str) -> errors.CorruptError:
  return errors.CorruptError(f"segment {errors.quoted_name(seg.name)} is damaged: {what} "
                             f"(reverb-shm check "
                             f"{seg.name} lists what is wrong)")


class _ChunkMeta:
  __slots__ = ("off", "dtype", "shape", "row_bytes", "data_address", "capacity", "rows",
               "episode_id", "start_step")

  def __init__(self, seg, off: int):
    # Offsets come from descriptors in shared memory: checked against the segment before they
    # are dereferenced, so that a damaged segment raises instead of crashing the process.
    if off % 64 or not _CHUNK_HDR_SIZE <= off <= seg.size - _CHUNK_HDR_SIZE:
      raise _damaged(seg, f"chunk offset {off} is not a 64-aligned offset inside the "
                     f"{seg.size}-byte segment")
    h = ffi.cast("rs_chunk_hdr *", seg.address + off)
    payload = max(h.capacity * h.row_bytes, h.nbytes)
    if h.ndim > 8 or h.data_offset > seg.size - off or payload > seg.size - off - h.data_offset:
      raise _damaged(seg, f"the chunk at {off} has {h.ndim} dims and {payload} payload bytes at "
                     f"{h.data_offset}, beyond the {seg.size}-byte segment")
    code = ffi.string(h.dtype)
    dtype = _DTYPES.get(code)
    if dtype is None:
      try:
        dtype = _OBJECT if code == b"O" else np.dtype(code.decode("ascii"))
      except (TypeError, ValueError, UnicodeDecodeError):
        raise _damaged(seg, f"the chunk at {off} has dtype {code!r}") from None
      _DTYPES[code] = dtype
    self.off = off
    self.dtype = dtype
    self.shape = tuple(ffi.unpack(h.shape, h.ndim))
    self.row_bytes = h.row_bytes
    self.data_address = seg.address + off + h.data_offset
    self.capacity = h.capacity
    self.rows = h.rows
    self.episode_id = h.episode_id
    self.start_step = h.start_step


# ---------------------------------------------------------------- writer side
class Chunk:
  """A chunk this process is writing; holds a writer pin until :meth:`release`.

  Attributes:
    off: offset of the chunk in the segment.
    capacity: rows that fit.
    rows: rows published so far.
    dtype: numpy dtype of the column (object for msgpack rows).
    shape: element shape (without the time dim).
    episode_id, start_step: episode and step of row 0.
    data: writable view (capacity, *shape) into shared memory; None for object chunks.

  Args:
    seg, off, pin, generation: the segment, the chunk's offset, its writer pin and the
      registration generation the pin was taken under.
    owned: the pin is released only by :meth:`release` (OwnedPins), not when garbage collected.

  Not thread-safe (one writer per chunk).
  """

  def __init__(self, seg, off: int, pin: int, generation: int, owned: bool = False):
    meta = _ChunkMeta(seg, off)
    self._seg = seg
    self._generation = generation
    self._pid = os.getpid()
    self.off = off
    self.capacity = meta.capacity
    self.rows = meta.rows
    self.dtype = meta.dtype
    self.shape = meta.shape
    self.episode_id = meta.episode_id
    self.start_step = meta.start_step
    self._pins = (OwnedPins if owned else Pins)(seg, generation, np.array([pin], np.uint32))
    if self.dtype is _OBJECT:
      self.data = None
    else:
      count = self.capacity * math.prod(self.shape)
      start = meta.data_address - seg.address
      self.data = np.frombuffer(seg.buf, self.dtype, count, start).reshape(
          (self.capacity,) + self.shape)

  def append(self, value) -> None:
    """Writes `value` (element shape; cast to the chunk dtype) as the next row and publishes it.

    Raises:
      ValueError: wrong shape, chunk full or an object chunk (nothing is written).
      TableClosedError: the chunk's registration ended (see :meth:`publish`).
    """
    row = self.rows
    if self.data is None or row >= self.capacity or np.shape(value) != self.shape:
      self._check_rows(np.shape(value), 1)
    assert self.data is not None   # (_check_rows raised otherwise)
    self.data[row] = value
    self.publish(row + 1)

  def write_rows(self, values) -> None:
    """Writes len(values) rows after the published ones and publishes them.

    Raises:
      ValueError: wrong dtype/shape, not enough capacity or an object chunk (nothing is
        written).
      TableClosedError: the chunk's registration ended (see :meth:`publish`).
    """
    values = np.asarray(values)
    if values.dtype != self.dtype:
      raise ValueError(f"chunk dtype is {self.dtype}, got rows of dtype {values.dtype}")
    n = values.shape[0] if values.ndim else 0
    self._check_rows(values.shape[1:], n)
    assert self.data is not None   # (_check_rows raised otherwise)
    self.data[self.rows:self.rows + n] = values
    self.publish(self.rows + n)

  def _check_rows(self, shape: tuple, n: int) -> None:
    """Raises ValueError unless n rows of element shape `shape` can be written."""
    if self.data is None:
      raise ValueError("object chunks are written once by object_chunk(); a released chunk "
                       "cannot be written")
    if tuple(shape) != self.shape:
      raise ValueError(f"chunk rows have shape {self.shape}, got rows of shape {tuple(shape)}")
    if self.rows + n > self.capacity:
      raise ValueError(f"chunk holds {self.capacity} rows, {self.rows} used; cannot write {n}")

  def publish(self, rows: int) -> None:
    """Makes rows [0, rows) visible to items; write them into `data` first.

    The writer's fast path: `chunk.data[r] = value; chunk.publish(r + 1)`.

    Raises:
      ValueError: rows below the published count or above capacity.
      TableClosedError: the chunk's registration ended (Server.stop() or Segment.close() in
        this process, or a fork child): its pin is gone and the rows may have been freed.
    """
    if self._generation != self._seg.generation:
      if self._pid != os.getpid():
        raise errors.TableClosedError(
            f"this writer's chunk (server {errors.quoted_name(self._seg.name)}) belongs to "
            f"process {self._pid}, "
            f"which forked this process ({os.getpid()}): a writer cannot be shared across a "
            "fork; re-attach after fork: create a new Client / TrajectoryWriter in the child")
      raise self._seg.closed_error()
    check(lib.rs_chunk_publish_rows(self._seg.base, self.off, rows), "publishing chunk rows")
    self.rows = rows

  def shrink(self) -> None:
    """Returns the unused capacity to the arena (needs >= 1 published row).

    A no-op once the chunk's registration ended (see :meth:`publish`).
    """
    if 0 < self.rows < self.capacity and self._generation == self._seg.generation:
      check(lib.rs_chunk_shrink(self._seg.base, self.off, self.rows), "shrinking chunk")
      self.capacity = self.rows
      if self.data is not None:
        self.data = self.data[:self.rows]

  def release(self) -> None:
    """Drops the writer pin (idempotent); the chunk lives on while items reference it."""
    self.data = None
    self._pins.release()

  @property
  def released(self) -> bool:
    return self._pins.released

  def __repr__(self):
    return (f"Chunk(off={self.off}, dtype={self.dtype}, shape={self.shape}, rows={self.rows}/"
            f"{self.capacity}, episode_id={self.episode_id}, start_step={self.start_step})")


def _alloc(seg, dtype_code: bytes, shape: tuple, row_bytes: int, nbytes: int, capacity: int,
           episode_id: int, start_step: int):
  if len(shape) > 8:
    raise ValueError(f"element rank must be <= 8, got shape {shape}")
  if not 1 <= capacity < 2**32:
    raise ValueError(f"chunk capacity must be in [1, 2**32), got {capacity}")
  meta = ffi.new("rs_chunk_hdr *")
  meta.episode_id = episode_id
  meta.start_step = start_step
  meta.row_bytes = row_bytes
  meta.nbytes = nbytes
  meta.capacity = capacity
  meta.ndim = len(shape)
  for i, d in enumerate(shape):
    meta.shape[i] = d
  meta.dtype = dtype_code
  slot, generation = seg.registration()
  off, pin = ffi.new("uint64_t *"), ffi.new("uint32_t *")
  check(lib.rs_chunk_alloc(seg.base, slot, meta, off, pin),
        "allocating chunk" + seg.arena_hint)
  return off[0], pin[0], generation


def alloc_chunk(seg, dtype, shape: Sequence[int], capacity: int, episode_id: int = 0,
                start_step: int = 0, owned: bool = False) -> Chunk:
  """Allocates a numeric chunk of `capacity` rows of `shape` x `dtype` in the arena (`owned`:
  see Chunk).

  Raises:
    ValueError: unsupported dtype, rank > 8, bad capacity.
    ResourceExhaustedError: the arena has no room (message gives needed and free bytes).
  """
  dtype = np.dtype(dtype)
  if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None:
    raise ValueError(f"unsupported column dtype {dtype}; expected bool, int, uint, float or "
                     "complex (strings go through object_chunk)")
  shape = tuple(int(d) for d in shape)
  row_bytes = dtype.itemsize * math.prod(shape)
  off, pin, generation = _alloc(seg, dtype.str.encode(), shape, row_bytes, row_bytes * capacity,
                          capacity, episode_id, start_step)
  return Chunk(seg, off, pin, generation, owned)


class ColumnWriter:
  """Writes `rows` rows of each of a fixed set of numeric columns into fresh chunks.

  The hot path of Client.insert and SharedTable.insert: one C call (rs_write_chunks) allocates,
  fills and publishes every column's chunk, with the C chunk headers prepared once.

  Args:
    columns: (dtype, element shape) per column; numeric dtypes only (see alloc_chunk).

  Raises:
    ValueError: an unsupported dtype, a rank above 8 or more than 64 columns.
  """

  __slots__ = ("_metas", "ncols", "slices", "squeeze_flags")

  metas = property(lambda self: self._metas, doc="rs_chunk_hdr[ncols] of the columns.")

  def __init__(self, columns: Sequence[Tuple[np.dtype, tuple]]):
    if not 1 <= len(columns) <= 64:
      raise ValueError(f"ColumnWriter takes 1..64 columns, got {len(columns)}")
    self.ncols = len(columns)
    self._metas = ffi.new("rs_chunk_hdr[]", self.ncols)
    for c, (dtype, shape) in enumerate(columns):
      meta = self._metas + c
      dtype = np.dtype(dtype)
      if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None:
        raise ValueError(f"ColumnWriter takes numeric columns only, got dtype {dtype}")
      if len(shape) > 8:
        raise ValueError(f"element rank must be <= 8, got shape {shape}")
      meta.row_bytes = dtype.itemsize * math.prod(shape)
      meta.ndim = len(shape)
      for i, d in enumerate(shape):
        meta.shape[i] = d
      meta.dtype = dtype.str.encode()
    # One single-row item over every column's row 0 (Client.insert): chunk offsets set per write.
    self.slices = ffi.new("rs_desc_slice[]", [(0, 0, 1)] * self.ncols)
    self.squeeze_flags = {flag: ffi.new("uint32_t[]", [flag] * self.ncols) for flag in (0, SQUEEZE)}

  def write(self, seg, arrays: Sequence[Any], rows: int,
            episode_id: int = 0) -> Tuple[list, Pins]:
    """Allocates one chunk of `rows` rows per column, copies arrays[c] in and publishes it.

    Args:
      seg: the Segment.
      arrays: one C-contiguous array (or bytes-like buffer) per column holding exactly rows x
        row bytes, with the column's dtype (the caller has checked dtypes and shapes).
      rows: rows per chunk, >= 1.
      episode_id: episode id stored in every chunk header.

    Returns:
      (chunk offsets, Pins holding the chunks); release the pins once items reference them.

    Raises:
      ResourceExhaustedError: the arena is full (nothing stays allocated).
    """
    slot, generation = seg.registration()
    buffers = [ffi.from_buffer("uint8_t[]", a) for a in arrays]   # alive during the call
    offs = ffi.new("uint64_t[]", self.ncols)
    pins = np.empty(self.ncols, np.uint32)
    check(lib.rs_write_chunks(seg.base, slot, self.ncols, self._metas, buffers, rows, episode_id,
                              0, offs, ffi.from_buffer("uint32_t[]", pins)), "writing chunks")
    return list(offs), Pins(seg, generation, pins)

  def row_slices(self, chunk_offs: Sequence[int], n: int):
    """rs_desc_slice[n * ncols] where column c of item i is row i of chunk chunk_offs[c].

    The cffi array owns its memory (keep it while C reads it).
    """
    arr = np.empty((n, self.ncols), DESC_SLICE)
    arr["chunk_off"] = np.asarray(chunk_offs, np.uint64)
    arr["row_offset"] = np.arange(n, dtype=np.uint32)[:, None]
    arr["nrows"] = 1
    out = ffi.new("rs_desc_slice[]", n * self.ncols)
    ffi.memmove(out, arr, arr.nbytes)
    return out


def row_buffers(arrays: Sequence[np.ndarray]) -> list:
  """uint8_t[] cdata of each array's bytes (C-contiguous copies of the others), for the C
  calls that copy whole columns; each keeps its array alive."""
  try:
    return [ffi.from_buffer("uint8_t[]", a) for a in arrays]
  except ValueError:   # not C-contiguous (numpy's buffer refuses)
    return [ffi.from_buffer("uint8_t[]", np.ascontiguousarray(a)) for a in arrays]


def _pack_row(row) -> bytes:
  arr = np.asarray(row, dtype=object)
  return msgpack.packb([x.item() if isinstance(x, np.generic) else x
                        for x in arr.reshape(-1)], use_bin_type=True)


def pack_object_rows(rows) -> List[bytes]:
  """The msgpack bytes of each row of str/bytes/number elements, as object chunks store them.

  Raises:
    ValueError: an element msgpack cannot encode (a bridge client checks its rows with this
      before sending them, for the same error as a local insert).
  """
  try:
    return [_pack_row(row) for row in rows]
  except (TypeError, ValueError) as e:
    raise ValueError(f"object column rows must hold str/bytes/numbers: {e}") from None


def object_chunk(seg, values: list, episode_id: int = 0, start_step: int = 0,
                 owned: bool = False) -> Chunk:
  """Stores rows of str/bytes/object elements (all of one element shape) as msgpack (`owned`:
  see Chunk).

  Raises:
    ValueError: rows of different shapes or elements msgpack cannot encode.
    ResourceExhaustedError: the arena has no room.
  """
  if not len(values):
    raise ValueError("object_chunk needs at least one row")
  shape = np.shape(values[0])
  packed = pack_object_rows(values)
  for v in values:
    if np.shape(v) != shape:
      raise ValueError(f"object column rows differ in shape: {shape} vs {np.shape(v)}")
  n = len(packed)
  ends = np.cumsum([len(p) for p in packed], dtype=np.uint64)
  nbytes = 8 * n + int(ends[-1])
  off, pin, generation = _alloc(seg, b"O", tuple(shape), 0, nbytes, n, episode_id, start_step)
  chunk = Chunk(seg, off, pin, generation, owned)
  start = _ChunkMeta(seg, off).data_address - seg.address
  seg.buf[start:start + 8 * n] = ends.tobytes()
  seg.buf[start + 8 * n:start + nbytes] = b"".join(packed)
  chunk.publish(n)
  return chunk


def _read_object_rows(seg, meta: _ChunkMeta, row_offset: int, nrows: int) -> np.ndarray:
  start = meta.data_address - seg.address
  ends = np.frombuffer(seg.buf, np.uint64, meta.capacity, start)
  rows_base = start + 8 * meta.capacity
  out = np.empty((nrows,) + meta.shape, dtype=object)
  flat = out.reshape(nrows, -1)
  for i in range(nrows):
    r = row_offset + i
    lo = int(ends[r - 1]) if r > 0 else 0
    elems = msgpack.unpackb(seg.buf[rows_base + lo:rows_base + int(ends[r])], raw=False)
    flat[i, :] = elems
  return out


# ---------------------------------------------------------------- descriptors
_DESC_PACKERS: dict = {}


def encode_descriptor(columns) -> bytes:
  """Encodes one item descriptor for rs_insert (layout: module docstring).

  Args:
    columns: sequence of `(slices, squeeze)` per column, where slices is a non-empty list of
      (chunk_off, row_offset, nrows) in the order the rows are read.

  Returns:
    The descriptor bytes. Several items go to rs_insert as their concatenation with offsets
    (see :func:`join_descriptors`); the C core validates every descriptor before inserting.
  """
  ncols = len(columns)
  nslices = 0
  values = [ncols, 0]
  for slices, squeeze in columns:
    values += (nslices, len(slices), SQUEEZE if squeeze else 0, 0)
    nslices += len(slices)
  values[1] = nslices
  for slices, _ in columns:
    for sl in slices:
      values += sl
  packer = _DESC_PACKERS.get((ncols, nslices))
  if packer is None:  # one cached Struct per (ncols, nslices): this runs once per created item
    packer = _DESC_PACKERS[(ncols, nslices)] = struct.Struct(
        "<II" + "IIII" * ncols + "QII" * nslices)
  return packer.pack(*values)


def join_descriptors(blobs: Sequence[bytes]) -> Tuple[bytes, np.ndarray]:
  """(blob, offs) for rs_insert: item i is blob[offs[i]:offs[i+1]], offs uint64 of len n+1."""
  offs = np.fromiter(itertools.accumulate(map(len, blobs), initial=0), np.uint64,
                     len(blobs) + 1)
  return b"".join(blobs), offs


def encode_row_descriptors(chunk_offs: Sequence[int], n: int,
                           squeeze: bool = True) -> Tuple[bytes, np.ndarray]:
  """Descriptors of n items where item i is row i of every chunk (one slice per column).

  Vectorised: no per-item Python work.
  """
  ncols = len(chunk_offs)
  if n == 1:  # a single item: one cached Struct beats building a structured array
    blob = encode_descriptor([([(off, 0, 1)], squeeze) for off in chunk_offs])
    return blob, np.array([0, len(blob)], np.uint64)
  item_dt = np.dtype([("hdr", DESC_HDR), ("cols", DESC_COL, (ncols,)),
                      ("slices", DESC_SLICE, (ncols,))])
  arr = np.zeros(n, item_dt)
  arr["hdr"]["ncols"] = ncols
  arr["hdr"]["nslices"] = ncols
  arr["cols"]["first_slice"] = np.arange(ncols, dtype=np.uint32)
  arr["cols"]["nslices"] = 1
  arr["cols"]["flags"] = SQUEEZE if squeeze else 0
  arr["slices"]["chunk_off"] = np.asarray(chunk_offs, np.uint64)[None, :]
  arr["slices"]["row_offset"] = np.arange(n, dtype=np.uint32)[:, None]
  arr["slices"]["nrows"] = 1
  return arr.tobytes(), np.arange(n + 1, dtype=np.uint64) * item_dt.itemsize


def item_columns(seg, desc_off: int) -> List[Tuple[np.ndarray, bool]]:
  """Decodes a stored item's descriptor (desc_off: its item reference): per column (slices
  structured array with the item's own row offsets, squeeze)."""
  off, shift = _split_ref(desc_off)
  start = off + _DESC_DATA_OFFSET
  hdr = np.frombuffer(seg.buf, DESC_HDR, 1, start)[0]
  ncols, nslices = int(hdr["ncols"]), int(hdr["nslices"])
  cols = np.frombuffer(seg.buf, DESC_COL, ncols, start + DESC_HDR.itemsize)
  slices = np.frombuffer(seg.buf, DESC_SLICE, nslices,
                         start + DESC_HDR.itemsize + ncols * DESC_COL.itemsize)
  if shift:
    slices = slices.copy()
    slices["row_offset"] += np.uint32(shift)
  return [(slices[c["first_slice"]:c["first_slice"] + c["nslices"]],
           bool(c["flags"] & SQUEEZE)) for c in cols]


# ---------------------------------------------------------------- reading
_DESC_HDR_STRUCT = struct.Struct("<II")
# (ncols, nslices) -> Struct of the rs_desc_col and rs_desc_slice arrays
_DESC_BODY_STRUCTS: dict = {}


def _decode_descriptor(seg, desc_off: int) -> List[Tuple[List[tuple], bool]]:
  """Per column ([(chunk_off, row_offset, nrows), ...], squeeze), as Python ints, of the item
  whose item reference is desc_off."""
  off, shift = _split_ref(desc_off)
  columns = decode_descriptor(seg.buf, off + _DESC_DATA_OFFSET)
  if not shift:
    return columns
  return [([(c, r + shift, m) for c, r, m in slices], squeeze) for slices, squeeze in columns]


def decode_descriptor(buf, start: int = 0) -> List[Tuple[List[tuple], bool]]:
  """Per column ([(chunk_off, row_offset, nrows), ...], squeeze), as Python ints, of the
  descriptor at buf[start:] (as encode_descriptor wrote it)."""
  ncols, nslices = _DESC_HDR_STRUCT.unpack_from(buf, start)
  body = _DESC_BODY_STRUCTS.get((ncols, nslices))
  if body is None:
    body = _DESC_BODY_STRUCTS[(ncols, nslices)] = struct.Struct(
        "<" + "IIII" * ncols + "QII" * nslices)
  words = body.unpack_from(buf, start + _DESC_HDR_STRUCT.size)
  slices = [words[i:i + 3] for i in range(4 * ncols, len(words), 3)]
  return [(slices[words[i]:words[i] + words[i + 1]], bool(words[i + 2] & SQUEEZE))
          for i in range(0, 4 * ncols, 4)]


def _meta(seg, chunk_off: int, cache: dict) -> "_ChunkMeta":
  meta = cache.get(chunk_off)
  if meta is None:
    meta = cache[chunk_off] = _ChunkMeta(seg, chunk_off)
  return meta


def read_item(seg, desc_off: int, pins: Pins, cache: Optional[dict] = None) -> List[np.ndarray]:
  """Columns of a pinned item: zero-copy read-only views for single-slice numeric columns
  (kept valid by `pins` while any view lives), copies otherwise (multi-slice, object).

  Squeezed columns have no time dim. `cache` (a dict reused across the items of one pinned
  batch) memoises chunk headers. For many items, :func:`read_items` is faster.
  """
  cache = {} if cache is None else cache
  out = []
  for c, (slices, squeeze) in enumerate(_decode_descriptor(seg, int(desc_off))):
    first = _meta(seg, slices[0][0], cache)
    if first.dtype is _OBJECT:
      parts = [_read_object_rows(seg, _meta(seg, off, cache), r, m) for off, r, m in slices]
      arr = parts[0] if len(parts) == 1 else np.concatenate(parts)
    elif len(slices) == 1:
      _, r, m = slices[0]
      out.append(_pinned_view(seg, pins, first.data_address + r * first.row_bytes,
                              first.shape if squeeze else (m,) + first.shape, first.dtype))
      continue
    else:
      rows = sum(m for _, _, m in slices)
      arr = np.empty((rows,) + first.shape, first.dtype)
      _gather(seg, np.array([desc_off], np.uint64), c, arr, rows * first.row_bytes)
    out.append(arr.reshape(arr.shape[1:]) if squeeze else arr)
  return out


def read_items(seg, desc_offs, pins: Pins) -> List[List[np.ndarray]]:
  """Columns of every item of a pinned batch, as :func:`read_item` returns them.

  Items whose columns are single slices (what SharedTable.insert, Client.insert and most
  writer items hold) are decoded together: numpy reads their descriptors at once and their
  views slice one pinned view per chunk. Other items go through read_item.

  Args:
    seg: the Segment.
    desc_offs: uint64[B] descriptor offsets (rs_sample_rec.desc_off), held by `pins`.
    pins: the batch's pins; every view keeps them alive.

  Returns:
    B lists of arrays, one per column: read-only zero-copy views for numeric columns
    (squeezed columns without time dim), copies for object and multi-slice columns.
  """
  offs = np.asarray(desc_offs, np.uint64)
  cache: dict = {}                           # chunk headers; valid while `pins` are held
  if len(offs) < 4:                    # below this, numpy's per-call overhead dominates
    return [read_item(seg, off, pins, cache) for off in offs.tolist()]
  out: List[Any] = [None] * len(offs)
  words = np.frombuffer(seg.buf, np.uint32, seg.size // 4)
  shifts = (offs >> np.uint64(_REF_OFF_BITS)).astype(np.int64)
  at = ((offs & np.uint64(_REF_OFF_MASK)) + np.uint64(_DESC_DATA_OFFSET)).astype(np.int64) >> 2
  ncols, nslices = words[at], words[at + 1]
  single = ncols == nslices            # every column is one slice
  for k in np.unique(ncols[single]).tolist():
    items = np.flatnonzero(single & (ncols == k))
    col_at = (at[items] + 2)[:, None] + 4 * np.arange(k)          # rs_desc_col words
    squeeze = (words[col_at + 2] & SQUEEZE) != 0
    slice_at = (at[items] + 2 + 4 * k)[:, None] + 4 * words[col_at].astype(np.int64)
    chunk_offs = words[slice_at].astype(np.uint64) | (
        words[slice_at + 1].astype(np.uint64) << np.uint64(32))
    first_rows = words[slice_at + 2] + shifts[items][:, None]
    nrows = words[slice_at + 3]
    uniq, which = np.unique(chunk_offs.ravel(), return_inverse=True)
    which = which.reshape(len(items), k)
    chunk_views = [_chunk_view(seg, pins, off, cache) for off in uniq.tolist()]
    is_object = np.array([v is None for v in chunk_views])
    per_column = []
    for c in range(k):  # column-major: one comprehension per column in the common cases
      views = [chunk_views[j] for j in which[:, c].tolist()]
      rows, counts = first_rows[:, c].tolist(), nrows[:, c].tolist()
      squeezed = squeeze[:, c]
      if is_object[which[:, c]].any():  # string columns (copies), item by item
        per_column.append([
            _object_rows(seg, cache[off], r, m, q) if v is None else
            v[r, ...] if q else v[r:r + m]
            for v, off, r, m, q in zip(views, chunk_offs[:, c].tolist(), rows, counts,
                                       squeezed.tolist())])
      elif squeezed.all():  # a 0-d view (not a copied scalar) for scalar elements
        per_column.append([v[r, ...] for v, r in zip(views, rows)])
      elif not squeezed.any():
        per_column.append([v[r:r + m] for v, r, m in zip(views, rows, counts)])
      else:
        per_column.append([v[r, ...] if q else v[r:r + m]
                           for v, r, m, q in zip(views, rows, counts, squeezed.tolist())])
    for item, columns in zip(items.tolist(), zip(*per_column)):
      out[item] = list(columns)
  for item in np.flatnonzero(~single).tolist():
    out[item] = read_item(seg, int(offs[item]), pins, cache)
  return out


def _object_rows(seg, meta: "_ChunkMeta", row: int, nrows: int, squeeze: bool) -> np.ndarray:
  arr = _read_object_rows(seg, meta, row, nrows)
  return arr.reshape(arr.shape[1:]) if squeeze else arr


def _chunk_view(seg, pins: Pins, chunk_off: int, cache: dict) -> Optional[np.ndarray]:
  """Read-only pinned view (capacity, *shape) of a numeric chunk; None for object chunks."""
  meta = _meta(seg, chunk_off, cache)
  if meta.dtype is _OBJECT:
    return None
  return _pinned_view(seg, pins, meta.data_address, (meta.capacity,) + meta.shape, meta.dtype)


def _gather(seg, desc_offs: np.ndarray, col: int, out: np.ndarray, col_bytes: int) -> None:
  n = len(desc_offs)
  stride = out.strides[0] if out.ndim and n else col_bytes
  check(lib.rs_gather(seg.base, n, ffi.from_buffer("uint64_t[]", desc_offs), col,
                      ffi.cast("uint8_t *", ffi.from_buffer(out, require_writable=True)),
                      stride, col_bytes),
        f"gathering column {col}")


def column_spec(seg, desc_off: int, col: int) -> Tuple[np.dtype, tuple, int]:
  """(dtype, per-item shape, column bytes) of column `col` of an item."""
  columns = item_columns(seg, desc_off)
  if not 0 <= col < len(columns):
    raise IndexError(f"column {col} out of range: the item has {len(columns)} columns")
  slices, squeeze = columns[col]
  meta = _ChunkMeta(seg, int(slices[0]["chunk_off"]))
  rows = int(slices["nrows"].sum())
  shape = meta.shape if squeeze else (rows,) + meta.shape
  return meta.dtype, shape, rows * meta.row_bytes


def gather_column(seg, desc_offs: np.ndarray, col: int,
                  out: Optional[np.ndarray] = None) -> np.ndarray:
  """Copies column `col` of every item into one (B, *col_shape) array with one C call.

  All items must have the column's dtype and shape of the first item (else ValueError naming
  the item). `out`, if given, must have exactly that dtype and shape and C-contiguous rows.
  """
  desc_offs = np.ascontiguousarray(desc_offs, np.uint64)
  if len(desc_offs) == 0:
    raise ValueError("gather_column needs at least one item")
  dtype, shape, col_bytes = column_spec(seg, int(desc_offs[0]), col)
  full = (len(desc_offs),) + shape
  if dtype is _OBJECT:
    rows = []
    for d in desc_offs:
      slices, squeeze = item_columns(seg, int(d))[col]
      parts = [_read_object_rows(seg, _ChunkMeta(seg, int(s["chunk_off"])), int(s["row_offset"]),
                                 int(s["nrows"])) for s in slices]
      v = np.concatenate(parts)
      rows.append(v[0] if squeeze else v)
    result = np.empty(full, dtype=object) if out is None else out
    for i, r in enumerate(rows):
      result[i] = r
    return result
  if out is None:
    out = np.empty(full, dtype)
  else:
    if not isinstance(out, np.ndarray):
      raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    if out.dtype != dtype or out.shape != full:
      raise ValueError(f"out for column {col} must have dtype {dtype} and shape {full}, got "
                       f"dtype {out.dtype} and shape {out.shape}")
    if not out.flags.writeable or not out.flags.c_contiguous:
      raise ValueError(f"out for column {col} must be writeable and C-contiguous")
  _gather(seg, desc_offs, col, out, col_bytes)
  return out


# ---------------------------------------------------------------- chunk readers
# Public readers of a chunk by arena offset, for processes that forward chunks they wrote
# (the gRPC bridge's remote client reads its staging arena with these).


def chunk_header(seg, off: int) -> _ChunkMeta:
  """Header of the chunk at arena offset `off`.

  The result has attributes dtype (np.dtype; object for str/bytes chunks), shape (element
  shape, tuple), capacity and rows (ints), row_bytes (0 for object chunks), episode_id and
  start_step. The caller must hold the chunk (a pin) while it reads it.
  """
  return _ChunkMeta(seg, int(off))


def chunk_state(seg, off: int) -> tuple:
  """(episode_id, start_step, capacity, row_bytes, rows) of the chunk at `off`: what changes
  when its block is reused, and its published rows (cheaper than chunk_header)."""
  h = ffi.cast("rs_chunk_hdr *", seg.address + off)
  return h.episode_id, h.start_step, h.capacity, h.row_bytes, h.rows


def chunk_row_bytes(seg, header: _ChunkMeta, first: int, last: int) -> bytes:
  """A copy of rows [first, last) of a numeric chunk, C order ((last - first) * row_bytes)."""
  start = header.data_address - seg.address
  return bytes(seg.buf[start + first * header.row_bytes:start + last * header.row_bytes])


def object_chunk_rows(seg, header: _ChunkMeta, first: int, nrows: int) -> np.ndarray:
  """Rows [first, first + nrows) of an object chunk as an object array (nrows, *shape)."""
  return _read_object_rows(seg, header, int(first), int(nrows))
