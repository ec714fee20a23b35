"""Item encoding: the descriptors (chunk slices per column) that the C core inserts.

An item's descriptor lists, per column, the (chunk offset, first row, row count) slices it
references and whether the column is squeezed (a single step without its time dimension).
`encode_windows` encodes many items whose columns are windows over a writer's history in one C
call; `encode_item` encodes one item of arbitrary TrajectoryColumns, validating them.
"""
from typing import List, Optional, Tuple

import numpy as np

from reverb_shm._internal import chunks, structure
from reverb_shm._internal._lib import check, ffi, lib
from reverb_shm._internal.columns import check_signature
from reverb_shm._internal.history import CellRef, TrajectoryColumn

__all__ = ["SQUEEZE_FLAG", "column_slices", "encode_windows", "encode_item"]

# Descriptor sizes (rs_desc_hdr, rs_desc_col, rs_desc_slice) and the squeeze flag.
_DESC_FIXED, _DESC_COL, _DESC_SLICE = (chunks.DESC_HDR.itemsize, chunks.DESC_COL.itemsize,
                                       chunks.DESC_SLICE.itemsize)
SQUEEZE_FLAG = chunks.SQUEEZE


def column_slices(refs: List[CellRef]) -> Tuple[list, list]:
  """Merges consecutive rows of one chunk into (chunk_off, row_offset, nrows) slices; also
  returns the holders (refs must be alive)."""
  slices: list = []
  holders = []
  last_holder = None
  last_end = -1
  for ref in refs:
    holder, row = ref._column.locate(ref._pos)
    if holder is last_holder and row == last_end:
      off, start, nrows = slices[-1]
      slices[-1] = (off, start, nrows + 1)
    else:
      slices.append((holder.off, row, 1))
      holders.append(holder)
    last_holder, last_end = holder, row + 1
  return slices, holders


def encode_windows(kind: tuple, starts: np.ndarray, priorities: Optional[np.ndarray] = None,
                    nonneg: bool = False, alive: bool = False) -> Tuple[np.ndarray, np.ndarray]:
  """Descriptors of items whose column c covers kind's length c steps from starts[i, c]
  (starts of shape (n, ncols), positions) or starts[i] (shape (n,), negative ones counting
  from each column's end). Validates priorities when given, and (alive) that every step is
  inside its keep-alive window; InvalidArgumentError names the first bad item."""
  _, sig, flags, lengths = kind
  n, ncols = len(starts), len(sig)
  segs, col_segs, ends, bound = [], [0], [], 0
  for col, length, _ in sig:
    col_runs = col.segments(col.alive_from() if alive else 0)
    segs += col_runs
    col_segs.append(len(segs))
    ends.append(col.n)
    bound += min(length, len(col_runs))
  cap = n * (_DESC_FIXED + _DESC_COL * ncols + _DESC_SLICE * bound)
  blob = np.empty(cap, np.uint8)
  offs = np.empty(n + 1, np.uint64)
  size = ffi.new("uint64_t *")
  check(lib.rs_encode_windows(
      n, ncols, ffi.new("rs_window_seg[]", segs), ffi.new("uint32_t[]", col_segs),
      ffi.new("int64_t[]", ends), flags, lengths, ffi.from_buffer("int64_t[]", starts),
      1 if starts.ndim == 1 else ncols,
      ffi.NULL if priorities is None else ffi.from_buffer("double[]", priorities),
      bool(nonneg), ffi.from_buffer("uint8_t[]", blob, require_writable=True), cap,
      ffi.from_buffer("uint64_t[]", offs, require_writable=True), size), "creating items")
  return blob[:size[0]], offs


def encode_item(writer, handle, trajectory, validate: bool):
  leaves, _ = structure.flatten(trajectory)
  if not leaves:
    raise ValueError("trajectory must not be empty.")
  desc_columns = []
  holders = {}
  shapes = []
  for i, leaf in enumerate(leaves):
    if not isinstance(leaf, TrajectoryColumn):
      raise TypeError(f"All leaves of the trajectory must be TrajectoryColumns, but leaf {i} "
                      f"is a {type(leaf).__name__}: {leaf!r}")
    refs = leaf._refs
    if not refs:
      raise ValueError(f"Error in column {i}: the column references no steps.")
    first = refs[0]
    first_column = first._column
    if first_column.writer is not writer:
      raise ValueError(f"Error in column {i}: the column references data of another "
                       "TrajectoryWriter.")
    for ref in refs:
      if ref.expired:
        raise ValueError(f"Error in column {i}: Column contains expired CellRef.")
      column = ref._column
      if column is not first_column:   # refs of one column agree by construction
        if column.writer is not writer:
          raise ValueError(f"Error in column {i}: the column references data of another "
                           "TrajectoryWriter.")
        if column.dtype != first_column.dtype:
          raise ValueError(f"Error in column {i}: Column contains mixed dtypes "
                           f"({first.dtype} and {ref.dtype}).")
        if column.shape != first_column.shape:
          raise ValueError(f"Error in column {i}: Column contains incompatible shapes "
                           f"({list(first.shape)} and {list(ref.shape)}).")
    slices, column_holders = column_slices(refs)
    for holder in column_holders:
      holders[id(holder)] = holder
    desc_columns.append((slices, leaf._squeeze))
    if validate and handle.flat_signature is not None:
      shapes.append((first_column.dtype, leaf.shape))
  if shapes:
    check_signature(handle.name, handle.flat_signature, shapes)
  return desc_columns, tuple(holders.values())
