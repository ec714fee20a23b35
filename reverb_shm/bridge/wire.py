"""Wire format of the gRPC bridge: msgpack maps, raw numpy bytes, frames and error codes.

Every gRPC message is `bytes`; no pickle anywhere. A logical message is a msgpack map; arrays
travel as ``{"d": dtype str, "s": [shape], "b": raw bytes}`` (numeric dtypes only). A logical
message larger than FRAME_BYTES is split into frames so that every gRPC message stays below
gRPC's default 4 MiB limit: each frame is one flag byte (FINAL or MORE) plus payload bytes.
Receivers bound the reassembled size by `max_message_bytes` (checked before each append).

Every decoder here validates types, sizes and shapes and raises BadMessage (an
InvalidArgumentError) naming the field; nothing is allocated from an unchecked size.
"""
import math
from typing import Any, Iterator, List, Literal, Optional, overload

import msgpack
import numpy as np

from reverb_shm import errors

SERVICE = "reverb_shm.Bridge"
FRAME_BYTES = 3 << 20          # payload bytes per frame (gRPC's default limit is 4 MiB)
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
MAX_RANK = 8
_FINAL, _MORE = b"\x00", b"\x01"
_NUMERIC_KINDS = "biufc"


class BadMessage(errors.InvalidArgumentError):
  """A bridge message that is malformed or violates a limit."""


# ---------------------------------------------------------------- msgpack
def pack(msg: Any) -> bytes:
  return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> dict:
  """Decodes one logical message; BadMessage unless it is a msgpack map with str keys."""
  if not isinstance(data, (bytes, bytearray, memoryview)):
    raise BadMessage(f"expected bytes, got {type(data).__name__}")
  if len(data) > max_bytes:
    raise BadMessage(f"message of {len(data)} bytes exceeds max_message_bytes={max_bytes}")
  try:
    msg = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
  except Exception as e:  # msgpack raises many types on garbage  pylint: disable=broad-except
    raise BadMessage(f"undecodable message: {type(e).__name__}: {e}") from None
  if not isinstance(msg, dict):
    raise BadMessage(f"message must be a map, got {type(msg).__name__}")
  return msg


# ---------------------------------------------------------------- typed fields
def get(msg: dict, key: str, kind, *, optional: bool = False, what: str = "message"):
  """msg[key] checked to be an instance of `kind` (bool is never an int)."""
  if key not in msg or msg[key] is None:
    if optional:
      return None
    raise BadMessage(f"{what} lacks field {key!r}")
  value = msg[key]
  if kind is int and isinstance(value, bool) or not isinstance(value, kind):
    raise BadMessage(f"{what} field {key!r} must be {getattr(kind, '__name__', kind)}, got "
                     f"{type(value).__name__}")
  return value


def no_fields(msg: dict, what: str = "message") -> dict:
  """Returns `msg` if it is empty (requests that take no arguments); BadMessage otherwise."""
  if msg:
    raise BadMessage(f"{what} takes no fields, got {sorted(map(repr, msg))[:5]}")
  return msg


@overload
def get_int(msg: dict, key: str, lo: int, hi: int, *, optional: Literal[False] = False,
            what: str = "message") -> int: ...
@overload
def get_int(msg: dict, key: str, lo: int, hi: int, *, optional: bool,
            what: str = "message") -> Optional[int]: ...
def get_int(msg: dict, key: str, lo: int, hi: int, *, optional: bool = False,
            what: str = "message") -> Optional[int]:
  """An int field in [lo, hi] (None when `optional` and absent)."""
  value = get(msg, key, int, optional=optional, what=what)
  if value is not None and not lo <= value <= hi:
    raise BadMessage(f"{what} field {key!r} must be in [{lo}, {hi}], got {value}")
  return value


def get_str(msg: dict, key: str, *, what: str = "message", max_len: int = 4096) -> str:
  value = get(msg, key, str, what=what)
  if len(value) > max_len:
    raise BadMessage(f"{what} field {key!r} is longer than {max_len} characters")
  return value


def get_list(msg: dict, key: str, max_len: int, *, what: str = "message") -> list:
  value = get(msg, key, list, what=what)
  if len(value) > max_len:
    raise BadMessage(f"{what} field {key!r} has {len(value)} entries, more than {max_len}")
  return value


