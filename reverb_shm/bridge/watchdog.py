"""Cancels remote calls that are still waiting for the bridge past a deadline.

A bridge that stops answering without closing its connections (a stopped or wedged process, a
network partition that drops packets) leaves a waiting gRPC call blocked until keepalive gives
up on the connection, and a reconnection attempt can then block again. Calls that have a
timeout register their deadline here; one daemon thread per process cancels the calls whose
deadline passed (checking every PERIOD_S), which ends their wait with a CANCELLED status that
the caller turns into a clear error.
"""
import itertools
import os
import threading
import time
from typing import Callable, Dict, Optional, Tuple

PERIOD_S = 0.1   # how often the thread looks at the deadlines (their precision)


class Watchdog:
  """Deadlines (time.monotonic() seconds) of waiting calls, each with its cancel function."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._calls: Dict[int, Tuple[float, Callable[[], None]]] = {}
    self._tokens = itertools.count(1)
    self._wake = threading.Event()
    self._pid: Optional[int] = None   # the process whose thread runs (a fork child starts its own)

  def watch(self, deadline: float, cancel: Callable[[], None]) -> int:
    """Calls `cancel()` (from the watchdog thread) once time.monotonic() passes `deadline`,
    unless `unwatch` comes first. Returns the token for `unwatch`."""
    token = next(self._tokens)
    with self._lock:
      self._calls[token] = (deadline, cancel)
      if self._pid != os.getpid():
        self._pid = os.getpid()
        self._wake = threading.Event()
        threading.Thread(target=self._run, name="reverb_shm-bridge-watchdog",
                         daemon=True).start()
    self._wake.set()
    return token

  def unwatch(self, token: int) -> bool:
    """Stops watching; False if the call was cancelled (its deadline passed) before."""
    with self._lock:
      return self._calls.pop(token, None) is not None

  def _run(self) -> None:
    wake = self._wake
    while True:
      wake.wait()
      time.sleep(PERIOD_S)
      now = time.monotonic()
      with self._lock:
        due = [t for t, (deadline, _) in self._calls.items() if deadline <= now]
        cancels = [self._calls.pop(t)[1] for t in due]
        if not self._calls:
          wake.clear()
      for cancel in cancels:
        try:
          cancel()
        except Exception:  # pylint: disable=broad-except  (a call that ended meanwhile)
          pass


WATCHDOG = Watchdog()
