"""Pipelined inserts over a bridge's Write stream (the remote client's side).

A WriteSession (one per TrajectoryWriter) owns one Write stream. `insert` turns items whose
descriptors point into this process's staging segment into ops (each staging chunk is sent
once, its new rows as they are first needed) and hands them to the stream without waiting. Ops
queued within a few milliseconds travel together as one message. The bridge confirms the
items in batches: every 512 items or 20 ms, and at once after a "sync" op, which a caller
waiting for confirmations sends. `await_inserts` waits for confirmations (flush,
end_episode) within a deadline; `close` half-closes the stream, after which the bridge
inserts what the rate limiters admit at once, and reports items it could not insert. An
error the bridge reports for an item is raised by the session's next call.

The bytes sent for a chunk are kept while an unconfirmed item or the LRU of sent chunks
(bounded by `sent_bytes_budget`) refers to it. If the stream breaks, the session reconnects
with exponential backoff for up to `reconnect_timeout_s` and re-sends every unconfirmed item
with its chunks and original keys (re-inserting a key only updates that item's priority).
"""
import collections
import itertools
import os
import queue
import sys
import threading
import time
import warnings
from typing import Callable, NamedTuple, Optional

import grpc
import numpy as np

from reverb_shm import errors
from reverb_shm._internal import chunks
from reverb_shm.bridge import direct_client, watchdog, wire, zmq_client

__all__ = ["WriteSession"]

# A RemoteClient's streams and Client.insert use the bridge's ZeroMQ port when the bridge offers
# one (no TLS) and pyzmq is installed; REVERB_SHM_BRIDGE_ZMQ=0 (or ZMQ_ENABLED = False) keeps
# everything on gRPC.
ZMQ_ENABLED = zmq_client.AVAILABLE and os.environ.get("REVERB_SHM_BRIDGE_ZMQ", "1") != "0"
# Client.insert takes the bridge's direct port when it offers one (no TLS) and ZMQ_ENABLED
# (which says whether to leave gRPC at all); REVERB_SHM_BRIDGE_DIRECT=0 (or DIRECT_ENABLED =
# False) keeps it on the ZeroMQ port.
DIRECT_ENABLED = os.environ.get("REVERB_SHM_BRIDGE_DIRECT", "1") != "0"
StreamError = zmq_client.StreamError

BACKOFF_START_S, BACKOFF_MAX_S = 0.05, 1.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
MAX_IN_FLIGHT_ITEMS = 4096        # unconfirmed items before insert waits for confirmations
MAX_IN_FLIGHT_BYTES = 32 << 20    # chunk bytes of unconfirmed items, likewise
_CLOSE_GRACE_S = 5.0              # close() waits this long for the last confirmations
ANSWER_GRACE_S = 5.0              # an insert's answer may take this long beyond its timeout
_LINGER_S, _LINGER_OPS = 0.002, 256   # a message waits this long for more ops, unless this many


class _SentChunk:
  """A staging chunk as sent on the stream: its header op and the row bytes sent so far."""

  __slots__ = ("off", "meta", "identity", "cid", "gen", "header", "parts", "rows", "size")

  def __init__(self, off: int, meta, identity: tuple, header: dict, size: int):
    self.off = off
    self.meta = meta         # chunks.chunk_header of the staging chunk
    self.identity = identity
    self.cid = 0
    self.gen = -1            # generation of the stream it was last sent on
    self.header = header     # the chunk/obj op without its id
    self.parts: list = []          # row bytes sent, in order (numeric chunks)
    self.rows = 0
    self.size = size


class _Batch:
  """Items sent with one "itemrun" op (seqs seq .. seq + n - 1) and not confirmed yet; the
  items confirmed first leave its front (`confirm`)."""

  __slots__ = ("seq", "table", "keys", "prios", "descs", "chunks", "n", "nbytes")

  def __init__(self, seq, table, keys: bytes, prios: bytes, n: int):
    self.seq, self.table, self.keys, self.prios, self.n = seq, table, keys, prios, n
    self.descs: list = []    # per item, per column: [[(_SentChunk, row, nrows), ...], squeeze]
    self.chunks: dict = {}   # id(_SentChunk) -> _SentChunk referenced
    self.nbytes = 0          # bytes of chunks first sent with these items

  def confirm(self, k: int) -> None:
    """Drops the first k (< n) items, which were confirmed (the chunks stay referenced)."""
    self.seq, self.n = self.seq + k, self.n - k
    self.keys, self.prios = self.keys[8 * k:], self.prios[8 * k:]
    del self.descs[:k]