def timeout_field(msg: dict, key: str = "timeout_ms") -> Optional[int]:
  """None (wait forever) or a non-negative int of milliseconds."""
  return get_int(msg, key, 0, 2**62, optional=True)


# ---------------------------------------------------------------- arrays
def encode_array(arr: np.ndarray) -> dict:
  return {"d": arr.dtype.str, "s": list(arr.shape), "b": arr.tobytes()}  # C order


def check_dtype(code: Any, what: str = "array") -> np.dtype:
  """A numeric numpy dtype from its str code; BadMessage otherwise."""
  if not isinstance(code, str) or len(code) > 8:
    raise BadMessage(f"{what} dtype must be a short str, got {code!r}")
  try:
    dtype = np.dtype(code)
  except (TypeError, ValueError):
    raise BadMessage(f"{what} dtype {code!r} is not a numpy dtype") from None
  if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
    raise BadMessage(f"{what} dtype {dtype} is not numeric (bool/int/uint/float/complex)")
  return dtype


def check_shape(shape: Any, what: str = "array") -> tuple:
  if not isinstance(shape, list) or len(shape) > MAX_RANK:
    raise BadMessage(f"{what} shape must be a list of at most {MAX_RANK} ints, got {shape!r}")
  for d in shape:
    if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < 2**40:
      raise BadMessage(f"{what} shape {shape!r} has an invalid dimension {d!r}")
  return tuple(shape)


def decode_array(obj: Any, what: str = "array") -> np.ndarray:
  """A read-only numpy view of an encoded array; sizes are checked before any copy."""
  if not isinstance(obj, dict):
    raise BadMessage(f"{what} must be a map, got {type(obj).__name__}")
  dtype = check_dtype(obj.get("d"), what)
  shape = check_shape(obj.get("s"), what)
  data = obj.get("b")
  if not isinstance(data, bytes):
    raise BadMessage(f"{what} data must be bytes")
  if len(data) != dtype.itemsize * math.prod(shape):
    raise BadMessage(f"{what} of shape {shape} x {dtype} needs "
                     f"{dtype.itemsize * math.prod(shape)} bytes, got {len(data)}")
  return np.frombuffer(data, dtype).reshape(shape)


def u64_array(msg: dict, key: str, max_len: int, what: str = "message") -> np.ndarray:
  """uint64[n] sent as raw little-endian bytes."""
  data = get(msg, key, bytes, what=what)
  if len(data) % 8 or len(data) // 8 > max_len:
    raise BadMessage(f"{what} field {key!r} must hold at most {max_len} uint64 values "
                     f"({len(data)} bytes given)")
  return np.frombuffer(data, "<u8")


def f64_array(msg: dict, key: str, n: int, what: str = "message") -> np.ndarray:
  data = get(msg, key, bytes, what=what)
  if len(data) != 8 * n:
    raise BadMessage(f"{what} field {key!r} must hold {n} float64 values ({len(data)} bytes)")
  return np.frombuffer(data, "<f8")


# ---------------------------------------------------------------- frames
def frames(payload: bytes, frame_bytes: int = FRAME_BYTES) -> Iterator[bytes]:
  """Splits one encoded logical message into gRPC messages (flag byte + payload part)."""
  n = len(payload)
  if n <= frame_bytes:
    yield _FINAL + payload
    return
  view = memoryview(payload)
  for start in range(0, n, frame_bytes):
    end = min(n, start + frame_bytes)
    yield (_FINAL if end == n else _MORE) + view[start:end].tobytes()


