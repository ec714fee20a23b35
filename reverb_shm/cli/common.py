"""What every `reverb-shm` sub-command shares: naming a server, output, logging, signals.

A server is named on the command line by its name, 'shm://NAME', or the 'HOST:PORT' address a
Reverb user knows ('localhost:PORT' of a server on this host, or the address of a gRPC bridge
where a sub-command can work through one).
"""
import contextlib
import faulthandler
import json
import logging
import os
import select
import signal
import sys
from typing import Callable, Optional, Tuple

from reverb_shm import errors
from reverb_shm._checkpoint import io as checkpoint_io
from reverb_shm._internal import addresses, shm

TARGET_HELP = ("the server: its name, shm://NAME, or localhost:PORT (the address clients use; "
               "any HOST:PORT naming this host)")
REMOTE_TARGET_HELP = TARGET_HELP[:-1] + "; or HOST:PORT of a gRPC bridge)"


def locate(target: str, command: str, remote_ok: bool = False) -> Tuple[str, str]:
  """('local', server name) or ('remote', bridge address) for a command-line TARGET.

  Raises:
    ValueError: a malformed target, or a remote one for a command that needs shared memory.
    ServerUnavailableError: a local address with no server registered on its port.
  """
  if target.startswith("shm://"):
    return "local", shm.validate_server_name(target[len("shm://"):])
  if ":" not in target:
    return "local", shm.validate_server_name(target)
  host, port = addresses.split(target)
  if addresses.is_local(target):
    if not shm.port_is_registered(port):
      raise errors.ServerUnavailableError(
          f"no reverb_shm server is registered on port {port} of this host (address {target!r})")
    return "local", shm.resolve_address(target)
  if not remote_ok:
    where = "another host" if not shm.is_local_host(host) else (
        f"a port of this host where no reverb_shm server is registered (something else listens "
        f"on port {port}: a gRPC bridge, or another service)")
    raise ValueError(f"{target!r} is {where}; `reverb-shm {command}` reads the server's shared "
                     "memory: run it on the server's host with the server's name or "
                     "localhost:PORT")
  return "remote", target


def local_name(target: str, command: str) -> str:
  """The name of the local server TARGET names (see locate)."""
  return locate(target, command)[1]


def emit_json(obj) -> None:
  """Writes obj as indented JSON on stdout."""
  json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
  sys.stdout.write("\n")


def run_quietly_on_broken_pipe(fn: Callable[[], int]) -> int:
  """fn()'s exit code; when stdout's reader went away (`reverb-shm info X | head`), exit 141
  (128 + SIGPIPE, as a tool killed by SIGPIPE) without a traceback."""
  try:
    code = fn()
    sys.stdout.flush()
    return code
  except BrokenPipeError:
    # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


class _StderrHandler(logging.StreamHandler):
  """Writes to whatever sys.stderr is at the time of each record."""

  stream = property(lambda self: sys.stderr, lambda self, value: None)


def setup_logging(level: str = "INFO") -> None:
  """One stderr handler for reverb_shm's loggers (replacing one set before); on a terminal
  with tqdm installed, checkpoint and restore progress draws bars instead of log lines."""
  handler = _StderrHandler()
  handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                         "%Y-%m-%d %H:%M:%S"))
  logger = logging.getLogger("reverb_shm")
  logger.handlers[:] = [h for h in logger.handlers if not isinstance(h, _StderrHandler)]
  logger.addHandler(handler)
  logger.setLevel(getattr(logging, level.upper()))
  if sys.stderr.isatty():
    factory = tqdm_progress_factory()
    if factory is not None:
      checkpoint_io.set_progress_factory(factory)


def tqdm_progress_factory() -> Optional[Callable]:
  """prefix -> a checkpoint Progress callback drawing tqdm bars; None without tqdm."""
  try:
    import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None

  def factory(prefix: str):
    bars: dict = {}

    def report(phase: str, done: int, total: int) -> None:
      bar = bars.get(phase)
      if bar is None:
        scale = phase != "items"
        bar = bars[phase] = tqdm.tqdm(total=total, desc=f"{prefix}: {phase}",
                                      unit="B" if scale else "item", unit_scale=scale,
                                      unit_divisor=1024, file=sys.stderr, leave=False)
      bar.update(done - bar.n)
      if done >= total:
        bar.close()

    return report

  return factory


class StopSignals:
  """Turns SIGINT and SIGTERM into a flag for a serving loop (restored on exit).

  Usage: `with StopSignals() as stop: while not stop.wait(0.5): ...`; `stop.signal_name` says
  which signal ended the loop. While inside, SIGUSR1 prints every thread's stack on stderr (a
  serving process that does not stop can be asked where it is). The handler takes no lock (a
  threading.Event set from a signal handler can deadlock when the signal lands while the main
  thread holds the Event's lock inside its own wait()): it sets a flag and writes a byte to a
  pipe that wait() selects on.
  """

  def __init__(self):
    self._stopped = False
    self._read_fd, self._write_fd = os.pipe()
    os.set_blocking(self._write_fd, False)
    self._previous = {}
    self._dumps = False
    self.signal_name = None

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    self.signal_name = signal.Signals(signum).name
    self._stopped = True
    with contextlib.suppress(OSError):   # (a full pipe: a byte is waiting already)
      os.write(self._write_fd, b"\0")

  def wait(self, timeout: float) -> bool:
    """True once a stop signal came; else waits up to `timeout` seconds for one."""
    if not self._stopped:
      select.select([self._read_fd], [], [], timeout)
    return self._stopped

  def __enter__(self):
    for sig in (signal.SIGINT, signal.SIGTERM):
      self._previous[sig] = signal.signal(sig, self._handle)
    try:
      faulthandler.register(signal.SIGUSR1, all_threads=True)
      self._dumps = True
    except (AttributeError, ValueError, OSError):   # (a stderr without a file descriptor)
      self._dumps = False
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      with contextlib.suppress(ValueError, TypeError):
        signal.signal(sig, handler)
    if self._dumps:
      faulthandler.unregister(signal.SIGUSR1)
    os.close(self._read_fd)
    os.close(self._write_fd)