class _Stream:
  """One Write call: ops queued by `send` leave in as few messages as the stream allows."""

  def __init__(self, conn, gen: int, on_ack: Callable, on_end: Callable):
    self.gen = gen
    self.ended = False
    self.error: Optional[grpc.RpcError] = None
    self._cond = threading.Condition()
    self._out: list = []
    self._closing = False
    self._urgent = False
    self.call = conn.stream("Write", self._requests(), direct=True)
    # On the ZeroMQ port the ops of each send leave at once from the caller's thread (a writer
    # sends the items of a flush batch in one call): no request thread whose wake-ups and GIL
    # hand-offs cost the writer's thread more than the message it saves.
    self._direct = isinstance(self.call, zmq_client.StreamCall)
    self._on_ack, self._on_end = on_ack, on_end
    threading.Thread(target=self._read, daemon=True, name="reverb_shm-remote-acks").start()

  def send(self, ops: list, urgent: bool = False) -> None:
    """Queues ops; `urgent`: sent without lingering for more (on the ZeroMQ port every send
    goes out at once). Callers are serialised (WriteSession's lock)."""
    if self._direct:
      if not self._closing:
        for frame in wire.frames(wire.pack(ops[0] if len(ops) == 1 else {"ops": ops})):
          self.call.send(frame)
      return
    with self._cond:
      if not self._out or urgent:
        self._cond.notify()   # else the sender is awake already
      self._out.extend(ops)
      self._urgent = self._urgent or urgent

  def half_close(self) -> None:
    if self._direct:
      if not self._closing:
        self._closing = True
        self.call.half_close()
      return
    with self._cond:
      self._closing = True
      self._cond.notify()

  def cancel(self) -> None:
    self.half_close()
    self.call.cancel()

  def _requests(self):
    while True:
      with self._cond:
        while not self._out and not self._closing:
          self._cond.wait()
        if not self._out:
          return
        if not (self._closing or self._urgent) and len(self._out) < _LINGER_OPS:
          self._cond.wait(_LINGER_S)   # let a burst of ops gather into one message
        ops, self._out, self._urgent = self._out, [], False
      yield from wire.frames(wire.pack(ops[0] if len(ops) == 1 else {"ops": ops}))

  def _read(self) -> None:
    asm = wire.Reassembler()
    error = None
    try:
      for frame in self.call:
        msg = asm.feed(frame)
        if msg is not None:
          self._on_ack(self, msg)
    except grpc.RpcError as e:
      error = e
    except wire.BadMessage as e:   # a bridge speaking another protocol
      error = StreamError(grpc.StatusCode.INTERNAL, str(e))
    self._on_end(self, error)


