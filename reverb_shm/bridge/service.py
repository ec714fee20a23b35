"""Bridge server: serves a local reverb_shm server's tables over gRPC.

The bridge attaches to the server's segment like any client process; tables never depend on
it (a dying bridge's pins are reaped by the server). RPCs of service `reverb_shm.Bridge`:

  ServerInfo  unary           {} -> {"tables": [{"name", "stats", "signature"}], "zmq_port",
                              "direct_port", "max_message_bytes"} (the last three without TLS)
  Mutate      unary           {"table", "upd_keys", "upd_prios", "del_keys"}
                              -> {"updated", "deleted"}
  Reset       unary           {"table"} -> {}
  Checkpoint  unary           {} -> {"path"}
  Insert      stream-stream   a client's persistent insert stream: each message is {"ops": [...]}
                              as a Write message (chunks and items of one Client.insert, ids
                              and seqs local to it) and gets one reply, the ack {"upto",
                              "errs"}, once its items were handled; its chunks are released then
  Sample      stream-stream   first {"table", "n", "timeout_ms", "credit", "batch"}, then
                              {"credit"}; replies carry up to `batch` samples each (about
                              4 MiB at most) and never more than the credit the client granted:
                              {"n", "keys", "probs", "sizes", "prios", "times", "cols"|"items"}
                              for samples of one column layout (cols: one array per column),
                              else {"n", "parts": [that map + "pos" (uint32 positions), ...]}
  Write       stream-stream   chunk / rows / obj / drop / items / itemrun / step (see
                              _WriteStream._step, _prepare_run) ops, one per message or
                              several as {"ops": [...]}; items ops are
                              confirmed in batches: one {"upto": seq, "errs": [[seq, n, error
                              class, message], ...]} covers every items op up to seq; it goes
                              out after a "sync" op, every 512 items or 20 ms, before an insert
                              waits for its rate limiter, and when the client closed its side

The server is a grpc.aio one on an event loop thread of its own (see Bridge). Without TLS, the
same streams are also served on a ZeroMQ port (zmq_port.py; its number is ServerInfo's
"zmq_port"), which the remote clients prefer: fewer copies and thread handoffs per message;
and Client.insert's messages on a direct TCP port (direct_port.py, "direct_port"), each
connection on a thread of its own that inserts without a hop through the event loop.
Every request is validated before it touches a table (wire.py); errors travel as gRPC status
codes with the reverb_shm error class in the `rs-error` trailing metadata (Write replies carry
them in-band).
"""
import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
from typing import Any, Dict, NamedTuple, Optional, Tuple

import grpc
import numpy as np

from reverb_shm import errors, specs
from reverb_shm._internal import chunks, hot_plans, shm, structure, timeouts
from reverb_shm._internal import columns as columns_lib
from reverb_shm._internal._lib import check, ffi, lib
from reverb_shm.bridge import direct_port, security, wire, zmq_client
from reverb_shm.shared_table import SharedTable

__all__ = ["Bridge", "BridgeConfig"]

_log = logging.getLogger(__name__)

