"""Bridge server: serves a local reverb_shm server's tables over gRPC.

The bridge attaches to the server's segment like any client process; tables never depend on
it (a dying bridge's pins are reaped by the server). RPCs of service `reverb_shm.Bridge`:

  ServerInfo  unary           {} -> {"tables": [{"name", "stats", "signature"}]}
  Mutate      unary           {"table", "upd_keys", "upd_prios", "del_keys"} -> {"updated", "deleted"}
  Reset       unary           {"table"} -> {}
  Checkpoint  unary           {} -> {"path"}
  Sample      stream-stream   first {"table", "n", "timeout_ms", "credit"}, then {"credit"};
                              replies one sample each (bounded by the credit the client grants)
  Write       stream-stream   chunk / rows / obj / drop / items ops; one reply per "items" op

Every request is validated before it touches a table (wire.py); errors travel as gRPC status
codes with the reverb_shm error class in the `rs-error` trailing metadata (Write replies carry
them in-band).
"""
import concurrent.futures
import dataclasses
import logging
import math
import time
from typing import Dict, Optional

import grpc
import numpy as np

from reverb_shm import chunks, errors, shm, specs
from reverb_shm.bridge import security, wire
from reverb_shm.shared_table import SharedTable

__all__ = ["Bridge", "BridgeConfig"]

_log = logging.getLogger(__name__)

# Server-side slice of blocking table calls, so cancellation is noticed within it.
_SLICE_MS = 100
_MAX_CREDIT = 1024
_MAX_KEYS = 1 << 20
_MAX_ITEMS_PER_OP = 1 << 16
_MAX_COLUMNS = 4096
_MAX_SLICES = 1 << 16
_MAX_CHUNK_ROWS = 1 << 31

_STATUS = {
    "InvalidArgumentError": grpc.StatusCode.INVALID_ARGUMENT,
    "BadMessage": grpc.StatusCode.INVALID_ARGUMENT,
    "UnknownTableError": grpc.StatusCode.NOT_FOUND,
    "DeadlineExceededError": grpc.StatusCode.DEADLINE_EXCEEDED,
    "ResourceExhaustedError": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "TableClosedError": grpc.StatusCode.FAILED_PRECONDITION,
    "ServerUnavailableError": grpc.StatusCode.UNAVAILABLE,
}


@dataclasses.dataclass
class BridgeConfig:
  """Options of a bridge.

  Attributes:
    port: TCP port (0 picks a free one).
    host: address to bind; anything but loopback requires `tls` or `token`.
    token: auth token every call must carry (None: no token check).
    tls: server certificate and key (and optional client CA) for TLS.
    max_message_bytes: largest logical message (item, chunk rows) accepted, in bytes.
    max_stream_chunks: chunks one writer stream may hold at once.
    max_concurrent_rpcs: open RPCs (each writer and sampler holds one); more get
      RESOURCE_EXHAUSTED instead of waiting.
  """
  port: int = 0
  host: str = "127.0.0.1"
  token: Optional[str] = None
  tls: Optional[security.ServerTLS] = None
  max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
  max_stream_chunks: int = 1 << 16
  max_concurrent_rpcs: int = 64


class _Abort(Exception):
  """Raised inside handlers to end the call with an error status."""


