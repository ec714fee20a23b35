"""Request/reply round trips on a gRPC stream, driven by the calling thread.

grpcio's public synchronous stream API hands each request to a thread that consumes the
request iterator and each reply over from the channel's polling thread, so one round trip of a
synchronous request/reply stream wakes three threads (~130-170 us of client CPU per round trip
on the development machine). grpcio's own blocking unary calls avoid that with a "segregated"
call: the caller starts a batch of operations and waits on the call's own completion queue.
`DirectStream` does the same for a stream-stream call: per round trip one batch (send the
request, receive the reply) that the caller waits for (~45 us of client CPU per round trip).

This uses grpcio internals (`grpc._cython.cygrpc` and private attributes of the channel's
multi-callables; grpcio 1.6x-1.8x have them). `open_stream` returns None when they are
missing or refuse the call, and callers then take the public API; setting the environment
variable REVERB_SHM_BRIDGE_PUBLIC_GRPC=1 (or `ENABLED = False`) always takes the public API.
"""
import os
from typing import Optional

import grpc

try:
  from grpc._cython import cygrpc  # pylint: disable=g-import-not-at-top
except ImportError:   # pragma: no cover  (a grpcio without the Cython core)
  cygrpc = None

__all__ = ["DirectStream", "open_stream", "ENABLED"]

ENABLED = os.environ.get("REVERB_SHM_BRIDGE_PUBLIC_GRPC", "") in ("", "0")

_INIT, _STATUS, _SEND, _ROUND_TRIP = "init", "status", "send", "round trip"
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_failed_once = False   # the internals refused a call once: stop trying in this process


class StreamError(grpc.RpcError):
  """A failed DirectStream call, with the accessors of grpc's own call errors."""

  def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata=()):
    super().__init__(details)
    self._code, self._details, self._trailing = code, details, tuple(trailing_metadata or ())

  def code(self) -> grpc.StatusCode:
    return self._code

  def details(self) -> str:
    return self._details

  def trailing_metadata(self) -> tuple:
    return self._trailing


def open_stream(multicallable, metadata) -> Optional["DirectStream"]:
  """A DirectStream of `multicallable` (a stream-stream multi-callable of a grpc.Channel), or
  None when this grpcio lacks the internals (or ENABLED is False): use the public API then.

  Raises:
    grpc.RpcError: the call could not start (e.g. the channel is closed: CANCELLED).
  """
  global _failed_once
  if not ENABLED or _failed_once or cygrpc is None:
    return None
  try:
    return DirectStream(multicallable, metadata)
  except (AttributeError, TypeError, NameError):
    _failed_once = True   # another grpcio: its internals differ
    return None


class DirectStream:
  """One stream-stream call whose requests and replies travel in round trips: `round_trip`
  sends request messages and returns the next reply message, waiting in the calling thread.

  Used by one thread at a time. A call that ended (the server's status arrived, it was
  cancelled, or a signal interrupted a wait) raises StreamError from every later round trip.

  Raises (constructor):
    AttributeError, TypeError: this grpcio's internals differ (see open_stream).
    StreamError: the channel refused the call (closed: CANCELLED).
  """

  def __init__(self, multicallable, metadata) -> None:
    flags = cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS
    init = (cygrpc.SendInitialMetadataOperation(tuple(metadata or ()), 0),
            cygrpc.ReceiveInitialMetadataOperation(0))
    try:
      self._call = multicallable._channel.segregated_call(  # pylint: disable=protected-access
          flags, multicallable._method, None, None, tuple(metadata or ()), None,  # pylint: disable=protected-access
          ((init, _INIT), ((cygrpc.ReceiveStatusOnClientOperation(0),), _STATUS)),
          multicallable._context, multicallable._registered_call_handle)  # pylint: disable=protected-access
    except ValueError as e:   # "Cannot invoke RPC on closed channel!"
      raise StreamError(grpc.StatusCode.CANCELLED, str(e)) from None
    self._due = 2          # batches started whose completion was not taken yet
    self._error: Optional[StreamError] = None   # set once the call ended

  @property
  def ended(self) -> bool:
    """Whether the call ended (every round trip raises its error)."""
    return self._error is not None

  def round_trip(self, requests) -> Optional[bytes]:
    """Sends the messages `requests` (bytes, in order) and returns the next reply message.

    Raises:
      StreamError: the call ended (the server's status, or CANCELLED/UNAVAILABLE).
      KeyboardInterrupt (or a signal handler's exception, main thread only): the call is
        cancelled and ended.
    """
    *first, last = requests
    for message in first:
      self._batch((cygrpc.SendMessageOperation(message, 0),), _SEND)
    return self._batch((cygrpc.SendMessageOperation(last, 0),
                        cygrpc.ReceiveMessageOperation(0)), _ROUND_TRIP)

  def receive(self) -> Optional[bytes]:
    """The next reply message (replies of several messages).

    Raises:
      StreamError: as round_trip.
    """
    return self._batch((cygrpc.ReceiveMessageOperation(0),), _ROUND_TRIP)

  def _batch(self, operations, tag) -> Optional[bytes]:
    """Starts a batch and waits for its completion; the message it received (None if it
    received none)."""
    if self._error is not None:
      raise self._error
    if not self._call.operate(operations, tag):   # the call completed meanwhile
      self._end(StreamError(grpc.StatusCode.UNAVAILABLE, "the stream ended"))
    self._due += 1
    receive = operations[-1] if tag is _ROUND_TRIP else None
    while True:
      event = self._next()
      if event.tag is _STATUS:
        self._status(event)
      elif event.tag is tag:
        message = None if receive is None else receive.message()
        if not event.success or receive is not None and message is None:
          self._await_status()    # the stream broke: its status says why
        return message

  def _next(self):
    try:
      event = self._call.next_event()
    except BaseException:   # a signal handler raised: grpc deleted the call meanwhile
      self._due = 0
      self._error = StreamError(grpc.StatusCode.CANCELLED, "interrupted")
      raise
    self._due -= 1
    return event

  def _status(self, event) -> None:
    op = event.batch_operations[0]
    code = _CODES.get(op.code(), grpc.StatusCode.UNKNOWN)
    if code is grpc.StatusCode.OK:
      code, details = grpc.StatusCode.UNAVAILABLE, "the server ended the stream"
    else:
      details = op.details() or code.name
    self._end(StreamError(code, details, op.trailing_metadata()))

  def _end(self, error: StreamError):
    self._error = self._error or error
    raise self._error

  def _await_status(self) -> None:
    """Raises the call's status once it arrives (after a batch failed)."""
    while self._due:
      event = self._next()
      if event.tag is _STATUS:
        self._status(event)
    self._end(StreamError(grpc.StatusCode.UNAVAILABLE, "the stream ended without a status"))

  def cancel(self) -> None:
    """Cancels the call from another thread: the round trip waiting on it ends with
    StreamError (CANCELLED). The owner still closes the stream."""
    self._call.cancel(cygrpc.StatusCode.cancelled, "cancelled by the client (deadline)")

  def close(self) -> None:
    """Cancels the call (if it is open) and takes its outstanding completions."""
    if self._due:
      self._call.cancel(cygrpc.StatusCode.cancelled, "closed by the client")
      try:
        while self._due:
          event = self._next()
          if event.tag is _STATUS:
            self._error = self._error or StreamError(grpc.StatusCode.CANCELLED, "closed")
      except BaseException:  # pylint: disable=broad-except  (interrupted: grpc ended the call)
        pass
    self._error = self._error or StreamError(grpc.StatusCode.CANCELLED, "closed")
