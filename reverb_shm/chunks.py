"""Chunks (column data written once into the arena), item descriptors, pins and reads.

Layouts shared with the C core (csrc/rs_api.h):
  item descriptor blob = rs_desc_hdr, ncols x rs_desc_col, nslices x rs_desc_slice;
  numeric chunk payload = `capacity` rows of `row_bytes`, C-contiguous;
  object chunk payload (dtype "O", row_bytes 0; only Python reads it) =
    uint64 end[capacity] (end of row i, relative to the first row byte), then the rows, each
    the msgpack encoding of the row's flattened elements (bytes / str / numbers).
"""
import math
import os
from typing import List, Optional, Sequence, Tuple

import msgpack
import numpy as np

from reverb_shm import errors
from reverb_shm._lib import check, ffi, lib

__all__ = ["Chunk", "Pins", "alloc_chunk", "object_chunk", "encode_descriptors",
           "encode_row_descriptors", "read_item", "gather_column", "item_columns",
           "DESC_HDR", "DESC_COL", "DESC_SLICE", "SAMPLE_REC", "ITEM_REC"]

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


def _u32(arr) -> "ffi.CData":
  return ffi.from_buffer("uint32_t[]", arr)


# ---------------------------------------------------------------- pins
class Pins:
  """Pins (chunk holds or sampled-item pins) held by one process slot.

  Released with one rs_unpin call by :meth:`release` or when garbage collected; arrays viewing
  pinned data keep this object alive through their `.base`. Releasing in a forked child is a
  no-op (the pins belong to the parent's slot). Thread-safe.
  """

  __slots__ = ("_seg", "_slot", "_pid", "_pins", "__weakref__")

  def __init__(self, seg, slot: int, pins: np.ndarray):
    self._seg = seg
    self._slot = slot
    self._pid = os.getpid()
    self._pins = np.ascontiguousarray(pins, dtype=np.uint32)

  def __len__(self):
    return 0 if self._pins is None else len(self._pins)

  @property
  def released(self) -> bool:
    return self._pins is None

  def release(self) -> None:
    """Drops the pins (idempotent)."""
    pins, self._pins = self._pins, None
    if pins is None or len(pins) == 0 or self._pid != os.getpid():
      return
    check(lib.rs_unpin(self._seg.base, self._slot, len(pins), _u32(pins)),
          f"releasing {len(pins)} pins")

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
                                "typestr": dtype.str, "version": 3,
                                "descr": dtype.descr if dtype.fields else [("", dtype.str)]}