# Server-side slice of blocking table calls, so cancellation is noticed within it.
_SLICE_MS = 100
_MAX_CREDIT = 1024
_MAX_KEYS = 1 << 20
_MAX_ITEMS_PER_OP = 1 << 16
_MAX_OPS_PER_MESSAGE = 1 << 16
_MAX_COLUMNS = 4096
_MAX_SLICES = 1 << 16
_MAX_CHUNK_ROWS = 1 << 31
_ACK_ITEMS = 512          # a Write stream's items are confirmed at least every _ACK_ITEMS items
_ACK_DELAY_S = 0.02       # ... and within _ACK_DELAY_S
_REPLY_BYTES = 4 << 20    # a Sample reply's column bytes, roughly at most
_MAX_SAMPLE_GROUPS = 16   # layouts gathered per Sample reply (items of more: one by one)
_MAX_LAYOUTS = 256        # cached step layouts (cleared when full)
_MAX_OPEN_SETS = 8        # step layouts holding open chunks at once (the least recent released)

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
    max_concurrent_rpcs: open RPCs (each remote writer and sampler holds one, and each remote
      client one Insert stream per thread inserting at once); more get RESOURCE_EXHAUSTED
      instead of waiting. Open streams cost no thread: only calls waiting for a rate limiter
      use one of the bridge's pool (at most this many).
  """
  port: int = 0
  host: str = "127.0.0.1"
  token: Optional[str] = None
  tls: Optional[security.ServerTLS] = None
  max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
  max_stream_chunks: int = 1 << 16
  max_concurrent_rpcs: int = 1024


class _Blocking:
  """Yielded by a request handler generator: `fn()` may wait (a rate limiter), so the event
  loop runs it on the bridge's thread pool and sends its result (or throws its exception)
  back into the generator."""

  __slots__ = ("fn",)

  def __init__(self, fn):
    self.fn = fn


class Bridge:
  """Serves the tables of local server `server` (a name or a Server) over gRPC.

  The gRPC server is asynchronous (grpc.aio) and runs an event loop on a thread of its own:
  requests are decoded, validated and applied on that loop, without a thread handoff per
  message; only table calls that must wait for a rate limiter run on a thread pool.

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
    self._layouts: Dict[tuple, _StepLayout] = {}
    # The step layouts, their open chunks and the one-call insert's buffers are used by the
    # event loop and by the direct port's connection threads: under this lock.
    self._step_lock = threading.RLock()
    self._step_buffers = (ffi.new("uint64_t[1]"), ffi.new("double[1]"))
    # ("cols" of a step op, its _StepLayout) of the last step op
    self._last_step_layout: Tuple[Any, Any] = (None, None)
    # _OpenRows holding chunks (<= _MAX_OPEN_SETS)
    self._open_sets: collections.OrderedDict = collections.OrderedDict()
    self._acks: Dict[int, bytes] = {}
    self._item_bytes: Dict[str, int] = {}   # table -> bytes of a sample in the last reply
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=config.max_concurrent_rpcs, thread_name_prefix="reverb_shm-bridge")
    self._loop = asyncio.new_event_loop()
    self._stopped = False
    started: concurrent.futures.Future = concurrent.futures.Future()
    self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True,
                                    name="reverb_shm-bridge-loop")
    self._thread.start()
    try:
      self._port = started.result(timeout=30)
    except BaseException:
      self._thread.join(timeout=5)
      self._pool.shutdown(wait=False)
      raise

  # ---- the event loop's thread
  def _serve(self, started: concurrent.futures.Future) -> None:
    asyncio.set_event_loop(self._loop)
    try:
      self._loop.run_until_complete(self._main(started))
    except BaseException as e:  # pylint: disable=broad-except  (reported to __init__)
      if not started.done():
        started.set_exception(e)
    finally:
      pending = asyncio.all_tasks(self._loop)
      if pending:   # RPC tasks end by themselves once the server stopped; cancel stragglers only
        _, pending = self._loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
      for task in pending:
        task.cancel()
      if pending:
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
      self._loop.close()

  async def _main(self, started: concurrent.futures.Future) -> None:
    config = self._config
    self._stop_request: asyncio.Queue = asyncio.Queue()   # stop(grace) puts the grace period
    self._grpc = grpc.aio.server(
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        options=[("grpc.so_reuseport", 0),
                 # Accept the remote clients' keepalive pings (every 10 s, also when idle)
                 # instead of answering them with GOAWAY "too_many_pings".
                 ("grpc.keepalive_permit_without_calls", 1),
                 ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                 ("grpc.http2.max_ping_strikes", 0)])
    handlers = {
        "ServerInfo": grpc.unary_unary_rpc_method_handler(self._server_info),
        "Mutate": grpc.unary_unary_rpc_method_handler(self._mutate),
        "Reset": grpc.unary_unary_rpc_method_handler(self._reset),
        "Checkpoint": grpc.unary_unary_rpc_method_handler(self._checkpoint),
        "Insert": grpc.stream_stream_rpc_method_handler(self._insert),
        "Sample": grpc.stream_stream_rpc_method_handler(self._sample),
        "SampleBatch": grpc.unary_unary_rpc_method_handler(self._sample_batch),
        "SampleBatches": grpc.stream_stream_rpc_method_handler(self._sample_batches),
        "Write": grpc.stream_stream_rpc_method_handler(self._write),
    }
    self._grpc.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(wire.SERVICE, handlers),))
    target = f"[{config.host}]:{config.port}" if ":" in config.host else \
        f"{config.host}:{config.port}"
    try:
      if config.tls is not None:
        port = self._grpc.add_secure_port(target, config.tls.credentials())
      else:
        port = self._grpc.add_insecure_port(target)
    except RuntimeError as e:
      raise ValueError(f"Failed to bind bridge to {target}: {e}") from None
    if not port:
      raise ValueError(f"Failed to bind bridge to {target}")
    await self._grpc.start()
    self._zmq = None
    if config.tls is None and zmq_client.AVAILABLE:   # (no TLS on ZeroMQ: offered without it)
      from reverb_shm.bridge import zmq_port  # pylint: disable=g-import-not-at-top
      self._zmq = zmq_port.ZmqPort(
          config.host, config.token, config.max_message_bytes,
          {"Write": self._write, "Sample": self._sample, "SampleBatches": self._sample_batches,
           "Insert": self._insert},
          lambda msg: self._step_at_once(msg), lambda seq: self._ack_frame(seq)[1:],
          self._insert_general)
    self._direct = None
    if config.tls is None:   # (plain TCP: offered without TLS only, as the ZeroMQ port)
      self._direct = direct_port.DirectPort(
          config.host, config.token, config.max_message_bytes, config.max_concurrent_rpcs,
          self._direct_insert)
    started.set_result(port)
    grace = await self._stop_request.get()
    if self._direct is not None:
      self._direct.close()
    if self._zmq is not None:
      self._zmq.close()
    await self._grpc.stop(grace)

  @property
  def port(self) -> int:
    return self._port

  @property
  def address(self) -> str:
    host = self._config.host
    return f"[{host}]:{self._port}" if ":" in host else f"{host}:{self._port}"

  def stop(self, grace: Optional[float] = 0.1) -> None:
    """Stops serving (open streams are cancelled after `grace` seconds). Idempotent."""
    if self._stopped:
      return
    self._stopped = True
    try:
      self._loop.call_soon_threadsafe(self._stop_request.put_nowait, grace)
    except RuntimeError:
      pass   # the loop ended already
    self._thread.join(timeout=(grace or 0) + 5)
    self._pool.shutdown(wait=False, cancel_futures=True)
    if not self._thread.is_alive():   # (else the loop may use them: freed when this process ends)
      self._release_layouts()

  def wait(self) -> None:
    """Blocks until the bridge stops (Ctrl-C stops it)."""
    try:
      while self._thread.is_alive():
        self._thread.join(0.5)
    except KeyboardInterrupt:
      self.stop()
      raise

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()

  # ---- helpers
  def _column_writer(self, cols) -> "_StepLayout":
    """The cached _StepLayout of a "step" op's [[dtype, shape], ...] (validated once)."""
    with self._step_lock:
      return self._column_writer_locked(cols)

  def _column_writer_locked(self, cols) -> "_StepLayout":
    try:
      key = tuple((d, tuple(s)) for d, s in cols)
      layout = self._layouts.get(key)
    except (TypeError, ValueError):   # not a list of pairs, or unhashable parts
      raise wire.BadMessage("step cols must be [[dtype, shape], ...]") from None
    if layout is None:
      if not isinstance(cols, list) or not 1 <= len(cols) <= 64:
        raise wire.BadMessage("step cols must list 1..64 columns")
      layout = _StepLayout([(wire.check_dtype(d, "step column"),
                             wire.check_shape(list(s) if isinstance(s, (list, tuple)) else s,
                                              "step column")) for d, s in key], self._seg,
                           self._open_sets)
      if len(self._layouts) >= _MAX_LAYOUTS:
        self._release_layouts()
      self._layouts[key] = layout
    return layout

  def _release_layouts(self) -> None:
    """Forgets the cached step layouts, releasing the chunks they hold open."""
    with self._step_lock:
      layouts, self._layouts = self._layouts, {}
      self._last_step_layout = (None, None)
      for layout in layouts.values():
        if layout.open_rows is not None:
          layout.open_rows.release()

  def _table(self, name: str) -> SharedTable:
    st = self._tables.get(name)
    if st is None:
      st = SharedTable(self._seg, self._seg.table_index(name))
      self._tables[name] = st
    return st

  async def _authorize(self, context) -> None:
    if not security.token_ok(self._config.token, context.invocation_metadata()):
      await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong auth token (metadata 'authorization: Bearer TOKEN')")

  @staticmethod
  async def _fail(context, exc: BaseException):
    """Ends the call with the status of `exc` (raises)."""
    if isinstance(exc, NotImplementedError):
      await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
    name = wire.error_name(exc)
    code = _STATUS.get(name, grpc.StatusCode.INTERNAL)
    if code is grpc.StatusCode.INTERNAL:
      _log.error("bridge: unexpected error", exc_info=exc)
    await context.abort(code, str(exc) or type(exc).__name__,
                        trailing_metadata=(("rs-error", name),))

  @contextlib.asynccontextmanager
  async def _streaming(self, context):
    """Body of a streaming call: authorizes it, yields a threading.Event set once the call
    ended (for waits on the thread pool), and ends the call with the status of an exception
    raised in the body (a cancelled call just ends: nobody awaits its status)."""
    await self._authorize(context)
    ended = threading.Event()
    try:
      yield ended
    except asyncio.CancelledError:
      pass
    except Exception as e:  # pylint: disable=broad-except  (mapped to a status)
      await self._fail(context, e)
    finally:
      ended.set()

  async def _drive(self, gen, emit=None):
    """Runs a handler generator: yielded dicts go to `emit` (an async callable; dropped when
    None), yielded _Blocking calls run on the thread pool. Returns the generator's value."""
    loop = asyncio.get_running_loop()
    value, exc = None, None
    while True:
      try:
        out = gen.throw(exc) if exc is not None else gen.send(value)
      except StopIteration as stop:
        return stop.value
      value = exc = None
      if isinstance(out, _Blocking):
        try:
          value = await loop.run_in_executor(self._pool, out.fn)
        except Exception as e:  # pylint: disable=broad-except  (handled by the generator)
          exc = e
      elif emit is not None:
        await emit(out)

  async def _unary(self, request: bytes, context, body, blocking: bool = False):
    await self._authorize(context)
    try:
      msg = wire.unpack(request, 1 << 22)
      if blocking:
        reply = await asyncio.get_running_loop().run_in_executor(self._pool, body, msg)
      else:
        reply = body(msg)
      return wire.pack(reply)
    except Exception as e:  # pylint: disable=broad-except  (mapped to a status)
      await self._fail(context, e)

  # ---- unary RPCs
  async def _server_info(self, request, context):
    def body(msg):
      wire.no_fields(msg, "ServerInfo")
      tables = []
      for index, name in enumerate(self._seg.table_names()):
        st = self._table(name)
        tables.append({"name": name, "stats": self._seg.stats(index),
                       "signature": specs.encode_signature(st.signature)})
      out = {"tables": tables}
      if self._zmq is not None:
        out["zmq_port"] = self._zmq.port
      if self._direct is not None:
        out["direct_port"] = self._direct.port
      if self._zmq is not None or self._direct is not None:
        out["max_message_bytes"] = self._config.max_message_bytes
      return out
    return await self._unary(request, context, body)

  async def _mutate(self, request, context):
    def body(msg):
      st = self._table(wire.get_str(msg, "table"))
      keys = wire.u64_array(msg, "upd_keys", _MAX_KEYS)
      prios = wire.f64_array(msg, "upd_prios", len(keys))
      dels = wire.u64_array(msg, "del_keys", _MAX_KEYS)
      updated, deleted = st.mutate(dict(zip(keys.tolist(), prios.tolist())), dels.tolist())
      return {"updated": updated, "deleted": deleted}
    return await self._unary(request, context, body)

  async def _reset(self, request, context):
    def body(msg):
      self._table(wire.get_str(msg, "table")).reset()
      return {}
    return await self._unary(request, context, body)

  async def _checkpoint(self, request, context):
    def body(msg):
      wire.no_fields(msg, "Checkpoint")
      from reverb_shm.client import Client  # pylint: disable=g-import-not-at-top
      return {"path": Client(f"shm://{self._seg.name}").checkpoint()}
    return await self._unary(request, context, body, blocking=True)

  @staticmethod
  async def _write_msg(context, msg: dict) -> None:
    for frame in wire.frames(wire.pack(msg)):
      await context.write(frame)

  # ---- inserting (Client.insert)
  async def _insert(self, request_iterator, context):
    """A remote client's insert stream: each logical message holds the ops of one
    Client.insert (ids and seqs local to it) and gets one ack once they were handled."""
    async with self._streaming(context) as cancelled:
      async for msg in _messages(context, self._config.max_message_bytes):
        seq = self._step_at_once(msg)
        if seq is not None:
          await context.write(self._ack_frame(seq))
          continue
        await self._write_msg(context, await self._insert_general(msg, cancelled))

  async def _insert_general(self, msg: dict, cancelled: threading.Event) -> dict:
    """The ack of one Insert message, through the Write stream's general path (validation,
    waits for the rate limiters until `cancelled`, errors per item)."""
    stream = _WriteStream(self, cancelled, lambda: False)
    try:
      await self._drive(stream.handle_message(msg))   # nobody to send early acks to
      return stream.ack() or {"upto": 0, "errs": []}
    finally:
      stream.close()

  def _step_at_once(self, msg: dict) -> Optional[int]:
    """Client.insert's common message inserted with one C call: {"ops": [a "step" op]} with one
    item for a table opened and checked against the step's columns before (see
    _WriteStream._step), whose rate limiter admits it at once. Returns the item's seq.

    Returns None, having changed nothing, for anything else (another message, an invalid or
    unusual field, a full arena, a limiter that holds the item back, a bridge stopping: its
    open chunks are released once it stopped): the general path then
    validates, waits and reports errors exactly as before. Thread-safe.
    """
    with self._step_lock:
      return self._step_at_once_locked(msg)

  def _step_at_once_locked(self, msg: dict) -> Optional[int]:
    ops = msg.get("ops")
    if self._stopped or len(msg) != 1 or type(ops) is not list or len(ops) != 1:
      return None
    op = ops[0]
    if type(op) is not dict or op.get("op") != "step":
      return None
    entries, data, episode, timeout_ms = op.get("items"), op.get("b"), op.get("ep"), \
        op.get("timeout_ms")
    if (type(entries) is not list or len(entries) != 1 or type(entries[0]) is not list
        or len(entries[0]) != 4 or type(data) is not bytes or type(episode) is not int
        or not 0 <= episode < 2**64 or timeout_ms is not None and (
            type(timeout_ms) is not int or not 0 <= timeout_ms <= 2**62)):
      return None
    seq, table, key, prio = entries[0]
    if (type(seq) is not int or type(table) is not str or type(key) is not int
        or type(prio) is not float or not 0 <= seq < 2**63 or not 0 <= key < 2**64
        or not math.isfinite(prio)):
      return None
    st = self._tables.get(table)
    cols = op.get("cols")
    last_cols, layout = self._last_step_layout
    if cols != last_cols:   # (a client sends steps of one layout, mostly)
      try:
        layout = self._column_writer_locked(cols)
      except wire.BadMessage:
        return None
      self._last_step_layout = (cols, layout)
    if (st is None or len(data) != layout.nbytes or not layout.checked(table)
        or prio < 0 and st._prioritized() or prio > st.priority_bound):  # pylint: disable=protected-access
      return None
    keys_c, prios_c = self._step_buffers
    keys_c[0], prios_c[0] = key, prio
    try:
      if layout.open_rows is not None:
        if not layout.open_rows.insert(st, keys_c, prios_c, layout.pointers(data)):
          return None
      else:
        st._insert_rows(layout.columns, 1, keys_c, prios_c, layout.pointers(data), 0, 0, 0, 0,  # pylint: disable=protected-access
                        episode_id=episode)
    except errors.ReverbError:
      return None   # nothing inserted (n = 1): the general path waits or reports the error
    return seq

  def _direct_insert(self, msg: dict, cancelled: threading.Event):
    """One message of a direct port's insert connection (on its thread): the packed ack of a
    one-call insert, else a future of the general path's ack (on the event loop)."""
    seq = self._step_at_once(msg)
    if seq is not None:
      return self._ack_frame(seq)[1:]
    return asyncio.run_coroutine_threadsafe(self._insert_general(msg, cancelled), self._loop)

  def _ack_frame(self, seq: int) -> bytes:
    """The one-frame Insert ack of items ops up to `seq`, none failed (cached)."""
    frame = self._acks.get(seq)
    if frame is None:
      if len(self._acks) >= _MAX_LAYOUTS:
        self._acks.clear()
      frame = self._acks[seq] = next(wire.frames(wire.pack({"upto": seq, "errs": []})))
    return frame

  # ---- sampling
  async def _sample(self, request_iterator, context):
    async with self._streaming(context) as cancelled:
      inbox = _Inbox(context, 1 << 16)
      try:
        msgs = await inbox.take()
        if not msgs:
          return
        first = msgs[0]
        st = self._table(wire.get_str(first, "table"))
        n = wire.get_int(first, "n", 1, 2**62)
        timeout_ms = wire.timeout_field(first)
        credit = wire.get_int(first, "credit", 1, _MAX_CREDIT)
        batch = wire.get_int(first, "batch", 1, _MAX_CREDIT, optional=True) or 1
        credit += _credits(msgs[1:])
        sent = 0
        # Bytes of one sample of the table's last reply (unknown: the first reply holds one
        # sample), so that a reply stays near _REPLY_BYTES.
        item_bytes = self._item_bytes.get(st.name, _REPLY_BYTES)
        while sent < n:
          if credit == 0:
            msgs = await inbox.take()
            if not msgs:
              return     # the client closed its side: it wants no more samples
            credit += _credits(msgs)
          k = min(credit, n - sent, batch, max(1, _REPLY_BYTES // item_bytes))
          reply = await self._sample_or_wait(st, k, timeout_ms, context, cancelled, 1)
          if reply is None:
            return     # cancelled
          await self._write_msg(context, reply)
          item_bytes = self._item_bytes[st.name] = max(1, sum(
              len(c.get("b", b"")) for part in reply.get("parts", [reply])
              for c in part.get("cols", ())) // reply["n"])
          credit -= reply["n"]
          sent += reply["n"]
          credit += _credits(await inbox.take(block=False) or ())
      finally:
        inbox.stop()

  async def _sample_batch(self, request, context):
    """Unary SampleBatch {table, n (0 .. 65536), timeout_ms}: up to n items sampled together
    (fewer when the rate limiter admits fewer before the deadline; at least one unless n is 0),
    as a Sample reply under "sample", and the table's counters after the draw (rs_table_stats:
    size, sampler_kind, sampler_total_weight, ...) under "stats". One round trip per batch:
    what a learner sampling across hosts uses (reverb_shm.ray)."""
    await self._authorize(context)
    try:
      msg = wire.unpack(request, 1 << 16)
      st = self._table(wire.get_str(msg, "table"))
      n = wire.get_int(msg, "n", 0, 1 << 16)
      timeout_ms = wire.timeout_field(msg)
      reply = {}
      if n:
        ended = threading.Event()
        context.add_done_callback(lambda _: ended.set())
        reply["sample"] = await self._sample_or_wait(st, n, timeout_ms, context, ended, n)
        if reply["sample"] is None:
          return None   # the call was cancelled
      reply["stats"] = st.stats()
      return wire.pack(reply)
    except Exception as e:  # pylint: disable=broad-except  (mapped to a status)
      await self._fail(context, e)

  async def _sample_batches(self, request_iterator, context):
    """Stream SampleBatches: every request message {table, n (0 .. 65536), timeout_ms} gets one
    reply, in order: SampleBatch's reply, or {"err": [error class name, message]} when that
    request failed (the stream goes on). A client keeps one such stream per bridge, so a batch
    costs one message each way (no call setup), and it may send requests ahead of replies."""
    async with self._streaming(context) as ended:
      async for msg in _messages(context, 1 << 16):
        try:
          st = self._table(wire.get_str(msg, "table"))
          n = wire.get_int(msg, "n", 0, 1 << 16)
          timeout_ms = wire.timeout_field(msg)
          reply = {}
          if n:
            reply["sample"] = await self._sample_or_wait(st, n, timeout_ms, context, ended, n)
            if reply["sample"] is None:
              return   # the call was cancelled
          reply["stats"] = st.stats()
        except (errors.ReverbError, ValueError) as e:
          reply = {"err": [wire.error_name(e), str(e) or type(e).__name__]}
        await self._write_msg(context, reply)

  async def _sample_or_wait(self, st: SharedTable, k: int, timeout_ms: Optional[int], context,
                            cancelled: threading.Event, wait_k: int) -> Optional[dict]:
    """The reply of up to k samples the limiter admits now, else (on the thread pool) of up to
    wait_k, at least one, waiting until timeout_ms or the call's deadline; None once
    `cancelled`."""
    reply = self._sample_now(st, k)
    if reply is not None:
      return reply
    deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
    remaining_call = context.time_remaining()
    if remaining_call is not None:
      call_deadline = time.monotonic() + remaining_call
      deadline = call_deadline if deadline is None else min(deadline, call_deadline)
    got = await asyncio.get_running_loop().run_in_executor(
        self._pool, self._sample_wait, st, timeout_ms, deadline, cancelled, wait_k)
    return None if got is None else self._encode_samples(*got)

  def _sample_now(self, st: SharedTable, k: int) -> Optional[dict]:
    """The reply of up to k samples the limiter admits at once, or None.

    Once the table's column layout is known (learnt from a reply of one layout), the items are
    sampled and gathered by one C call; an item of another layout ends that gather, and the
    rest of the k are sampled and encoded layout by layout (the reply then has parts)."""
    try:
      gathered = st.gather_admitted(k)
    except errors.DeadlineExceededError:
      return None
    first = None
    if gathered is not None:
      info, cols = gathered
      first = _gathered_reply(info, cols) if len(info.key) else None
      if st.gather_layout_known() or (first is not None and first["n"] == k):
        return first   # (fewer than k: what the limiter admits now)
    rest = k - (0 if first is None else first["n"])
    try:
      recs, pins = st.sample_records(rest, 0)
    except errors.DeadlineExceededError:
      return first
    reply = self._encode_samples(recs, pins)
    if "cols" in reply:   # one layout without objects: gathered in C from now on
      st.learn_layout([(c["d"], c["s"][1:]) for c in reply["cols"]])
    return reply if first is None else _joined_replies(first, reply)

  @staticmethod
  def _sample_wait(st: SharedTable, timeout_ms: Optional[int], deadline: Optional[float],
                   cancelled: threading.Event, k: int = 1):
    """(records, pins) of up to k samples (at least one), waiting for them in slices (runs on
    the thread pool); None once `cancelled` is set.

    Raises:
      DeadlineExceededError: nothing to sample by `deadline` (monotonic seconds).
    """
    while True:
      if cancelled.is_set():
        return None
      wait_ms = _SLICE_MS
      if deadline is not None:
        wait_ms = max(0, min(_SLICE_MS, int((deadline - time.monotonic()) * 1000)))
      try:
        return st.sample_records(k, wait_ms)
      except errors.DeadlineExceededError:
        if deadline is not None and time.monotonic() >= deadline:
          raise errors.DeadlineExceededError(
              st.limiter_message("sample", timeout_ms)) from None

  def _encode_samples(self, recs, pins) -> dict:
    """The wire map of sampled records (their pins are released: the columns are copies).

    Items are grouped by column layout (one C call); each group's columns are gathered into
    one array per column by one C call each. A batch of one layout is one reply; else the
    reply is {"n", "parts": [...]}, each part holding its samples' positions ("pos", uint32).
    Items of object columns are encoded one by one.
    """
    try:
      desc = np.ascontiguousarray(recs["desc_off"], np.uint64)
      n = len(desc)
      groups = np.empty(n, np.uint32)
      ngroups = ffi.new("uint32_t *")
      check(lib.rs_group_layouts(self._seg.base, n, ffi.from_buffer("uint64_t[]", desc),
                                 _MAX_SAMPLE_GROUPS, ffi.from_buffer("uint32_t[]", groups),
                                 ngroups), "grouping sampled items")
      if ngroups[0] == 1 and not groups.any():
        return self._sample_part(recs, desc, None)
      parts = [self._sample_part(recs, desc, np.flatnonzero(groups == g))
               for g in range(ngroups[0])]
      odd = np.flatnonzero(groups == np.uint32(0xFFFFFFFF))
      if len(odd):
        parts.append(self._sample_part(recs, desc, odd, pins))
      return {"n": n, "parts": parts}
    finally:
      pins.release()

  def _sample_part(self, recs, desc, idx, pins=None) -> dict:
    """Reply map of the sampled items `idx` (None: all) of one layout, gathered per column;
    with `pins`, of items encoded one by one instead (object columns)."""
    if idx is not None:
      recs, desc = recs[idx], desc[idx]
    part = _info_part([recs[field] for field, _, _ in _INFO_FIELDS])
    if idx is not None:
      part["pos"] = idx.astype("<u4").tobytes()
    if pins is None:
      ncols = len(chunks.item_columns(self._seg, int(desc[0])))
      part["cols"] = [wire.encode_array(chunks.gather_column(self._seg, desc, c))
                      for c in range(ncols)]
    else:
      items = chunks.read_items(self._seg, desc, pins)
      part["items"] = [[_encode_column(c) for c in item] for item in items]
    return part

  # ---- writing
  async def _write(self, request_iterator, context):
    async with self._streaming(context) as cancelled:
      inbox = _Inbox(context, self._config.max_message_bytes)
      stream = _WriteStream(self, cancelled, lambda: inbox.closed)
      emit = functools.partial(self._write_msg, context)
      try:
        loop = asyncio.get_running_loop()
        last_ack = loop.time()
        while True:
          msgs = await inbox.take(timeout=_ACK_DELAY_S if stream.has_ack else None)
          for msg in msgs or ():
            await self._drive(stream.handle_message(msg), emit)
          # Acks go out when asked for, every _ACK_ITEMS items or _ACK_DELAY_S, and at the end.
          if (msgs is None or inbox.closed or stream.wants_ack or
              stream.has_ack and loop.time() - last_ack >= _ACK_DELAY_S):
            ack = stream.ack()
            if ack is not None:
              await emit(ack)
              last_ack = loop.time()
          if msgs is None:
            return
      finally:
        inbox.stop()
        stream.close()


# Sample reply fields: SAMPLE_REC field, wire key, wire dtype (raw arrays of n values).
_INFO_FIELDS = (("key", "keys", "<u8"), ("probability", "probs", "<f8"),
                ("table_size", "sizes", "<i8"), ("priority", "prios", "<f8"),
                ("times_sampled", "times", "<i8"))


def _info_part(fields) -> Dict[str, Any]:
  """The reply map {"n", "keys", "probs", ...} of the info `fields` (arrays of n values, in
  _INFO_FIELDS order)."""
  part: Dict[str, Any] = {"n": len(fields[0])}
  for value, (_, key, dtype) in zip(fields, _INFO_FIELDS):
    part[key] = np.ascontiguousarray(value, dtype).tobytes()
  return part


def _gathered_reply(info, cols) -> dict:
  """The reply of items gathered in C: SampleInfo of arrays and their (B, ...) columns."""
  part = _info_part(list(info))
  part["cols"] = [wire.encode_array(c) for c in cols]
  return part


def _joined_replies(first: dict, rest: dict) -> dict:
  """One reply {"n", "parts"} of a one-layout reply `first` followed by the reply `rest`."""
  b = first["n"]
  parts = [dict(first, pos=np.arange(b, dtype="<u4").tobytes())]
  for part in rest.get("parts", [rest]):
    pos = (np.frombuffer(part["pos"], "<u4") if "pos" in part else
           np.arange(part["n"], dtype="<u4"))
    parts.append(dict(part, pos=(pos + b).astype("<u4").tobytes()))
  return {"n": b + rest["n"], "parts": parts}


def _credits(msgs) -> int:
  total = 0
  for m in msgs:
    total += wire.get_int(m, "credit", 1, _MAX_CREDIT)
  return total


def _encode_column(col: np.ndarray) -> dict:
  if col.dtype.kind == "O":
    flat = [x.item() if isinstance(x, np.generic) else x for x in col.reshape(-1)]
    return {"o": flat, "s": list(col.shape)}
  return wire.encode_array(col)


async def _messages(context, max_bytes: int):
  """The logical messages of a client stream, until the client half-closes it."""
  asm = wire.Reassembler(max_bytes)
  while True:
    frame = await context.read()
    if frame is grpc.aio.EOF:
      return
    msg = asm.feed(frame)
    if msg is not None:
      yield msg


class _Inbox:
  """Logical messages of a client stream, read by a task of their own on the event loop.

  The handler takes every message that has arrived at once (so it can answer a burst with one
  reply) and learns when the client closed its side (`closed`) while it is busy.
  """

  _MAX_QUEUED_BYTES = 64 << 20

  def __init__(self, context, max_bytes: int):
    self._context = context
    self._asm = wire.Reassembler(max_bytes)
    self._cond = asyncio.Condition()
    self._msgs: list = []
    self._queued_bytes = 0
    self._error: Optional[BaseException] = None
    self.closed = False   # the client half-closed its side, or the call ended
    self._task = asyncio.ensure_future(self._run())

  async def _run(self) -> None:
    error: Optional[BaseException] = None
    size = 0
    try:
      while True:
        frame = await self._context.read()
        if frame is grpc.aio.EOF:
          break
        size += len(frame)
        msg = self._asm.feed(frame)
        if msg is None:
          continue
        async with self._cond:
          # back-pressure: the handler is behind
          await self._cond.wait_for(lambda: self._queued_bytes <= self._MAX_QUEUED_BYTES)
          self._msgs.append(msg)
          self._queued_bytes += size
          self._cond.notify_all()
        size = 0
    except wire.BadMessage as e:
      error = e
    except asyncio.CancelledError:
      pass
    except Exception:  # pylint: disable=broad-except  (the call ended)
      pass
    self._error, self.closed = error, True
    async with self._cond:
      self._cond.notify_all()

  async def take(self, block: bool = True, timeout: Optional[float] = None) -> Optional[list]:
    """Every message received so far (waiting for one if `block`, up to `timeout` seconds if
    given: [] when none came); None at the end.

    Raises:
      BadMessage: the client sent a malformed frame (after the messages before it).
    """
    async with self._cond:
      if block:
        ready = self._cond.wait_for(lambda: self._msgs or self.closed)
        if timeout is None:
          await ready
        else:
          try:
            await asyncio.wait_for(ready, timeout)
          except asyncio.TimeoutError:
            return []
      msgs, self._msgs, self._queued_bytes = self._msgs, [], 0
      self._cond.notify_all()
      if not msgs and self._error is not None:
        raise self._error
      return msgs or None

  def stop(self) -> None:
    self._task.cancel()


class _StepLayout:
  """The columns of "step" ops of one layout: their ColumnWriter, byte ranges in the op's data,
  and the tables whose signature they were checked against."""

  def __init__(self, columns, seg: shm.Segment, held: "collections.OrderedDict"):
    self.columns = chunks.ColumnWriter(columns)
    capacity = hot_plans.open_rows(columns)
    self.open_rows = _OpenRows(seg, self.columns, capacity, held) if capacity else None
    self.bounds, start = [], 0
    for dtype, shape in columns:
      end = start + dtype.itemsize * math.prod(shape)
      self.bounds.append((start, end))
      start = end
    self.nbytes = start
    self._specs = [(dtype, (1,) + shape) for dtype, shape in columns]
    self._checked: set = set()

  def checked(self, table: str) -> bool:
    """Whether `check` passed for `table`."""
    return table in self._checked

  def pointers(self, data: bytes) -> list:
    """uint8_t * to each column's bytes in a step op's `data` (nbytes long; the pointers are
    valid while `data` lives)."""
    base = ffi.from_buffer("uint8_t[]", data)
    return [base + a for a, _ in self.bounds]

  def check(self, table: str, st: SharedTable) -> None:
    """ValueError unless the columns match `table`'s signature (checked once per table)."""
    if table not in self._checked:
      signature = st.signature
      if signature is not None:
        columns_lib.check_signature(table, structure.flatten(signature)[0], self._specs,
                           allow_unbatched=True)
      self._checked.add(table)


class _OpenRows:
  """Chunks held open for the one-call inserts of one step layout, as a local Client.insert's
  plan holds them (hot_plans): each step is appended as the next row (rs_insert_rows_at, with
  the client's key) instead of getting chunks of its own, so an item costs its row's bytes plus
  a few. A full set is released (its pins dropped) and a new one opened; the chunks get a random
  episode id with one episode per row (RS_ROWS_RANDOM_EPISODE), as a local Client.insert's.
  Used under the bridge's step lock; `release` when the bridge stops or forgets the layout.
  """

  def __init__(self, seg: shm.Segment, columns: chunks.ColumnWriter, capacity: int,
               held: "collections.OrderedDict"):
    self._seg, self._columns, self._capacity = seg, columns, capacity
    self._held = held           # the bridge's open sets, least recently opened first
    self._offs = ffi.new("uint64_t[]", columns.ncols)
    self._pins = ffi.new("uint32_t[]", columns.ncols)
    self._done = ffi.new("uint32_t *")
    self._row = 0
    # the segment registration the open set was taken under
    self._registration: Optional[Tuple[int, int, int]] = None
    self._release = None        # releases the open set (hot_plans.open_release)

  def insert(self, st: SharedTable, keys_c, prios_c, pointers: list) -> bool:
    """Appends one step (`pointers`: one row per column) and inserts it as one item (key
    keys_c[0], priority prios_c[0]) if the rate limiter admits it at once. Returns False
    otherwise, having inserted nothing (its row stays unused: the caller inserts it another
    way).

    Raises:
      ReverbError: the segment is closed, or no chunks could be opened (arena full).
    """
    seg = self._seg
    slot, _ = seg.registration()
    if self._release is None or self._row >= self._capacity or \
        seg._registration is not self._registration:  # pylint: disable=protected-access
      self._open(slot)
    row, self._row = self._row, self._row + 1
    columns = self._columns
    rc = lib.rs_insert_rows_at(seg.base, slot, st.index, 1, keys_c, prios_c, columns.ncols,
                               self._offs, row, pointers, columns.squeeze_flags[0], 0, 0,
                               timeouts.SLICE_NS, self._done)
    return rc == lib.RS_OK

  def _open(self, slot: int) -> None:
    self.release()
    seg, columns = self._seg, self._columns
    check(lib.rs_open_chunks(seg.base, slot, columns.ncols, columns.metas, self._capacity, 0,
                             lib.RS_ROWS_RANDOM_EPISODE, self._offs, self._pins),
          "opening chunks for the bridge's inserts" + seg.arena_hint)
    registration = self._registration = seg._registration  # pylint: disable=protected-access
    assert registration is not None   # (rs_open_chunks above needed a registered slot)
    self._release = hot_plans.open_release(seg, registration)
    self._row = 0
    self._held[id(self)] = self
    while len(self._held) > _MAX_OPEN_SETS:   # bound what the open sets hold of the arena
      next(iter(self._held.values())).release()

  def release(self) -> None:
    """Releases the open set (shrunk to the rows used), if any."""
    release, self._release = self._release, None
    self._held.pop(id(self), None)
    if release is not None:
      n = self._columns.ncols
      release(tuple(self._offs[0:n]), tuple(self._pins[0:n]), self._row, self._capacity)


class _Failed(NamedTuple):
  """An item op (or an item of an "itemrun" op) that cannot be inserted: its seq and why."""
  seq: int
  error: Exception


class _WriteStream:
  """State of one Write stream: the chunks it wrote, by the client's chunk ids, and the
  outcome of the "items" ops since the last acknowledgement."""

  def __init__(self, bridge: Bridge, cancelled: threading.Event, closing):
    self._bridge = bridge
    self._seg = bridge._seg  # pylint: disable=protected-access
    self._cancelled = cancelled   # set when the call ended
    self._closing = closing   # () -> whether the client closed its side
    self._max_chunks = bridge._config.max_stream_chunks  # pylint: disable=protected-access
    self._chunks: Dict[int, chunks.Chunk] = {}
    self._failed: Dict[int, BaseException] = {}
    self._upto: Optional[int] = None   # seq of the last "items" op handled since the last ack
    self._errs: list = []         # [seq, inserted, error class, message] of failed ones
    self._unacked = 0       # items handled since the last ack
    self._sync = False      # the client waits for an ack ("sync" op)

  @property
  def has_ack(self) -> bool:
    """Whether items were handled since the last ack."""
    return self._upto is not None

  @property
  def wants_ack(self) -> bool:
    """Whether the ack is due: the client asked for it, or _ACK_ITEMS items wait for it."""
    return self._upto is not None and (self._sync or self._unacked >= _ACK_ITEMS)

  def handle_message(self, msg: dict):
    """Handles one logical message: an op, or {"ops": [op, ...]} in order.

    Yields the acks that must go out before an insert that waits for its rate limiter, and
    the _Blocking waits of such inserts (see Bridge._drive).
    """
    ops = [msg] if "op" in msg else wire.get_list(msg, "ops", _MAX_OPS_PER_MESSAGE)
    run: list = []   # prepared items ops of one table, inserted together (see _items_run)
    for op in ops:
      if not isinstance(op, dict):
        raise wire.BadMessage(f"Write ops must be maps, got {type(op).__name__}")
      kind = wire.get_str(op, "op")
      if kind == "items" or kind == "itemrun":
        for prepared in ((self._prepare_items(op),) if kind == "items" else
                         self._prepare_run(op)):
          failed = type(prepared) is _Failed
          if run and (failed or prepared[1] is not run[0][1] or prepared[5] is not None):
            yield from self._items_run(run)   # (before a failure: acks stay in seq order)
            run = []
          if failed:
            self._upto = prepared.seq
            self._errs.append([prepared.seq, 0, wire.error_name(prepared.error),
                               str(prepared.error)])
          elif prepared[5] is None:
            run.append(prepared)
          else:
            yield from self._items(prepared)
        continue
      if kind in ("drop", "step") and run:   # a drop may release chunks of the run's items
        yield from self._items_run(run)
        run = []
      if kind == "step":
        yield from self._step(op)
      else:
        self.handle(op)
    if run:
      yield from self._items_run(run)

  def ack(self) -> Optional[dict]:
    """{"upto": seq, "errs": [...]} for the items ops handled since the last ack, or None.

    Every items op up to seq `upto` was handled; those not in `errs` were inserted fully.
    """
    if self._upto is None:
      return None
    ack = {"upto": self._upto, "errs": self._errs}
    self._upto, self._errs, self._unacked, self._sync = None, [], 0, False
    return ack

  def close(self) -> None:
    for chunk in self._chunks.values():
      chunk.release()
    self._chunks.clear()

  def handle(self, msg: dict) -> None:
    """Handles a chunk / rows / obj / drop / sync op."""
    op = wire.get_str(msg, "op")
    if op == "sync":
      self._sync = True
      return
    if op == "drop":
      for cid in wire.get_list(msg, "ids", self._max_chunks):
        if isinstance(cid, int) and not isinstance(cid, bool):
          self._failed.pop(cid, None)
          chunk = self._chunks.pop(cid, None)
          if chunk is not None:
            chunk.shrink()
            chunk.release()
      return
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
    if msg.get("b") is not None:      # the chunk's first rows, in the same op
      self._rows(cid, {"first": 0, "b": msg["b"], **({"n": msg["n"]} if "n" in msg else {})})

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
    # "n" rows (needed for zero-element rows, which hold no bytes), else as many as "b" holds
    k = (wire.get_int(msg, "n", 0, _MAX_CHUNK_ROWS) if "n" in msg else
         len(data) // row_bytes if row_bytes else 0)
    if first != chunk.rows or len(data) != k * row_bytes or first + k > chunk.capacity:
      raise wire.BadMessage(
          f"rows message for chunk {cid} does not fit: first row {first} (expected "
          f"{chunk.rows}), {k} rows in {len(data)} bytes of {row_bytes}-byte rows, capacity "
          f"{chunk.capacity}")
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

  def _prepare_items(self, msg: dict):
    """(seq, table, keys, priorities, descriptors, timeout_ms) of a validated "items" op, or
    its _Failed (BadMessage propagates)."""
    seq = wire.get_int(msg, "seq", 0, 2**63)
    try:
      st, keys, prios, descs = self._items_fields(msg)
      timeout_ms = wire.timeout_field(msg)
      return seq, st, keys, prios, [self._descriptor(d) for d in descs], timeout_ms
    except wire.BadMessage:
      raise
    except (errors.ReverbError, ValueError, TypeError) as e:
      return _Failed(seq, e)

  def _prepare_run(self, msg: dict):
    """The prepared items (as _prepare_items', one item each) of an "itemrun" op, or the
    _Failed of each item that cannot be inserted, in order (BadMessage propagates).

    {"op": "itemrun", "seq", "table", "keys", "prios", "descs"}: n items of one table with no
    timeout, as n "items" ops of one item whose seqs are seq, seq + 1, ... (each confirmed on
    its own) in one op: validated once, not per item.
    """
    seq = wire.get_int(msg, "seq", 0, 2**63 - _MAX_ITEMS_PER_OP)
    try:
      st, keys, prios, descs = self._items_fields(msg)
    except wire.BadMessage:
      raise
    except (errors.ReverbError, ValueError, TypeError) as e:
      n = len(wire.get_list(msg, "descs", _MAX_ITEMS_PER_OP))
      yield from (_Failed(seq + i, e) for i in range(n))
      return
    for i, desc in enumerate(descs):
      try:
        encoded = self._descriptor(desc)
      except wire.BadMessage:
        raise
      except (errors.ReverbError, ValueError, TypeError) as e:
        yield _Failed(seq + i, e)
        continue
      yield seq + i, st, keys[i:i + 1], prios[i:i + 1], [encoded], None

  def _items_fields(self, msg: dict) -> tuple:
    """(table, keys, priorities, descriptor list) of an "items" or "itemrun" op."""
    st = self._bridge._table(wire.get_str(msg, "table"))  # pylint: disable=protected-access
    keys = wire.u64_array(msg, "keys", _MAX_ITEMS_PER_OP)
    prios = wire.f64_array(msg, "prios", len(keys))
    descs = wire.get_list(msg, "descs", _MAX_ITEMS_PER_OP)
    if len(descs) != len(keys):
      raise wire.BadMessage(f"{len(keys)} keys for {len(descs)} item descriptors")
    return st, keys, prios, descs

  def _items(self, prepared: tuple, start: int = 0):
    """Inserts the items [start:] of a prepared "items" op; yields the pending ack first if it
    would wait."""
    seq, st, keys, prios, descs, timeout_ms = prepared
    try:
      blob, offs = chunks.join_descriptors(descs)
      if self._upto is not None and len(keys) and not st.can_insert(len(keys) - start):
        yield self.ack()   # confirm the earlier items before waiting for the limiter
      self._upto = seq
      self._unacked += len(keys) - start
      yield from self._insert(st, keys, prios, blob, offs, timeout_ms, start)
    except errors.DeadlineExceededError as e:
      self._upto = seq
      self._errs.append([seq, e.inserted, wire.error_name(e), str(e)])
    except (errors.ReverbError, ValueError, TypeError) as e:
      self._upto = seq
      self._errs.append([seq, 0, wire.error_name(e), str(e)])

  def _items_run(self, run: list):
    """Inserts consecutive prepared "items" ops of one table (no timeouts) with one call when
    the limiter admits them all at once; from the first item it holds back, op by op."""
    first = 0
    if len(run) > 1:
      st = run[0][1]
      keys = np.concatenate([p[2] for p in run])
      try:
        blob, offs = chunks.join_descriptors([d for p in run for d in p[4]])
        st.insert_descriptors(keys, np.concatenate([p[3] for p in run]), blob, offs, 0)
        done = len(keys)
      except errors.DeadlineExceededError as e:
        done = e.inserted
      except (errors.ReverbError, ValueError, TypeError):
        done = 0          # an invalid item: op by op, which reports it for its op alone
      for p in run:       # the ops inserted whole
        if done < len(p[2]):
          break
        done -= len(p[2])
        self._upto = p[0]
        self._unacked += len(p[2])
        first += 1
      if first < len(run) and done:
        yield from self._items(run[first], done)   # the rest of a partly inserted op
        first += 1
    for p in run[first:]:
      yield from self._items(p)

  def _descriptor(self, desc) -> bytes:
    """An item descriptor with stream chunk ids replaced by arena offsets (all validated)."""
    # (msgpack decodes arrays as lists and integers as int, never bool: exact type checks)
    if type(desc) is not list or not 1 <= len(desc) <= _MAX_COLUMNS:
      raise wire.BadMessage(f"an item must be a list of 1..{_MAX_COLUMNS} columns")
    columns = []
    for col in desc:
      if (type(col) is not list or len(col) != 2 or type(col[1]) is not bool
          or type(col[0]) is not list or not 1 <= len(col[0]) <= _MAX_SLICES):
        raise wire.BadMessage("an item column must be [[[chunk id, row, rows], ...], squeeze]")
      slices = []
      for sl in col[0]:
        if type(sl) is not list or len(sl) != 3:
          raise wire.BadMessage("an item slice must be [chunk id, first row, rows]")
        cid, row, nrows = sl
        if type(cid) is not int or type(row) is not int or type(nrows) is not int:
          raise wire.BadMessage("an item slice must be [chunk id, first row, rows]")
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

  def _insert(self, st: SharedTable, keys, prios, blob, offs, timeout_ms, start: int = 0):
    """Inserts the items [start:]; a generator returning n (see _insert_with)."""
    def attempt(done: int, wait_ms: int) -> None:
      start, end = int(offs[done]), int(offs[-1])
      st.insert_descriptors(keys[done:], prios[done:], blob[start:end], offs[done:] - offs[done],
                            wait_ms)
    return (yield from self._insert_with(st, len(keys), attempt, timeout_ms, start))

  def _insert_with(self, st: SharedTable, n: int, attempt, timeout_ms, start: int = 0):
    """Inserts n items by `attempt(done, wait_ms)` (inserts items [done:] waiting up to
    wait_ms, raising DeadlineExceededError with `inserted`); a generator returning n.

    The first attempt does not wait. If the limiter holds items back, the rest is inserted by
    a _Blocking call that waits in slices of _SLICE_MS (so a cancelled call stops waiting).
    Once the client closed its side, items are inserted only if the limiter admits them at
    once (as a local writer's close() does).
    """
    deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
    try:
      attempt(start, 0)
      return n
    except errors.DeadlineExceededError as e:
      done = start + e.inserted
    if self._closing() or timeout_ms == 0:
      raise self._timeout(st, n, done, timeout_ms, "")
    return (yield _Blocking(lambda: self._insert_waiting(st, n, attempt, timeout_ms, deadline,
                                                         done)))

  def _insert_waiting(self, st: SharedTable, n: int, attempt, timeout_ms,
                      deadline: Optional[float], done: int) -> int:
    """Inserts items [done:] waiting for the limiter (on the thread pool); returns n."""
    while True:
      if self._closing():
        deadline = time.monotonic()
      wait_ms = _SLICE_MS if deadline is None else max(
          0, min(_SLICE_MS, int((deadline - time.monotonic()) * 1000)))
      try:
        attempt(done, wait_ms)
        return n
      except errors.DeadlineExceededError as e:
        done += e.inserted
        expired = deadline is not None and time.monotonic() >= deadline
        if expired or self._cancelled.is_set():
          raise self._timeout(st, n, done, timeout_ms, f" ({e})") from None

  def _step(self, msg: dict):
    """A "step" op: one numeric step written as single-row chunks (one C call) and inserted as
    a one-step item into each listed table in order (Client.insert's message).

    {"op": "step", "cols": [[dtype, shape], ...], "b": the rows' bytes, column after column,
     "ep": episode id, "timeout_ms", "items": [[seq, table, key, priority], ...]}

    A failing table ends the op (the tables before it keep their item), as Client.insert.
    """
    writer = self._bridge._column_writer(msg.get("cols"))  # pylint: disable=protected-access
    data = wire.get(msg, "b", bytes)
    if len(data) != writer.nbytes:
      raise wire.BadMessage(f"step data holds {len(data)} bytes, its columns need "
                            f"{writer.nbytes}")
    episode = wire.get_int(msg, "ep", 0, 2**64 - 1)
    timeout_ms = wire.timeout_field(msg)
    entries = wire.get_list(msg, "items", _MAX_COLUMNS)
    for entry in entries:
      if (not isinstance(entry, list) or len(entry) != 4 or not isinstance(entry[1], str)
          or any(isinstance(x, bool) or not isinstance(x, int) for x in (entry[0], entry[2]))
          or not 0 <= entry[0] < 2**63 or not 0 <= entry[2] < 2**64
          or not isinstance(entry[3], (int, float)) or isinstance(entry[3], bool)):
        raise wire.BadMessage("step items must be [seq, table, key, priority]")
    if not entries:
      return
    view = memoryview(data)
    arrays = [view[a:b] for a, b in writer.bounds]
    slices = pins = None
    try:
      for seq, table, key, prio in entries:
        self._upto = seq
        try:
          if slices is None:
            offs, pins = writer.columns.write(self._seg, arrays, 1, episode)
            slices = ffi.new("rs_desc_slice[]", [(off, 0, 1) for off in offs])
          st = self._bridge._table(table)  # pylint: disable=protected-access
          yield from self._insert_step(st, writer, slices, table, key, prio, timeout_ms)
        except errors.DeadlineExceededError as e:
          self._errs.append([seq, e.inserted, wire.error_name(e), str(e)])
          return
        except (errors.ReverbError, ValueError, TypeError) as e:
          self._errs.append([seq, 0, wire.error_name(e), str(e)])
          return
    finally:
      if pins is not None:
        pins.release()

  def _insert_step(self, st: SharedTable, writer: _StepLayout, slices, table: str, key: int,
                   prio, timeout_ms):
    """Inserts the one-step item over `slices` (C rs_desc_slice[]); a generator returning 1."""
    writer.check(table, st)
    prios = st._priorities(prio, 1)  # pylint: disable=protected-access
    keys_c = ffi.new("uint64_t *", key)
    prios_c = ffi.from_buffer("double[]", prios)
    columns = writer.columns

    def attempt(done: int, wait_ms: int) -> None:
      if not done:
        st._insert_slices_validated(  # pylint: disable=protected-access
            1, keys_c, prios_c, columns, slices, 0, timeouts.deadline_from_ms(wait_ms), wait_ms)
    return (yield from self._insert_with(st, 1, attempt, timeout_ms))

  @staticmethod
  def _timeout(st: SharedTable, n: int, done: int, timeout_ms, detail: str):
    return errors.DeadlineExceededError(
        f"Rate limiter timeout on table {errors.quoted_name(st.name)}: insert blocked for "
        f"{timeout_ms} ms; "
        f"{done} of {n} items inserted{detail}", inserted=done)