class WriteSession:
  """Inserts over one Write stream of `conn` (see the module docstring).

  Args:
    address: the bridge's address (for messages).
    connection: callable returning the client's current connection (channel, metadata).
    staging: callable returning this process's staging segment.
    sent_bytes_budget: bytes of sent chunks the bridge keeps for this stream.
    reconnect_timeout_s: how long a broken stream is retried before ServerUnavailableError.
    rpc_error: maps a grpc.RpcError to the reverb_shm exception.
    describe: table name -> its limiter state, for timeout messages.

  Thread-safe (calls are serialised).
  """

  def __init__(self, address: str, connection: Callable, staging: Callable,
               sent_bytes_budget: int, reconnect_timeout_s: float, rpc_error: Callable,
               describe: Callable[[str], str]):
    self._describe = describe
    self._address = address
    self._connection = connection
    self._staging = staging
    self._budget = sent_bytes_budget
    self._reconnect_s = reconnect_timeout_s
    self._rpc_error = rpc_error
    self._lock = threading.RLock()       # one caller at a time
    self._cond = threading.Condition()   # state shared with the ack thread
    self._stream: Optional[_Stream] = None
    self._gens = itertools.count()
    self._ids = itertools.count(1)
    self._next_seq = 1
    self._sent: collections.OrderedDict[int, _SentChunk] = collections.OrderedDict()
    self._sent_bytes = 0
    self._unconfirmed: collections.deque = collections.deque()   # _Batch, in seq order
    self._in_flight_items = 0
    self._in_flight_bytes = 0
    self._error: Optional[Exception] = None
    self._closing = False
    self._finalising = False             # closed from a writer's __del__: open no stream
    self._dropped = 0                    # items the bridge did not insert after close
    self._give_up: Optional[float] = None   # monotonic time when reconnecting stops
    self._backoff = BACKOFF_START_S
    self._stale: list = []                     # chunks of failed items (the bridge may lack them)

  # ---- public
  @property
  def in_flight(self) -> int:
    """Items sent and not confirmed yet."""
    return self._in_flight_items

  def open(self) -> None:
    """Opens the Write stream now (a writer does at creation: its items may be batched until
    its __del__, which must not open streams, see finalising())."""
    with self._lock:
      self._ensure_stream()

  def insert(self, table: str, keys: np.ndarray, prios: np.ndarray, blob: bytes, offs,
             deadline_ns: int, timeout_ms) -> int:
    """Queues n items (uint64 keys, float64 priorities, descriptors into the staging segment)
    for the bridge; returns n without waiting for their confirmation.

    keys / prios are arrays or their little-endian bytes; offs: the n+1 descriptor offsets in
    `blob` (an array or a list of ints).

    Raises:
      DeadlineExceededError (inserted=0): too many items are unconfirmed and none were
        confirmed before `deadline_ns` (0: do not wait, -1: no deadline).
      The error the bridge reported for an earlier item; ServerUnavailableError.
    """
    n = len(offs) - 1
    key_bytes = keys if isinstance(keys, bytes) else np.ascontiguousarray(keys, "<u8").tobytes()
    prio_bytes = (prios if isinstance(prios, bytes) else
                  np.ascontiguousarray(prios, "<f8").tobytes())
    starts = offs[:-1] if isinstance(offs, list) else offs[:-1].tolist()
    with self._lock:
      stream = self._stream
      # Fast path without the ack thread's lock: a healthy stream with room (acks only
      # lower the counters, so a stale read errs on the safe side).
      if (stream is None or stream.ended or self._error is not None or self._stale
          or self._in_flight_items + n > MAX_IN_FLIGHT_ITEMS
          or self._in_flight_bytes >= MAX_IN_FLIGHT_BYTES) and self._in_flight_items:
        self._wait(lambda: self._in_flight_items == 0 or (
            self._in_flight_items + n <= MAX_IN_FLIGHT_ITEMS
            and self._in_flight_bytes < MAX_IN_FLIGHT_BYTES), deadline_ns,
                 lambda: errors.DeadlineExceededError(
                     f"{self._in_flight_items} items sent to bridge {self._address} await "
                     f"confirmation (the bridge's rate limiter is behind); 0 of {n} items sent "
                     f"within timeout_ms={timeout_ms}", inserted=0))
      elif stream is None or stream.ended or self._error is not None or self._stale:
        # (re)connects; raises a pending error (ready at once: never times out)
        self._wait(lambda: True, deadline_ns, errors.DeadlineExceededError)
      # One "itemrun" op for the n items, each with a seq of its own, so that the bridge
      # confirms each as soon as it is in (they are inserted with one call there while the
      # limiter admits them).
      if not n:
        return 0
      ops: list = []
      descs: list = []
      batch = _Batch(self._next_seq, table, key_bytes, prio_bytes, n)
      self._next_seq += n
      staging = self._staging()
      # Chunks brought up to date by this call: the writer (this thread) adds no rows during
      # it, so each chunk is read once per call.
      current: dict = {}
      for start in starts:
        item, sent = [], []   # (the op's descriptor is built in the same pass: see _items_op)
        for slices, squeeze in chunks.decode_descriptor(blob, start):
          column, sent_column = [], []
          for off, row, nrows in slices:
            chunk = current.get(off)
            if chunk is None or chunk.rows < row + nrows:
              chunk = current[off] = self._chunk(staging, off, row + nrows, ops, batch)
            else:
              batch.chunks[id(chunk)] = chunk
            column.append((chunk, row, nrows))
            sent_column.append([chunk.cid, row, nrows])
          item.append((column, squeeze))
          sent.append([sent_column, squeeze])
        batch.descs.append(item)
        descs.append(sent)
      ops.append({"op": "itemrun", "seq": batch.seq, "table": table, "keys": key_bytes,
                  "prios": prio_bytes, "descs": descs})
      self._evict(ops, batch.chunks)
      with self._cond:
        self._unconfirmed.append(batch)
        self._in_flight_bytes += batch.nbytes
        self._in_flight_items += n
      self._live.send(ops)
      return n

  def await_inserts(self, until: int, deadline_ns: int, timeout_ms, what: str) -> None:
    """Waits until at most `until` sent items are unconfirmed.

    Raises:
      DeadlineExceededError: not confirmed by `deadline_ns` (0: do not wait, -1: none); the
        items stay in flight and are inserted when their rate limiter admits them.
      The bridge's error for an item; ServerUnavailableError (stream lost for good).
    """
    until = max(0, int(until))
    with self._lock:
      self._wait(lambda: self._in_flight_items <= until, deadline_ns,
                 lambda: errors.DeadlineExceededError(
                     f"Timeout exceeded: {what}(timeout_ms={timeout_ms}) gave up with "
                     f"{self._in_flight_items} items sent to bridge {self._address} but "
                     "not yet admitted by the rate limiter; they stay in flight and are "
                     f"inserted when it admits them ({self._waiting_tables()})"))
      self._raise_error()

  def close(self) -> None:
    """Half-closes the stream: the bridge inserts the items the limiters admit at once and
    drops the others. Items dropped so, and items the bridge never confirmed (the stream was
    lost, or the bridge did not answer within the grace period), are named in a RuntimeWarning,
    each with its cause. Never raises; idempotent."""
    with self._lock:
      stream = self._stream
      if stream is None:
        return
      with self._cond:
        self._closing = True
        if sys.is_finalizing():   # gRPC's threads are gone: do not wait on them
          self._stream = None
          return
        stream.half_close()       # the bridge ends the stream once it handled every op
        if self._unconfirmed and not stream.ended:
          self._cond.wait_for(lambda: stream.ended, _CLOSE_GRACE_S)
        dropped, unconfirmed = self._dropped, self._in_flight_items
        self._stream = None       # (acks were counted until now)
      if dropped or unconfirmed:
        stream.cancel()
    if dropped:
      warnings.warn(f"TrajectoryWriter closed with {dropped} items sent to bridge "
                    f"{self._address} that their rate limiter did not admit; they were "
                    "dropped (call flush() before close() to wait)", RuntimeWarning,
                    stacklevel=4)
    if unconfirmed:
      cause = (f"the bridge did not confirm them within {_CLOSE_GRACE_S:g} s" if not stream.ended
               else "the stream ended first: " + (
                   str(self._rpc_error(stream.error, self._address)) if stream.error is not None
                   else "the bridge closed it"))
      warnings.warn(f"TrajectoryWriter closed with {unconfirmed} items sent to bridge "
                    f"{self._address} but not confirmed ({cause}); they may not have been "
                    "inserted", RuntimeWarning, stacklevel=4)

  # ---- chunks
  def _chunk(self, staging, off: int, rows_needed: int, ops: list, batch: _Batch) -> _SentChunk:
    """The sent state of staging chunk `off`, sending it (or its new rows) first if needed."""
    state = chunks.chunk_state(staging, off)
    identity, rows = state[:4], state[4]
    chunk = self._sent.get(off)
    # A writer never allocates two chunks of one (episode, start step) at one offset: a
    # different identity means the block was freed and reused.
    if chunk is not None and chunk.identity != identity:
      self._drop(chunk, ops)
      chunk = None
    if chunk is None:
      chunk = _new_chunk(staging, off, chunks.chunk_header(staging, off), identity)
      batch.nbytes += sum(map(len, chunk.parts))
      self._send_chunk(chunk, ops)
      self._sent[off] = chunk
      self._sent_bytes += chunk.size
    else:
      self._sent.move_to_end(off)
    if chunk.rows < rows_needed:
      data = chunks.chunk_row_bytes(staging, chunk.meta, chunk.rows, rows)
      ops.append({"op": "rows", "id": chunk.cid, "first": chunk.rows, "b": data,
                  "n": rows - chunk.rows})
      chunk.parts.append(data)
      chunk.rows = rows
      batch.nbytes += len(data)
    batch.chunks[id(chunk)] = chunk
    return chunk

  def _send_chunk(self, chunk: _SentChunk, ops: list) -> None:
    """Appends the op (re)creating `chunk` with every row sent so far on the current stream."""
    chunk.cid, chunk.gen = next(self._ids), self._live.gen
    op = dict(chunk.header, id=chunk.cid)
    if chunk.rows and chunk.header["op"] == "chunk":   # (zero-element rows have no bytes)
      op["b"] = chunk.parts[0] if len(chunk.parts) == 1 else b"".join(chunk.parts)
      op["n"] = chunk.rows
    ops.append(op)

  def _evict(self, ops: list, in_use: dict) -> None:
    while self._sent_bytes > self._budget:
      chunk = next(iter(self._sent.values()))
      if id(chunk) in in_use:
        break
      self._drop(chunk, ops)

  def _drop(self, chunk: _SentChunk, ops: list) -> None:
    if self._sent.get(chunk.off) is chunk:
      del self._sent[chunk.off]
      self._sent_bytes -= chunk.size
      if chunk.gen == self._live.gen:
        ops.append({"op": "drop", "ids": [chunk.cid]})

  # ---- the stream
  @property
  def _live(self) -> _Stream:
    """The current stream (_ensure_stream / _open set it before any caller uses it)."""
    stream = self._stream
    assert stream is not None
    return stream

  def _ensure_stream(self) -> None:
    if self._stream is None:
      self._open()
    elif self._stream.ended:
      self._recover()

  def finalising(self) -> None:
    """The writer is being closed by its finaliser (__del__, possibly inside the garbage
    collector): from now on a missing or broken stream raises instead of being (re)opened, since
    opening one starts and waits for threads, which can deadlock inside the collector."""
    self._finalising = True

  def _check_may_open(self) -> None:
    if self._closing:
      raise RuntimeError("the writer's bridge session is closed")
    if self._finalising:
      raise errors.ServerUnavailableError(
          f"a TrajectoryWriter collected without close() has no open Write stream to bridge "
          f"{self._address}; its {self._in_flight_items} unconfirmed item(s) are dropped (call "
          "close() or use `with` to wait for them)")

  def _open(self) -> None:
    """A new stream; every unconfirmed batch is sent again on it, in order."""
    self._check_may_open()
    self._stream = _Stream(self._connection(), next(self._gens), self._on_ack, self._on_end)
    self._sent.clear()
    self._sent_bytes = 0
    ops: list = []
    with self._cond:
      batches = list(self._unconfirmed)
    for batch in batches:
      for chunk in batch.chunks.values():
        if chunk.gen != self._stream.gen:
          self._send_chunk(chunk, ops)
          if chunk.off not in self._sent:
            self._sent[chunk.off] = chunk
            self._sent_bytes += chunk.size
      ops.append(_items_op(batch))
    if ops:   # confirmed at once: a caller may be waiting for them
      self._stream.send(ops + [{"op": "sync"}], urgent=True)

  def _recover(self) -> None:
    """Reopens a broken stream (with backoff) or raises once reconnect_timeout_s passed."""
    self._check_may_open()
    stream = self._live
    error = stream.error
    retryable = error is None or error.code() in RETRYABLE
    now = time.monotonic()
    if self._give_up is None:
      self._give_up, self._backoff = now + self._reconnect_s, BACKOFF_START_S
    elif retryable and now < self._give_up:
      time.sleep(min(self._backoff, max(0.0, self._give_up - now)))
      self._backoff = min(2 * self._backoff, BACKOFF_MAX_S)
    if not retryable or time.monotonic() >= self._give_up:
      with self._cond:
        lost = self._in_flight_items
        self._unconfirmed.clear()
        self._in_flight_items = self._in_flight_bytes = 0
      self._stream, self._give_up = None, None
      cause = (self._rpc_error(error, self._address) if error is not None else
               errors.ServerUnavailableError("the bridge ended the stream"))
      if not retryable:
        raise cause
      raise errors.ServerUnavailableError(
          f"lost the Write stream to bridge {self._address} and could not re-send {lost} "
          f"unconfirmed item(s) within reconnect_timeout_s={self._reconnect_s}: {cause}")
    self._open()

  def _wait(self, ready: Callable[[], bool], deadline_ns: int, timeout_error: Callable) -> None:
    """Waits (reconnecting as needed) until `ready()`; raises timeout_error() at the deadline."""
    self._ensure_stream()
    self._raise_error()
    if not ready():
      self._live.send([{"op": "sync"}], urgent=True)   # the bridge acks at once
    while True:
      with self._cond:
        while not self._live.ended:
          if ready():
            return
          if self._error is not None:
            break
          if deadline_ns == 0:
            raise timeout_error()
          wait = None
          if deadline_ns > 0:
            wait = (deadline_ns - time.monotonic_ns()) / 1e9
            if wait <= 0:
              raise timeout_error()
          self._cond.wait(wait)
        if ready():
          return
      self._raise_error()
      self._recover()

  def _waiting_tables(self) -> str:
    with self._cond:
      tables = list(dict.fromkeys(batch.table for batch in self._unconfirmed))
    return "; ".join(filter(None, map(self._describe, tables)))

  def has_error(self) -> bool:
    """Whether the bridge reported an error that the next call raises."""
    return self._error is not None

  def _raise_error(self) -> None:
    if self._error is None and not self._stale:
      return     # (set by the ack thread; checked again under the lock otherwise)
    with self._cond:
      error, self._error = self._error, None
      stale, self._stale = self._stale, []
    if stale and self._stream is not None:
      ops: list = []
      for chunk in stale:
        self._drop(chunk, ops)
      self._stream.send(ops)
    if error is not None:
      raise error

  # ---- called by the stream's ack thread
  def _on_ack(self, stream: _Stream, msg: dict) -> None:
    upto = msg.get("upto")
    errs = {e[0]: e[1:] for e in msg.get("errs") or () if isinstance(e, list) and len(e) == 4}
    with self._cond:
      if stream is not self._stream or not isinstance(upto, int):
        return
      while self._unconfirmed:
        batch = self._unconfirmed[0]
        if batch.seq > upto:
          break
        done = min(batch.n, upto - batch.seq + 1)
        failed = [errs[s] for s in range(batch.seq, batch.seq + done) if s in errs] if errs else ()
        if done == batch.n:
          self._unconfirmed.popleft()
          self._in_flight_bytes -= batch.nbytes
        else:
          batch.confirm(done)
        self._in_flight_items -= done
        for inserted, name, text in failed:   # (items of one item each: inserted is 0 or 1)
          if self._closing:
            self._dropped += 1 - int(inserted)
          elif self._error is None:
            self._error = wire.make_error(name, text, inserted=inserted)
        if failed:
          self._stale.extend(batch.chunks.values())   # re-sent if needed again
      self._give_up = None
      self._cond.notify_all()

  def _on_end(self, stream: _Stream, error: Optional[grpc.RpcError]) -> None:
    with self._cond:
      stream.error, stream.ended = error, True
      self._cond.notify_all()


