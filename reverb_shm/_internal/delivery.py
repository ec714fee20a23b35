"""Background delivery of a TrajectoryWriter's items: one daemon thread per process.

A writer batches the window items that create_item makes (one C call inserts a batch) and queues
the items that their table's rate limiter does not admit yet. Without help, both would wait for
the writer's next call. This thread, woken when a writer starts a batch or leaves items queued:
  * inserts a batch that has waited _BATCH_DELAY_S (a writer creating items quickly fills its
    batches before that, so the thread rarely touches it: the batched speed stays);
  * retries queued items whenever a table they wait for changes (a sample, delete or reset
    that may let its rate limiter admit them), so a sampler waiting for them gets them with no
    further writer call: one watcher thread per such table sleeps in the C core on the table's
    change counter (rs_table_wait_change), no polling; it looks again every _WATCH_SLICE_S
    (a server SIGKILLed in another process wakes nobody);
  * delivers the items a writer still queued when it was closed (close() hands them over);
  * at interpreter exit, waits up to _EXIT_WAIT_S for every writer's items, then warns about
    any it had to drop.
It works on a writer only while no call of its owner is in progress (hot.writer_claim: the owner's
next call waits for it), and then only without blocking: the C inserts are made with deadline 0.

Fork: a child starts with nothing registered and no thread (writers made before a fork are
unusable in the child); a claim held at fork time is dropped in the child (csrc/hot/hot_writer.c).
"""
import atexit
import math
import os
import threading
import time
import warnings
import weakref
from typing import Any, Dict

from reverb_shm import errors
from reverb_shm._internal import timeouts
from reverb_shm._internal._lib import check, ffi, hot, lib

__all__ = ["notify", "adopt"]

_BATCH_DELAY_S = 0.02     # a batch older than this is inserted by the thread
_CLAIM_RETRY_S = 0.005    # the owner was inside a call: look again after this
_WATCH_SLICE_S = 1.0      # a table watcher's longest sleep before it has its writers look again
_WAITING = math.inf       # the due time of a writer whose tables are watched
_EXIT_WAIT_S = 5.0        # at interpreter exit, the wait for every writer's items together


class _TableWatch:
  """A thread that sleeps until a table changes and then makes the writers waiting for it due.

  `waiting` maps writer ids to the table's change counter read before their last try: a
  writer whose counter is out of date is due at once (the table changed since it tried).
  """

  def __init__(self, delivery: "_Delivery", table):
    self.delivery = delivery
    self.table = table          # (keeps the segment mapped while the thread sleeps on it)
    self.waiting: Dict[Any, Any] = {}
    self.thread = threading.Thread(target=self._run, name="reverb_shm-delivery-watch",
                                   daemon=True)

  def _run(self) -> None:
    d = self.delivery
    base, index = self.table.segment.base, self.table.index
    seq = ffi.new("uint32_t *")
    while True:
      with d.cond:
        if d.stopping or not self.waiting or lib.rs_table_seq(base, index, seq) != 0:
          d.watches.pop(self.key, None)
          d.make_due(list(self.waiting))
          return
        changed = [key for key, seen in self.waiting.items() if seen != seq[0]]
        if changed:
          d.make_due(changed)
          for key in changed:
            del self.waiting[key]
          continue
        seen = seq[0]
      rc = lib.rs_table_wait_change(base, index, seen,
                                    timeouts.deadline_from_ms(_WATCH_SLICE_S * 1000))
      if rc == lib.RS_ETIMEDOUT:   # nothing happened for a while: the writers look again
        with d.cond:               # (their next try finds a dead or stopped server)
          d.make_due(list(self.waiting))
          self.waiting.clear()

  @property
  def key(self):
    return (id(self.table.segment), self.table.index)