class Bridge:
  """Serves the tables of local server `server` (a name or a Server) over gRPC.

  Args:
    server: reverb_shm Server, or the server name (its segment must exist on this host).
    config: options (default: loopback, a free port, no auth).

  Raises:
    ValueError: non-loopback host without TLS or token; port unavailable.
    ServerUnavailableError: no server of that name.
  """

  def __init__(self, server, config: Optional[BridgeConfig] = None):
    config = config or BridgeConfig()
    security.check_bind_policy(config.host, config.tls, config.token)
    self._config = config
    name = server if isinstance(server, str) else server.name
    self._seg = shm.Segment.attach(name)
    self._tables: Dict[str, SharedTable] = {}
    self._grpc = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=config.max_concurrent_rpcs,
                                              thread_name_prefix="reverb_shm-bridge"),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        options=[("grpc.so_reuseport", 0)])
    handlers = {
        "ServerInfo": grpc.unary_unary_rpc_method_handler(self._server_info),
        "Mutate": grpc.unary_unary_rpc_method_handler(self._mutate),
        "Reset": grpc.unary_unary_rpc_method_handler(self._reset),
        "Checkpoint": grpc.unary_unary_rpc_method_handler(self._checkpoint),
        "Sample": grpc.stream_stream_rpc_method_handler(self._sample),
        "Write": grpc.stream_stream_rpc_method_handler(self._write),
    }
    self._grpc.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(wire.SERVICE, handlers),))
    target = f"[{config.host}]:{config.port}" if ":" in config.host else \
        f"{config.host}:{config.port}"
    try:
      if config.tls is not None:
        self._port = self._grpc.add_secure_port(target, config.tls.credentials())
      else:
        self._port = self._grpc.add_insecure_port(target)
    except RuntimeError as e:
      raise ValueError(f"Failed to bind bridge to {target}: {e}") from None
    if not self._port:
      raise ValueError(f"Failed to bind bridge to {target}")
    self._grpc.start()
    self._stopped = False

  @property
  def port(self) -> int:
    return self._port

  @property
  def address(self) -> str:
    host = self._config.host
    return f"[{host}]:{self._port}" if ":" in host else f"{host}:{self._port}"

  def stop(self, grace: Optional[float] = 0.1) -> None:
    """Stops serving (open streams are cancelled after `grace` seconds). Idempotent."""
    if not self._stopped:
      self._stopped = True
      self._grpc.stop(grace).wait(timeout=(grace or 0) + 5)

  def wait(self) -> None:
    """Blocks until the bridge stops (Ctrl-C stops it)."""
    try:
      self._grpc.wait_for_termination()
    except KeyboardInterrupt:
      self.stop()
      raise

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()

  # ---- helpers
  def _table(self, name: str) -> SharedTable:
    st = self._tables.get(name)
    if st is None:
      st = SharedTable(self._seg, self._seg.table_index(name))
      self._tables[name] = st
    return st

  def _authorize(self, context) -> None:
    if not security.token_ok(self._config.token, context.invocation_metadata()):
      context.abort(grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong auth token (metadata 'authorization: Bearer TOKEN')")

  @staticmethod
  def _fail(context, exc: BaseException):
    """Ends the call with the status of `exc` (raises)."""
    if isinstance(exc, NotImplementedError):
      context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
    name = wire.error_name(exc)
    code = _STATUS.get(name, grpc.StatusCode.INTERNAL)
    if code is grpc.StatusCode.INTERNAL:
      _log.exception("bridge: unexpected error", exc_info=exc)
    context.set_trailing_metadata((("rs-error", name),))
    context.abort(code, str(exc) or type(exc).__name__)

  def _unary(self, request: bytes, context, body):
    self._authorize(context)
    try:
      return wire.pack(body(wire.unpack(request, 1 << 22)))
    except Exception as e:  # pylint: disable=broad-except  (mapped to a status)
      self._fail(context, e)

  # ---- unary RPCs
  def _server_info(self, request, context):
    def body(msg):
      wire.no_fields(msg, "ServerInfo")
      tables = []
      for index, name in enumerate(self._seg.table_names()):
        st = self._table(name)
        tables.append({"name": name, "stats": self._seg.stats(index),
                       "signature": specs.encode_signature(st.signature)})
      return {"tables": tables}
    return self._unary(request, context, body)

  def _mutate(self, request, context):
    def body(msg):
      st = self._table(wire.get_str(msg, "table"))
      keys = wire.u64_array(msg, "upd_keys", _MAX_KEYS)
      prios = wire.f64_array(msg, "upd_prios", len(keys))
      dels = wire.u64_array(msg, "del_keys", _MAX_KEYS)
      updated, deleted = st.mutate(dict(zip(keys.tolist(), prios.tolist())), dels.tolist())
      return {"updated": updated, "deleted": deleted}
    return self._unary(request, context, body)

  def _reset(self, request, context):
    def body(msg):
      self._table(wire.get_str(msg, "table")).reset()
      return {}
    return self._unary(request, context, body)

  def _checkpoint(self, request, context):
    def body(msg):
      wire.no_fields(msg, "Checkpoint")
      from reverb_shm.client import Client  # pylint: disable=g-import-not-at-top
      return {"path": Client(f"shm://{self._seg.name}").checkpoint()}
    return self._unary(request, context, body)

  # ---- sampling
  def _sample(self, request_iterator, context):
    self._authorize(context)
    try:
      reader = _Reader(request_iterator, 1 << 16)
      first = reader.next()
      if first is None:
        return
      st = self._table(wire.get_str(first, "table"))
      n = wire.get_int(first, "n", 1, 2**62)
      timeout_ms = wire.timeout_field(first)
      credit = wire.get_int(first, "credit", 1, _MAX_CREDIT)
      for _ in range(n):
        while credit == 0:
          msg = reader.next()
          if msg is None:
            return     # the client closed its side: it wants no more samples
          credit += wire.get_int(msg, "credit", 1, _MAX_CREDIT)
        sample = self._sample_one(st, timeout_ms, context)
        if sample is None:
          return       # cancelled
        yield from wire.frames(wire.pack(sample))
        credit -= 1
    except Exception as e:  # pylint: disable=broad-except  (mapped to a status)
      self._fail(context, e)

  def _sample_one(self, st: SharedTable, timeout_ms: Optional[int], context) -> Optional[dict]:
    """One sample as a wire map; None if the call was cancelled while waiting."""
    deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
    remaining_call = context.time_remaining()
    if remaining_call is not None:
      call_deadline = time.monotonic() + remaining_call
      deadline = call_deadline if deadline is None else min(deadline, call_deadline)
    while True:
      if not context.is_active():
        return None
      wait_ms = _SLICE_MS
      if deadline is not None:
        wait_ms = max(0, min(_SLICE_MS, int((deadline - time.monotonic()) * 1000)))
      try:
        recs, pins = st.sample_records(1, wait_ms)
        break
      except errors.DeadlineExceededError:
        if deadline is not None and time.monotonic() >= deadline:
          raise errors.DeadlineExceededError(
              st._limiter_message("sample", timeout_ms)) from None  # pylint: disable=protected-access
    try:
      key, probability, table_size, priority, times_sampled, _, desc_off = recs[0].tolist()
      encoded = [_encode_column(c) for c in chunks.read_item(self._seg, desc_off, pins)]
    finally:
      pins.release()   # the encoded columns are copies
    return {"info": [key, probability, table_size, priority, times_sampled], "cols": encoded}

  # ---- writing
  def _write(self, request_iterator, context):
    self._authorize(context)
    stream = _WriteStream(self, context)
    try:
      reader = _Reader(request_iterator, self._config.max_message_bytes)
      while True:
        msg = reader.next()
        if msg is None:
          return
        reply = stream.handle(msg)
        if reply is not None:
          yield from wire.frames(wire.pack(reply))
    except Exception as e:  # pylint: disable=broad-except  (mapped to a status)
      self._fail(context, e)
    finally:
      stream.close()


def _encode_column(col: np.ndarray) -> dict:
  if col.dtype.kind == "O":
    flat = [x.item() if isinstance(x, np.generic) else x for x in col.reshape(-1)]
    return {"o": flat, "s": list(col.shape)}
  return wire.encode_array(col)


class _Reader:
  """Logical messages from a stream of frames (None at the end of the stream)."""

  def __init__(self, request_iterator, max_bytes: int):
    self._it = request_iterator
    self._asm = wire.Reassembler(max_bytes)

  def next(self) -> Optional[dict]:
    for frame in self._it:
      msg = self._asm.feed(frame)
      if msg is not None:
        return msg
    return None


class _WriteStream:
  """State of one Write stream: the chunks it wrote, by the client's chunk ids."""

  def __init__(self, bridge: Bridge, context):
    self._bridge = bridge
    self._seg = bridge._seg  # pylint: disable=protected-access
    self._context = context
    self._max_chunks = bridge._config.max_stream_chunks  # pylint: disable=protected-access
    self._chunks: Dict[int, chunks.Chunk] = {}
    self._failed: Dict[int, BaseException] = {}

  def close(self) -> None:
    for chunk in self._chunks.values():
      chunk.release()
    self._chunks.clear()

  def handle(self, msg: dict) -> Optional[dict]:
    op = wire.get_str(msg, "op")
    if op == "items":
      return self._items(msg)
    if op == "drop":
      for cid in wire.get_list(msg, "ids", self._max_chunks):
        if isinstance(cid, int) and not isinstance(cid, bool):
          self._failed.pop(cid, None)
          chunk = self._chunks.pop(cid, None)
          if chunk is not None:
            chunk.shrink()
            chunk.release()
      return None
    if op not in ("chunk", "rows", "obj"):
      raise wire.BadMessage(f"unknown Write op {op!r}")
    cid = wire.get_int(msg, "id", 0, 2**63)
    try:
      if op == "chunk":
        self._new_chunk(cid, msg)
      elif op == "rows":
        self._rows(cid, msg)
      else:
        self._object_chunk(cid, msg)
    except wire.BadMessage:
      raise
    except errors.ReverbError as e:   # e.g. arena full: reported by the next items op
      self._failed[cid] = e
    return None

  def _check_new_id(self, cid: int) -> None:
    if cid in self._chunks:
      raise wire.BadMessage(f"chunk id {cid} is already in use on this stream")
    if len(self._chunks) >= self._max_chunks:
      raise errors.ResourceExhaustedError(
          f"writer stream holds {len(self._chunks)} chunks, the limit; raise "
          "BridgeConfig.max_stream_chunks (--max-stream-chunks)")
    self._failed.pop(cid, None)

  def _new_chunk(self, cid: int, msg: dict) -> None:
    dtype = wire.check_dtype(msg.get("d"), "chunk")
    shape = wire.check_shape(msg.get("s"), "chunk")
    capacity = wire.get_int(msg, "cap", 1, _MAX_CHUNK_ROWS - 1)
    episode = wire.get_int(msg, "ep", 0, 2**64 - 1)
    step = wire.get_int(msg, "step", 0, 2**63 - 1)
    nbytes = capacity * dtype.itemsize * math.prod(shape)
    if nbytes > self._seg.size:
      raise wire.BadMessage(f"chunk of {nbytes} bytes is larger than the server's segment")
    self._check_new_id(cid)
    self._chunks[cid] = chunks.alloc_chunk(self._seg, dtype, shape, capacity,
                                           episode_id=episode, start_step=step)

  def _rows(self, cid: int, msg: dict) -> None:
    if cid in self._failed:
      return
    chunk = self._chunks.get(cid)
    if chunk is None:
      raise wire.BadMessage(f"rows for unknown chunk id {cid}")
    first = wire.get_int(msg, "first", 0, _MAX_CHUNK_ROWS)
    data = wire.get(msg, "b", bytes)
    if chunk.data is None:
      raise wire.BadMessage(f"chunk {cid} holds objects; rows cannot be added")
    row_bytes = chunk.dtype.itemsize * math.prod(chunk.shape)
    if first != chunk.rows or not row_bytes or len(data) % row_bytes or (
        first + len(data) // row_bytes > chunk.capacity):
      raise wire.BadMessage(
          f"rows message for chunk {cid} does not fit: first row {first} (expected "
          f"{chunk.rows}), {len(data)} bytes of {row_bytes}-byte rows, capacity "
          f"{chunk.capacity}")
    k = len(data) // row_bytes
    if k:
      chunk.write_rows(np.frombuffer(data, chunk.dtype).reshape((k,) + chunk.shape))

  def _object_chunk(self, cid: int, msg: dict) -> None:
    shape = wire.check_shape(msg.get("s"), "object chunk")
    size = math.prod(shape)
    rows = wire.get_list(msg, "rows", _MAX_CHUNK_ROWS)
    if not rows:
      raise wire.BadMessage("object chunk needs at least one row")
    values = []
    for row in rows:
      if not isinstance(row, list) or len(row) != size or not all(
          isinstance(x, (str, bytes, int, float, bool)) or x is None for x in row):
        raise wire.BadMessage(f"object chunk rows must be lists of {size} str/bytes/numbers")
      arr = np.empty(size, dtype=object)
      arr[:] = row
      values.append(arr.reshape(shape) if shape else arr[0])
    episode = wire.get_int(msg, "ep", 0, 2**64 - 1)
    step = wire.get_int(msg, "step", 0, 2**63 - 1)
    self._check_new_id(cid)
    self._chunks[cid] = chunks.object_chunk(self._seg, values, episode_id=episode,
                                            start_step=step)

  def _items(self, msg: dict) -> dict:
    seq = wire.get_int(msg, "seq", 0, 2**63)
    try:
      st = self._bridge._table(wire.get_str(msg, "table"))  # pylint: disable=protected-access
      keys = wire.u64_array(msg, "keys", _MAX_ITEMS_PER_OP)
      prios = wire.f64_array(msg, "prios", len(keys))
      descs = wire.get_list(msg, "descs", _MAX_ITEMS_PER_OP)
      if len(descs) != len(keys):
        raise wire.BadMessage(f"{len(keys)} keys for {len(descs)} item descriptors")
      timeout_ms = wire.timeout_field(msg)
      blob, offs = chunks.join_descriptors([self._descriptor(d) for d in descs])
      inserted = self._insert(st, keys, prios, blob, offs, timeout_ms)
      return {"seq": seq, "n": inserted}
    except wire.BadMessage:
      raise
    except errors.DeadlineExceededError as e:
      return {"seq": seq, "n": e.inserted, "err": [wire.error_name(e), str(e)]}
    except (errors.ReverbError, ValueError, TypeError) as e:
      return {"seq": seq, "n": 0, "err": [wire.error_name(e), str(e)]}

  def _descriptor(self, desc) -> bytes:
    """An item descriptor with stream chunk ids replaced by arena offsets (all validated)."""
    if not isinstance(desc, list) or not 1 <= len(desc) <= _MAX_COLUMNS:
      raise wire.BadMessage(f"an item must be a list of 1..{_MAX_COLUMNS} columns")
    columns = []
    for col in desc:
      if (not isinstance(col, list) or len(col) != 2 or not isinstance(col[1], bool)
          or not isinstance(col[0], list) or not 1 <= len(col[0]) <= _MAX_SLICES):
        raise wire.BadMessage("an item column must be [[[chunk id, row, rows], ...], squeeze]")
      slices = []
      for sl in col[0]:
        if (not isinstance(sl, list) or len(sl) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in sl)):
          raise wire.BadMessage("an item slice must be [chunk id, first row, rows]")
        cid, row, nrows = sl
        failed = self._failed.get(cid)
        if failed is not None:
          raise failed
        chunk = self._chunks.get(cid)
        if chunk is None:
          raise wire.BadMessage(f"item refers to chunk id {cid}, which this stream did not send "
                                "(or dropped)")
        if not (0 <= row and 1 <= nrows and row + nrows <= chunk.rows):
          raise wire.BadMessage(f"item slice rows [{row}, {row + nrows}) exceed the "
                                f"{chunk.rows} rows written to chunk {cid}")
        slices.append((chunk.off, row, nrows))
      columns.append((slices, col[1]))
    return chunks.encode_descriptor(columns)

  def _insert(self, st: SharedTable, keys, prios, blob, offs, timeout_ms) -> int:
    """Inserts in slices of _SLICE_MS so a cancelled call stops waiting; returns n."""
    n = len(keys)
    deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
    done = 0
    while True:
      wait_ms = _SLICE_MS if deadline is None else max(
          0, min(_SLICE_MS, int((deadline - time.monotonic()) * 1000)))
      start, end = int(offs[done]), int(offs[-1])
      try:
        st.insert_descriptors(keys[done:], prios[done:], blob[start:end],
                              offs[done:] - offs[done], wait_ms)
        return n
      except errors.DeadlineExceededError as e:
        done += e.inserted
        expired = deadline is not None and time.monotonic() >= deadline
        if expired or not self._context.is_active():
          raise errors.DeadlineExceededError(
              f"Rate limiter timeout on table {st._name!r}: insert blocked for {timeout_ms} ms; "  # pylint: disable=protected-access
              f"{done} of {n} items inserted ({e})", inserted=done) from None