def _new_chunk(staging, off: int, header, identity: tuple) -> _SentChunk:
  """The sent state of staging chunk `off` with every row it holds (not sent yet)."""
  if header.dtype.kind == "O":
    rows = chunks.object_chunk_rows(staging, header, 0, header.rows)
    flat = [[x.item() if isinstance(x, np.generic) else x for x in np.asarray(r).reshape(-1)]
            for r in rows]
    op = {"op": "obj", "s": list(header.shape), "rows": flat, "ep": header.episode_id,
          "step": header.start_step}
    chunk = _SentChunk(off, header, identity, op, max(1, 64 * len(flat)))
  else:
    op = {"op": "chunk", "d": header.dtype.str, "s": list(header.shape),
          "cap": header.capacity, "ep": header.episode_id, "step": header.start_step}
    chunk = _SentChunk(off, header, identity, op, max(1, header.capacity * header.row_bytes))
    data = chunks.chunk_row_bytes(staging, header, 0, header.rows)
    if data:
      chunk.parts.append(data)
  chunk.rows = header.rows
  return chunk


def queued(q: queue.SimpleQueue):
  """The request iterator of a stream call: what `q` holds, in order, until None."""
  while True:
    frame = q.get()
    if frame is None:
      return
    yield frame


class InsertStream:
  """One persistent Insert call of a connection (grpcio's public stream API): one request
  message per Client.insert, one reply (its ack) per request. Used by one caller at a time
  (see OneMessageInserter); Client.insert takes it when the bridge offers no ZeroMQ port.
  """

  def __init__(self, conn):
    self._asm = wire.Reassembler()
    self._out: queue.SimpleQueue = queue.SimpleQueue()
    self._call = conn.method("Insert", "stream_stream")(queued(self._out),
                                                        metadata=conn.metadata)

  def round_trip(self, payload: bytes) -> dict:
    """Sends one encoded message; returns the bridge's reply (raises grpc.RpcError)."""
    for frame in wire.frames(payload):
      self._out.put(frame)
    for frame in self._call:
      reply = self._asm.feed(frame)
      if reply is not None:
        return reply
    raise StreamError(grpc.StatusCode.UNAVAILABLE, "the bridge ended the insert stream")

  def close(self) -> None:
    self._out.put(None)
    self._call.cancel()

  def cancel(self) -> None:
    """Ends a waiting round trip with CANCELLED (from another thread: the watchdog)."""
    self._call.cancel()