class _Delivery:
  """Writers with items to deliver: id -> [weakref (strong ref once closed), due time], and
  the table watchers of the writers whose items wait for a rate limiter."""

  def __init__(self):
    self.cond = threading.Condition(threading.Lock())
    self.writers = {}
    self.watches = {}     # (id(segment), table index) -> _TableWatch
    self.thread = None
    self.stopping = False

  def make_due(self, keys) -> None:
    """(with self.cond held) the writers `keys` are due now."""
    now = time.monotonic()
    for key in keys:
      entry = self.writers.get(key)
      if entry is not None:
        entry[1] = min(entry[1], now)
    if keys:
      self.cond.notify()

  def watch(self, key, tables) -> None:
    """Writer `key` is due again once one of `tables` ((table, change counter) pairs) changes
    (at once if one has changed already)."""
    seq = ffi.new("uint32_t *")
    with self.cond:
      if key not in self.writers or self.stopping:
        return
      for table, seen in tables:
        if lib.rs_table_seq(table.segment.base, table.index, seq) != 0 or seq[0] != seen:
          self.make_due([key])   # changed since the writer's try (a sleeping watcher may
          return                 # be waiting on the newer counter and would not wake)
      for table, seen in tables:
        wkey = (id(table.segment), table.index)
        w = self.watches.get(wkey)
        if w is None:
          w = self.watches[wkey] = _TableWatch(self, table)
          w.waiting[key] = seen
          w.thread.start()
        else:
          w.waiting[key] = seen

  def notify(self, writer, delay: float) -> None:
    due = time.monotonic() + delay
    with self.cond:
      entry = self.writers.get(id(writer))
      if entry is not None and entry[0]() is writer:
        if entry[1] <= due:
          return   # the thread looks at this writer soon enough: no wake-up
        entry[1] = due
      else:
        self.writers[id(writer)] = [weakref.ref(writer), due]
      if self.thread is None and not self.stopping:
        self.thread = threading.Thread(target=self._run, name="reverb_shm-delivery", daemon=True)
        self.thread.start()
        atexit.register(self.at_exit)   # after any Server's: runs before servers stop
      self.cond.notify()

  def adopt(self, writer) -> None:
    """A closed writer's queued items: delivered here (a strong reference keeps it)."""
    self.notify(writer, 0.0)
    with self.cond:
      self.writers[id(writer)][0] = lambda: writer

  def _run(self) -> None:
    while True:
      with self.cond:
        while not self.stopping:
          now = time.monotonic()
          due = min((e[1] for e in self.writers.values()), default=_WAITING)
          if due <= now:
            break
          self.cond.wait(None if due == _WAITING else due - now)
        if self.stopping:
          return
        now = time.monotonic()
        ready = [(key, e[0]()) for key, e in self.writers.items() if e[1] <= now]
        for key, _ in ready:   # a notify() during the try below makes it due again
          self.writers[key][1] = _WAITING
      for key, writer in ready:
        delay = None if writer is None else self._deliver(writer, key)
        with self.cond:
          entry = self.writers.get(key)
          if entry is None or entry[0]() is not writer:
            continue
          if delay is None and entry[1] == _WAITING:
            del self.writers[key]
          elif delay is not None and delay is not _WAITING:
            entry[1] = min(entry[1], time.monotonic() + delay)
      ready.clear()   # no reference outlives the round
      writer = None

  def _deliver(self, writer, key):
    """Inserts what `writer`'s tables admit now; the delay before the next try, None when
    nothing is left (or the writer cannot be served: its owner sees why at its next call), or
    _WAITING once the tables its items wait for are watched."""
    if not hot.writer_claim(writer):
      return _CLAIM_RETRY_S
    try:
      writer._deliver_now()  # pylint: disable=protected-access
      if not writer._undelivered():  # pylint: disable=protected-access
        return None
      tables = _change_counters(writer._pending)  # pylint: disable=protected-access
      writer._deliver_now()   # (a change after the counters were read wakes the watch)  # pylint: disable=protected-access
      if not writer._undelivered():  # pylint: disable=protected-access
        return None
    except errors.ReverbError:
      return None   # server stopped, invalid item: the owner's next call raises it
    finally:
      hot.writer_unclaim(writer)
    self.watch(key, tables)
    return _WAITING

  def at_exit(self) -> None:
    """Waits up to _EXIT_WAIT_S for every writer's items, then warns about what is left."""
    with self.cond:
      self.stopping = True
      self.cond.notify()
      thread = self.thread
    if thread is not None and thread is not threading.current_thread():
      thread.join(1.0)   # it holds no writer once it has seen `stopping`
    with self.cond:
      writers = [e[0]() for e in self.writers.values()]
      self.writers.clear()
    deadline = time.monotonic() + _EXIT_WAIT_S
    dropped = 0
    for writer in writers:
      if writer is None:
        continue
      left = max(0.0, deadline - time.monotonic())
      if hot.writer_claim(writer):
        try:
          writer._deliver_now(  # pylint: disable=protected-access
              timeouts.deadline_from_ms(left * 1000))
        except errors.ReverbError:
          pass
        finally:
          hot.writer_unclaim(writer)
      dropped += writer._undelivered()  # pylint: disable=protected-access
    if dropped:
      warnings.warn(f"{dropped} items of TrajectoryWriters were still held back by their rate "
                    f"limiters at interpreter exit after waiting {_EXIT_WAIT_S} s; they were "
                    "dropped (flush() the writers before exiting to wait for them)",
                    RuntimeWarning, stacklevel=1)

  def reset_in_child(self) -> None:
    type(self).__init__(self)


def _change_counters(pending) -> list:
  """(table, its change counter now) for each distinct table of the queued items `pending`.

  Raises:
    ReverbError: a table index the C core rejects (never for a live writer's tables).
  """
  tables: Dict[Any, Any] = {}
  for item in pending:
    tables.setdefault((id(item.table.segment), item.table.index), item.table)
  seq = ffi.new("uint32_t *")
  out = []
  for table in tables.values():
    check(lib.rs_table_seq(table.segment.base, table.index, seq), "reading a table's counter")
    out.append((table, seq[0]))
  return out


_DELIVERY = _Delivery()


def notify(writer, delay: float = _BATCH_DELAY_S) -> None:
  """`writer` has a new batch (deliver it after `delay` s unless its owner does first) or, with
  delay 0, items queued behind a rate limiter."""
  _DELIVERY.notify(writer, delay)


def adopt(writer) -> None:
  """Delivers the items closed `writer` still queues, whose pins it keeps until then."""
  _DELIVERY.adopt(writer)


os.register_at_fork(after_in_child=_DELIVERY.reset_in_child)
