"""Exception classes of reverb_shm.

Every class derives from :class:`ReverbError` and, where Reverb surfaces a built-in exception,
from that built-in too, so callers may catch either family (docs/differences.md#errors).
"""
import builtins


class ReverbError(Exception):
  """Base class of every error raised by reverb_shm."""


class DeadlineExceededError(ReverbError):
  """A blocking call (rate limiter wait, flush, server_info) ran out of time.

  Attributes:
    inserted: for batched inserts (SharedTable.insert_descriptors), how many of the first items
      were inserted before the deadline; the others were not. 0 otherwise.
    keys: for StepInserter.flush, uint64[inserted] keys of the items that were inserted (in
      staging order); None otherwise.
  """

  def __init__(self, *args, inserted: int = 0, keys=None):
    super().__init__(*args)
    self.inserted = inserted
    self.keys = keys


class InvalidArgumentError(ReverbError, builtins.ValueError):
  """An argument was malformed (wrong type, dtype, shape, range)."""


class ArgumentTypeError(ReverbError, builtins.TypeError, builtins.ValueError):
  """An argument of the wrong type, or an integer outside its type's range, where Reverb's
  bindings raise TypeError; it is a ValueError too, as reverb_shm's other argument errors."""


class UnknownTableError(ReverbError, builtins.ValueError, builtins.RuntimeError, builtins.KeyError):
  """No table of that name exists; the message lists the tables that do.

  It is a ValueError (what Reverb raises on insert), a RuntimeError (sample / mutate / reset)
  and a KeyError (lookups by name).
  """

  def __str__(self):  # KeyError would repr-quote the message.
    return builtins.Exception.__str__(self)


class HistoryIndexError(ReverbError, builtins.IndexError, builtins.ValueError):
  """A writer history position or window outside the column's steps since its buffers were last
  cleared. An IndexError, and a ValueError as Reverb raises there (client code catches that)."""


class WriterClosedError(ReverbError, builtins.RuntimeError, builtins.ValueError):
  """A legacy Writer was used after close(): a RuntimeError as in Reverb (its context manager
  raises ValueError there, hence both)."""


class ResourceExhaustedError(ReverbError, builtins.IndexError):
  """A fixed capacity ran out: the chunk arena, process slots, pin log or /dev/shm."""


class TableClosedError(ReverbError, builtins.RuntimeError):
  """The table's server was stopped; blocked and later calls fail with this error."""


class CorruptError(ReverbError, builtins.RuntimeError):
  """A segment's header does not match this build, or an invariant check failed."""


class DeadOwnerError(ReverbError, builtins.RuntimeError):
  """The process owning the segment (the server) is dead."""


class ServerUnavailableError(ReverbError, builtins.RuntimeError):
  """No running server answers to the given name or address."""


class AccessDeniedError(ServerUnavailableError):
  """The server exists but belongs to another user (or group) whose segment this process may
  not open: waiting does not help, so calls that wait for a server raise it at once."""


class SegmentInUseError(ReverbError, builtins.FileExistsError):
  """A live server already owns a segment of that name."""


class SystemCallError(ReverbError, builtins.OSError):
  """A system call inside the C core failed (the message carries strerror)."""


_QUOTED_NAME_CHARS = 64   # table names hold at most 63 bytes, server names 64 characters
_QUOTED_NAME_START = 40


def quoted_name(name, plain: bool = False) -> str:
  """How an error message quotes a table or server name: repr(name), or for a str longer than
  64 characters (a bad argument: no valid name is that long) the repr of its first 40
  characters, '...' and its length, e.g. "'nnnn...'... (1000 characters)".

  Args:
    name: the name as given (any object; only a long str is abbreviated).
    plain: quote a short name as Reverb's own messages do ('{name}', unescaped).

  Returns:
    str, at most about 70 characters for any str name.
  """
  if isinstance(name, str) and len(name) > _QUOTED_NAME_CHARS:
    return f"{name[:_QUOTED_NAME_START]!r}... ({len(name)} characters)"
  return f"'{name}'" if plain else repr(name)