def _pinned_view(seg, pins: Pins, address: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
  return np.asarray(_PinnedMemory(seg, pins, address, shape, dtype))


# ---------------------------------------------------------------- chunk headers
class _ChunkMeta:
  __slots__ = ("off", "dtype", "shape", "row_bytes", "data_address", "capacity", "rows",
               "episode_id", "start_step")

  def __init__(self, seg, off: int):
    h = ffi.cast("rs_chunk_hdr *", seg.address + off)
    code = ffi.string(h.dtype).decode("ascii")
    self.off = off
    self.dtype = _OBJECT if code == "O" else np.dtype(code)
    self.shape = tuple(h.shape[i] for i in range(h.ndim))
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

  Not thread-safe (one writer per chunk).
  """

  def __init__(self, seg, off: int, pin: int, slot: int):
    meta = _ChunkMeta(seg, off)
    self._seg = seg
    self.off = off
    self.capacity = meta.capacity
    self.rows = meta.rows
    self.dtype = meta.dtype
    self.shape = meta.shape
    self.episode_id = meta.episode_id
    self.start_step = meta.start_step
    self._pins = Pins(seg, slot, np.array([pin], np.uint32))
    if self.dtype is _OBJECT:
      self.data = None
    else:
      count = self.capacity * math.prod(self.shape)
      start = meta.data_address - seg.address
      self.data = np.frombuffer(seg.buf, self.dtype, count, start).reshape(
          (self.capacity,) + self.shape)

  def append(self, value) -> None:
    """Writes `value` (element shape, chunk dtype) as the next row and publishes it."""
    self.write_rows(np.asarray(value, dtype=self.dtype)[None])

  def write_rows(self, values) -> None:
    """Writes len(values) rows after the published ones and publishes them.

    Raises:
      ValueError: wrong dtype/shape or not enough capacity (nothing is written).
    """
    if self.data is None:
      raise ValueError("object chunks are written once by object_chunk()")
    values = np.asarray(values)
    if values.dtype != self.dtype:
      raise ValueError(f"chunk dtype is {self.dtype}, got rows of dtype {values.dtype}")
    if values.shape[1:] != self.shape:
      raise ValueError(f"chunk rows have shape {self.shape}, got rows of shape "
                       f"{values.shape[1:]}")
    n = values.shape[0]
    if self.rows + n > self.capacity:
      raise ValueError(f"chunk holds {self.capacity} rows, {self.rows} used; cannot write {n}")
    self.data[self.rows:self.rows + n] = values
    self._publish(self.rows + n)

  def _publish(self, rows: int) -> None:
    check(lib.rs_chunk_publish_rows(self._seg.base, self.off, rows), "publishing chunk rows")
    self.rows = rows

  def shrink(self) -> None:
    """Returns the unused capacity to the arena (needs >= 1 published row)."""
    if self.rows < self.capacity and self.rows > 0:
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
  slot = seg.slot
  off, pin = ffi.new("uint64_t *"), ffi.new("uint32_t *")
  check(lib.rs_chunk_alloc(seg.base, slot, meta, off, pin), "allocating chunk")
  return off[0], pin[0], slot


def alloc_chunk(seg, dtype, shape: Sequence[int], capacity: int, episode_id: int = 0,
                start_step: int = 0) -> Chunk:
  """Allocates a numeric chunk of `capacity` rows of `shape` x `dtype` in the arena.

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
  off, pin, slot = _alloc(seg, dtype.str.encode(), shape, row_bytes, row_bytes * capacity,
                          capacity, episode_id, start_step)
  return Chunk(seg, off, pin, slot)


def _pack_row(row) -> bytes:
  arr = np.asarray(row, dtype=object)
  return msgpack.packb([x.item() if isinstance(x, np.generic) else x
                        for x in arr.reshape(-1)], use_bin_type=True)


def object_chunk(seg, values: list, episode_id: int = 0, start_step: int = 0) -> Chunk:
  """Stores rows of str/bytes/object elements (all of one element shape) as msgpack.

  Raises:
    ValueError: rows of different shapes or elements msgpack cannot encode.
    ResourceExhaustedError: the arena has no room.
  """
  if not len(values):
    raise ValueError("object_chunk needs at least one row")
  shape = np.shape(values[0])
  try:
    packed = [_pack_row(v) for v in values]
  except (TypeError, ValueError) as e:
    raise ValueError(f"object column rows must hold str/bytes/numbers: {e}") from None
  for v in values:
    if np.shape(v) != shape:
      raise ValueError(f"object column rows differ in shape: {shape} vs {np.shape(v)}")
  n = len(packed)
  ends = np.cumsum([len(p) for p in packed], dtype=np.uint64)
  nbytes = 8 * n + int(ends[-1])
  off, pin, slot = _alloc(seg, b"O", tuple(shape), 0, nbytes, n, episode_id, start_step)
  chunk = Chunk(seg, off, pin, slot)
  start = _ChunkMeta(seg, off).data_address - seg.address
  seg.buf[start:start + 8 * n] = ends.tobytes()
  seg.buf[start + 8 * n:start + nbytes] = b"".join(packed)
  chunk._publish(n)  # pylint: disable=protected-access
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
def encode_descriptors(items) -> Tuple[bytes, np.ndarray]:
  """Encodes item descriptors for rs_insert.

  Args:
    items: sequence of items; an item is a sequence of columns `(slices, squeeze)` where
      slices is a list of (chunk_off, row_offset, nrows).

  Returns:
    (blob, offs): item i is blob[offs[i]:offs[i+1]]; offs is uint64 of length n+1.
  """
  parts = []
  offs = np.zeros(len(items) + 1, np.uint64)
  pos = 0
  for i, item in enumerate(items):
    ncols = len(item)
    nslices = sum(len(slices) for slices, _ in item)
    hdr = np.array([(ncols, nslices)], DESC_HDR)
    cols = np.zeros(ncols, DESC_COL)
    slc = np.zeros(nslices, DESC_SLICE)
    s = 0
    for c, (slices, squeeze) in enumerate(item):
      cols[c] = (s, len(slices), SQUEEZE if squeeze else 0, 0)
      for j, sl in enumerate(slices):
        slc[s + j] = tuple(sl)
      s += len(slices)
    blob = hdr.tobytes() + cols.tobytes() + slc.tobytes()
    parts.append(blob)
    pos += len(blob)
    offs[i + 1] = pos
  return b"".join(parts), offs


def encode_row_descriptors(chunk_offs: Sequence[int], n: int,
                           squeeze: bool = True) -> Tuple[bytes, np.ndarray]:
  """Descriptors of n items where item i is row i of every chunk (one slice per column).

  Vectorised: no per-item Python work.
  """
  ncols = len(chunk_offs)
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
  """Decodes a stored descriptor: per column (slices structured array, squeeze)."""
  start = int(desc_off) + _DESC_DATA_OFFSET
  hdr = np.frombuffer(seg.buf, DESC_HDR, 1, start)[0]
  ncols, nslices = int(hdr["ncols"]), int(hdr["nslices"])
  cols = np.frombuffer(seg.buf, DESC_COL, ncols, start + DESC_HDR.itemsize)
  slices = np.frombuffer(seg.buf, DESC_SLICE, nslices,
                         start + DESC_HDR.itemsize + ncols * DESC_COL.itemsize)
  return [(slices[c["first_slice"]:c["first_slice"] + c["nslices"]],
           bool(c["flags"] & SQUEEZE)) for c in cols]


# ---------------------------------------------------------------- reading
def read_item(seg, desc_off: int, pins: Pins, cache: Optional[dict] = None) -> List[np.ndarray]:
  """Columns of a pinned item: zero-copy read-only views for single-slice numeric columns
  (kept valid by `pins` while any view lives), copies otherwise (multi-slice, object).

  `cache` (a dict reused across the items of one pinned batch) memoises chunk headers.
  """
  out = []
  for c, (slices, squeeze) in enumerate(item_columns(seg, desc_off)):
    chunk_off = int(slices[0]["chunk_off"])
    first = cache.get(chunk_off) if cache is not None else None
    if first is None:
      first = _ChunkMeta(seg, chunk_off)
      if cache is not None:
        cache[chunk_off] = first
    if first.dtype is _OBJECT:
      parts = [_read_object_rows(seg, _ChunkMeta(seg, int(s["chunk_off"])), int(s["row_offset"]),
                                 int(s["nrows"])) for s in slices]
      arr = parts[0] if len(parts) == 1 else np.concatenate(parts)
    elif len(slices) == 1:
      s = slices[0]
      arr = _pinned_view(seg, pins, first.data_address + int(s["row_offset"]) * first.row_bytes,
                         (int(s["nrows"]),) + first.shape, first.dtype)
    else:
      rows = int(slices["nrows"].sum())
      arr = np.empty((rows,) + first.shape, first.dtype)
      _gather(seg, np.array([desc_off], np.uint64), c, arr, rows * first.row_bytes)
    out.append(arr.reshape(arr.shape[1:]) if squeeze else arr)
  return out


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