# ---------------------------------------------------------------- the ZeroMQ port
# Without TLS, a bridge also serves its streams on a ZeroMQ ROUTER socket (its "fast port",
# number in ServerInfo's "zmq_port"); each client call is a DEALER socket of its own. Every
# ZeroMQ message is one frame: a one-byte kind, then (for some kinds) the payload; a payload of
# ZMQ_SPLIT_BYTES or more goes as a second frame instead (not copied behind the kind).
#   client -> bridge: ZMQ_OPEN {"token", "stream": name or absent for an insert connection},
#                     ZMQ_MSG (a stream's gRPC message, i.e. a frame; on an insert connection
#                     one whole Insert message), ZMQ_EOF (half-close), ZMQ_CANCEL.
#   bridge -> client: ZMQ_OPEN {"ok": true} or {"err": [class, message]} (answering the hello),
#                     ZMQ_MSG, ZMQ_STATUS {"code", "details", "md"} (a stream's end),
#                     ZMQ_PING (nothing; sent to find out which clients are gone).
ZMQ_OPEN, ZMQ_MSG, ZMQ_EOF, ZMQ_CANCEL = b"O", b"M", b"E", b"C"
ZMQ_STATUS, ZMQ_PING = b"S", b"P"
ZMQ_SPLIT_BYTES = 1 << 16


def zmq_frames(kind: bytes, payload: Optional[bytes] = None) -> list:
  """The frames of one ZeroMQ message of `kind` carrying `payload`."""
  if payload is None:
    return [kind]
  if len(payload) < ZMQ_SPLIT_BYTES:
    return [kind + payload]
  return [kind, payload]


def zmq_message(frames: list) -> tuple:
  """(kind, payload) of a ZeroMQ message's frames; BadMessage if it has another form."""
  if len(frames) == 1 and frames[0]:
    return frames[0][:1], frames[0][1:]
  if len(frames) == 2 and len(frames[0]) == 1:
    return frames[0], frames[1]
  raise BadMessage(f"a ZeroMQ message of {len(frames)} frames is not a message of this bridge")


class Reassembler:
  """Joins frames into logical messages, refusing more than `max_bytes` per message."""

  def __init__(self, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
    self._max = max_bytes
    self._parts: List[bytes] = []
    self._size = 0

  def feed(self, frame: bytes) -> Optional[dict]:
    """Adds one frame; returns the decoded message when it was the last one, else None."""
    if not isinstance(frame, bytes) or not frame or frame[:1] not in (_FINAL, _MORE):
      raise BadMessage("frame must be bytes starting with a flag byte 0x00 or 0x01")
    self._size += len(frame) - 1
    if self._size > self._max:
      raise BadMessage(f"message exceeds max_message_bytes={self._max} (raise it with the "
                       "bridge's --max-message-mb / BridgeConfig.max_message_bytes)")
    if frame[:1] == _MORE:
      self._parts.append(frame[1:])
      return None
    if self._parts:
      self._parts.append(frame[1:])
      payload = b"".join(self._parts)
      self._parts, self._size = [], 0
    else:
      payload, self._size = frame[1:], 0
    return unpack(payload, self._max)


# ---------------------------------------------------------------- errors
# Error class name <-> exception class, both directions (only these names are accepted).
ERROR_CLASSES = {cls.__name__: cls for cls in (
    errors.InvalidArgumentError, errors.UnknownTableError, errors.DeadlineExceededError,
    errors.ResourceExhaustedError, errors.TableClosedError, errors.CorruptError,
    errors.ServerUnavailableError, errors.ReverbError)}


def error_name(exc: BaseException) -> str:
  """The wire name of `exc`: its nearest reverb_shm error class (ValueError -> InvalidArgument)."""
  for cls in type(exc).__mro__:
    if cls.__name__ in ERROR_CLASSES:
      return cls.__name__
  if isinstance(exc, (ValueError, TypeError, KeyError, IndexError)):
    return "InvalidArgumentError"
  return "ReverbError"


def make_error(name: Any, message: Any, **kwargs) -> errors.ReverbError:
  cls = ERROR_CLASSES.get(name, errors.ReverbError) if isinstance(name, str) else errors.ReverbError
  text = message if isinstance(message, str) else repr(message)
  if cls is errors.DeadlineExceededError:
    return cls(text, inserted=int(kwargs.get("inserted", 0)))
  return cls(text)


def fatal_error(reply: dict) -> Optional[errors.ReverbError]:
  """The error of an insert connection's reply {"fatal": [class, message]} (the bridge could
  not handle the message and ended the connection), else None."""
  fatal = reply.get("fatal")
  if fatal is None:
    return None
  if isinstance(fatal, list) and len(fatal) == 2:
    return make_error(*fatal)
  return errors.ReverbError(f"the bridge sent a malformed error {fatal!r}")