class OneMessageInserter:
  """Client.insert's path: the ops of one call (its chunks, whole, and its items) travel as
  one message on a persistent Insert stream of the connection (taken from its idle ones, or
  opened); `send` returns when the bridge confirmed them. Retried with backoff on a new
  stream while the bridge is unreachable, for up to `reconnect_timeout_s` (a re-sent item
  keeps its key). A call interrupted before its reply (Ctrl-C) cancels its stream.
  """

  def __init__(self, address: str, connection: Callable, reconnect_timeout_s: float,
               rpc_error: Callable):
    self._address = address
    self._connection = connection
    self._reconnect_s = reconnect_timeout_s
    self._rpc_error = rpc_error

  def send(self, ops: list, timeout_ms: Optional[int] = None) -> None:
    """Sends Write ops (ids and seqs local to them) as one message; waits for the ack.

    With `timeout_ms` (the ops' rate limiter timeout), a bridge that does not answer within
    timeout_ms + max(ANSWER_GRACE_S, reconnect_timeout_s) (stopped, wedged, or cut off without
    its connection closing) ends the call with DeadlineExceededError; without, it is waited for
    as Reverb waits (until gRPC keepalive gives up on the connection).

    Raises:
      The bridge's error for an item; ServerUnavailableError; DeadlineExceededError (above:
      the items may or may not have been inserted).
    """
    payload = wire.pack({"ops": ops})
    give_up = time.monotonic() + self._reconnect_s
    grace_s = max(ANSWER_GRACE_S, self._reconnect_s)
    answer_s = None if timeout_ms is None else timeout_ms / 1000 + grace_s
    backoff = BACKOFF_START_S
    while True:
      conn = self._connection()
      if not conn.port_asked:
        conn.learn_ports(conn.unary("ServerInfo", {}))
      path = next((p for p in _PORT_PATHS if p.port(conn) is not None), None)
      if path is not None:
        ack = self._send_port(conn, path, payload, timeout_ms, answer_s, give_up)
        if ack is not None:
          break
        continue   # the port went away: another one, or gRPC (which learns the new ports)
      idle = conn.insert_streams
      stream, token = None, None
      try:
        try:
          stream = idle.pop()
        except IndexError:
          stream = InsertStream(conn)   # (a channel closed meanwhile: CANCELLED, retried)
        if answer_s is not None:
          token = watchdog.WATCHDOG.watch(time.monotonic() + answer_s, stream.cancel)
        ack = stream.round_trip(payload)
        if token is None or watchdog.WATCHDOG.unwatch(token):
          idle.append(stream)
        else:   # cancelled as the answer came: the stream cannot be reused
          stream.close()
        break
      except grpc.RpcError as e:
        if stream is not None:
          stream.close()
        now = time.monotonic()
        if token is not None and not watchdog.WATCHDOG.unwatch(token):
          raise errors.DeadlineExceededError(
              f"bridge {self._address} did not answer an insert within timeout_ms={timeout_ms} "
              f"+ {grace_s:g} s (stopped or unreachable without closing "
              f"its connection?); the items may or may not have been inserted") from None
        if e.code() not in RETRYABLE:
          raise self._rpc_error(e, self._address) from None
        if now >= give_up:
          raise errors.ServerUnavailableError(
              f"could not insert into bridge {self._address} within reconnect_timeout_s="
              f"{self._reconnect_s}: {self._rpc_error(e, self._address)}") from None
        time.sleep(min(backoff, give_up - now))
        backoff = min(2 * backoff, BACKOFF_MAX_S)
      except BaseException:
        if token is not None:
          watchdog.WATCHDOG.unwatch(token)
        if stream is not None:
          stream.close()   # its reply is still due: the stream cannot be reused
        raise
    for err in ack.get("errs") or ():
      if isinstance(err, list) and len(err) == 4:
        raise wire.make_error(err[2], err[3], inserted=err[1])

  def _send_port(self, conn, path: "_PortPath", payload: bytes, timeout_ms: Optional[int],
                 answer_s: Optional[float], give_up: float) -> Optional[dict]:
    """One message over an insert connection to the `path` port of `conn` (idle, or new); its
    ack. A bridge that is unreachable is tried again with backoff until `give_up`; None once
    that port is gone (the caller goes on over another, or gRPC, whose ServerInfo tells the
    new ports)."""
    limit = conn.zmq_max_bytes
    if limit is not None and len(payload) > limit:   # (the port would drop the connection)
      raise wire.BadMessage(f"message of {len(payload)} bytes exceeds the bridge's "
                            f"max_message_bytes={limit}")
    backoff = BACKOFF_START_S
    while True:
      sock = None
      idle = path.idle(conn)
      try:
        try:
          sock = idle.pop()
        except IndexError:
          sock = path.connect(zmq_client.split_host(conn.address), path.port(conn),
                              conn.creds.token, max(0.1, give_up - time.monotonic()))
        ack = sock.round_trip(payload, answer_s)
      except TimeoutError:
        if sock is not None:
          sock.close()
        if sock is None or answer_s is None:   # (connecting timed out)
          raise errors.ServerUnavailableError(
              f"could not connect to bridge {self._address}'s {path.name} port within "
              f"reconnect_timeout_s={self._reconnect_s}") from None
        raise errors.DeadlineExceededError(
            f"bridge {self._address} did not answer an insert within timeout_ms={timeout_ms} "
            f"+ {answer_s - (timeout_ms or 0) / 1000:g} s (stopped or unreachable without closing "
            f"its connection?); the items may or may not have been inserted") from None
      except PermissionError as e:
        raise PermissionError(f"bridge {self._address} refused the call: {e}") from None
      except ConnectionError:   # refused, broken, or unknown to a restarted bridge
        if sock is not None:
          sock.close()
        now = time.monotonic()
        if now >= give_up:
          raise errors.ServerUnavailableError(
              f"could not insert into bridge {self._address} within reconnect_timeout_s="
              f"{self._reconnect_s}") from None
        try:   # a bridge that restarted listens on other ports
          conn.learn_ports(conn.unary("ServerInfo", {}))
        except errors.ServerUnavailableError:
          pass
        if path.port(conn) is None:
          return None
        time.sleep(min(backoff, max(0.0, give_up - now)))
        backoff = min(2 * backoff, BACKOFF_MAX_S)
      except BaseException:   # interrupted (Ctrl-C) before the reply: the connection is unusable
        if sock is not None:
          sock.close()
        raise
      else:
        error = sock.fatal(ack)
        if error is not None:
          raise error
        idle.append(sock)
        return ack


class _PortPath(NamedTuple):
  """A port Client.insert may take: its name (for messages), its number on a connection
  (None: not to be used), the connection's idle insert connections to it, and
  connect(host, port, token, timeout_s) making a new one."""
  name: str
  port: Callable
  idle: Callable
  connect: Callable


# Client.insert's ports, the first one offered is taken.
_PORT_PATHS = (
    _PortPath("direct", lambda conn: conn.direct_port, lambda conn: conn.direct_inserts,
              direct_client.InsertConnection),
    _PortPath("ZeroMQ", lambda conn: conn.zmq_port, lambda conn: conn.zmq_inserts,
              zmq_client.InsertConnection),
)


def _items_op(batch: _Batch) -> dict:
  """The "itemrun" op of `batch`, naming its chunks by their ids on the current stream."""
  descs = [[[[[chunk.cid, row, nrows] for chunk, row, nrows in column], squeeze]
            for column, squeeze in item] for item in batch.descs]
  return {"op": "itemrun", "seq": batch.seq, "table": batch.table, "keys": batch.keys,
          "prios": batch.prios, "descs": descs}
