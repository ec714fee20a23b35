"""Notices the death of the server processes whose segments this process has attached.

One daemon thread per process waits, with the GIL released, in poll(2) on a pidfd of each
watched server process (Linux >= 5.3), so a SIGKILLed server is noticed within milliseconds
and nothing runs while every server lives. Where pidfds are unavailable it checks the
servers' /proc entries every _FALLBACK_POLL_S instead. A server of another pid namespace
(its pid means nothing here) is watched through its liveness lock (`locked`, see shm.py),
probed every _FALLBACK_POLL_S. On a death it calls the callbacks given to `watch` for that
server (with no lock held), once.

Fork: the child starts with nothing watched (its clients attach anew and watch again); the
parent's thread, pidfds and wake pipe are the parent's.
"""
import os
import select
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from reverb_shm._internal._lib import lib

__all__ = ["watch"]

_FALLBACK_POLL_S = 0.1   # /proc checks without pidfds


class _Watcher:
  """The watched servers of this process: pid (or ("lock", id of the probe) for a server of
  another pid namespace) -> (start time, pidfd or None, callbacks, liveness probe or None)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.owners: Dict[object, Tuple[int, Optional[int], List[Callable[[], None]],
                                    Optional[Callable[[], bool]]]] = {}
    self.thread: Optional[threading.Thread] = None
    # the wake-up pipe's (read, write) fds, made with the thread
    self.wake_r: Any = None
    self.wake_w: Any = None

  def watch(self, pid: int, start_time: int, callback: Callable[[], None],
            locked: Optional[Callable[[], bool]] = None) -> None:
    if locked is not None and lib.rs_proc_start_time(pid) != start_time and locked():
      # not a process of this pid namespace, yet alive: its liveness lock tells
      with self.lock:
        key = ("lock", id(locked))
        self.owners[key] = (start_time, None, [callback], locked)
        self._start(key)
      return
    with self.lock:
      entry = self.owners.get(pid)
      if entry is not None and entry[0] == start_time:
        entry[2].append(callback)
        return
      try:
        pidfd = os.pidfd_open(pid)
      except (AttributeError, OSError):   # no pidfds here, or the process is gone already
        pidfd = None
      self.owners[pid] = (start_time, pidfd, [callback], None)
      self._start(pid)
    # A pid reused between reading the segment header and pidfd_open: its start time differs.
    if lib.rs_proc_start_time(pid) != start_time:
      self._dead(pid)

  def _start(self, key) -> None:
    """Starts the thread, or wakes it to look at the watched set again (lock held). If the
    thread cannot start (RuntimeError), the new entry `key` is forgotten and nothing is left."""
    if self.thread is None:
      self.wake_r, self.wake_w = os.pipe()
      os.set_blocking(self.wake_w, False)
      thread = threading.Thread(target=self._run, name="reverb_shm-owner-watch", daemon=True)
      try:
        thread.start()
      except RuntimeError:
        pidfd = self.owners.pop(key)[1]
        for fd in (pidfd, self.wake_r, self.wake_w):
          if fd is not None:
            os.close(fd)
        self.wake_r = self.wake_w = None
        raise
      self.thread = thread
    else:
      self._wake()

  def _wake(self) -> None:
    try:
      os.write(self.wake_w, b"x")
    except BlockingIOError:   # the pipe is full: the thread wakes anyway
      pass

  def _run(self) -> None:
    while True:
      with self.lock:
        fds = {fd: pid for pid, (_, fd, _, _) in self.owners.items() if fd is not None}
        polled = any(fd is None for _, fd, _, _ in self.owners.values())
        wake_r = self.wake_r
      poller = select.poll()
      poller.register(wake_r, select.POLLIN)
      for fd in fds:
        poller.register(fd, select.POLLIN)
      try:
        events = poller.poll(_FALLBACK_POLL_S * 1000 if polled else None)
      except OSError:   # an fd closed under us (fork child reset): look again
        continue
      for fd, _ in events:
        if fd == wake_r:
          try:
            os.read(wake_r, 4096)
          except BlockingIOError:
            pass
        elif fd in fds:
          self._dead(fds[fd])
      if polled:
        with self.lock:
          watched = [(key, start, locked) for key, (start, fd, _, locked) in self.owners.items()
                     if fd is None]
        stale = [key for key, start, locked in watched
                 if (not locked() if locked is not None else lib.rs_proc_start_time(key) != start)]
        for pid in stale:
          self._dead(pid)

  def _dead(self, pid) -> None:
    with self.lock:
      entry = self.owners.pop(pid, None)
    if entry is None:
      return
    if entry[1] is not None:
      os.close(entry[1])
    for callback in entry[2]:
      try:
        callback()
      except Exception:  # pylint: disable=broad-except  (one bad listener must not stop others)
        pass

  def reset_in_child(self) -> None:
    # The parent's thread does not exist here; its fds are the parent's to close.
    for _, fd, _, _ in self.owners.values():
      if fd is not None:
        os.close(fd)
    for fd in (self.wake_r, self.wake_w):
      if fd is not None:
        os.close(fd)
    type(self).__init__(self)


_WATCHER = _Watcher()


def watch(pid: int, start_time: int, callback: Callable[[], None],
          locked: Optional[Callable[[], bool]] = None) -> None:
  """Calls `callback()` (from the watcher thread, once) when process `pid`, started at
  `start_time` (rs_proc_start_time's clock ticks), has exited; at once if it already has.

  `locked()`, if given, tells whether the process still holds its liveness lock: a process of
  another pid namespace (no such pid here) is then watched through it instead.
  """
  _WATCHER.watch(pid, start_time, callback, locked)


os.register_at_fork(after_in_child=_WATCHER.reset_in_child)
