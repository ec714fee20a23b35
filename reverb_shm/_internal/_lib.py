"""The compiled C core and the one place where its status codes become exceptions."""
from typing import NoReturn, Optional

from reverb_shm import _hot, errors  # noqa: F401  (_hot is re-exported as `hot`)
from reverb_shm._core import ffi, lib  # noqa: F401  (re-exported)

__all__ = ["ffi", "lib", "hot", "check", "last_error", "raise_for"]

# reverb_shm._hot (csrc/hot/) calls the core through these addresses: one copy of the core.
_hot.bind(tuple(int(ffi.cast("uintptr_t", ffi.addressof(lib, name)))
                for name in _hot.CORE_FUNCTIONS))
hot = _hot


def last_error() -> str:
  """The C core's message for the last failed call on this thread."""
  return ffi.string(lib.rs_last_error()).decode("utf-8", "replace")


_EXCEPTIONS = {
    lib.RS_EINVAL: errors.InvalidArgumentError,
    lib.RS_ENOSPC: errors.ResourceExhaustedError,
    lib.RS_ETIMEDOUT: errors.DeadlineExceededError,
    lib.RS_ECLOSED: errors.TableClosedError,
    lib.RS_ENOTFOUND: errors.UnknownTableError,
    lib.RS_ECORRUPT: errors.CorruptError,
    lib.RS_EFULL: errors.ResourceExhaustedError,
    lib.RS_ESYS: errors.SystemCallError,
    lib.RS_EDEADOWNER: errors.DeadOwnerError,
}


def raise_for(rc: int, context: str = "", not_found: type = errors.UnknownTableError,
              message: Optional[str] = None) -> NoReturn:
  """Raises the exception for status `rc` with `context` prefixed to the C message (`message`:
  the message another thread's failed call left, instead of this thread's last one)."""
  if message is None:
    message = last_error()
  if context:
    message = f"{context}: {message}" if message else context
  cls = not_found if rc == lib.RS_ENOTFOUND else _EXCEPTIONS.get(rc)
  if cls is None:
    raise errors.ReverbError(f"{message} (unexpected status {rc})")
  raise cls(message)


def check(rc: int, context: str = "", not_found: type = errors.UnknownTableError) -> int:
  """Returns `rc` when it is RS_OK, a positive value or RS_EAGAIN; raises otherwise.

  Args:
    rc: status returned by a C core function.
    context: what the caller was doing, prefixed to the message.
    not_found: exception class for RS_ENOTFOUND (it means "table" or "key" per call site).

  Raises:
    InvalidArgumentError (ValueError), ResourceExhaustedError (IndexError),
    DeadlineExceededError, TableClosedError (RuntimeError), UnknownTableError / `not_found`,
    CorruptError (RuntimeError), SystemCallError (OSError), DeadOwnerError (RuntimeError).
  """
  if rc >= 0 or rc == lib.RS_EAGAIN:
    return rc
  raise_for(rc, context, not_found)
