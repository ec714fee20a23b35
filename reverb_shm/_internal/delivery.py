"""Background delivery of a TrajectoryWriter's items: one daemon thread per process.

A writer batches the window items that create_item makes (one C call inserts a batch) and queues
the items that their table's rate limiter does not admit yet. Without help, both would wait for
the writer's next call. This thread, woken when a writer starts a batch or leaves items queued:
  * inserts a batch that has waited _BATCH_DELAY_S (a writer creating items quickly fills its
    batches before that, so the thread rarely touches it: the batched speed stays);
  * retries queued items every _RETRY_MIN_S doubling to _RETRY_MAX_S while the rate limiter
    holds them back, so a sampler waiting for them gets them with no further writer call;
  * delivers the items a writer still queued when it was closed (close() hands them over);
  * at interpreter exit, waits up to _EXIT_WAIT_S for every writer's items, then warns about
    any it had to drop.
It works on a writer only while no call of its owner is in progress (hot.writer_claim: the owner's
next call waits for it), and then only without blocking: the C inserts are made with deadline 0.

Fork: a child starts with nothing registered and no thread (writers made before a fork are
unusable in the child); a claim held at fork time is dropped in the child (csrc/hot/hot_writer.c).
"""
import atexit
import os
import threading
import time
import warnings
import weakref

from reverb_shm import errors
from reverb_shm._internal import timeouts
from reverb_shm._internal._lib import hot

__all__ = ["notify", "adopt"]

_BATCH_DELAY_S = 0.02     # a batch older than this is inserted by the thread
_RETRY_MIN_S = 0.002      # first retry of items the rate limiter held back ...
_RETRY_MAX_S = 0.05       # ... doubling up to this
_CLAIM_RETRY_S = 0.005    # the owner was inside a call: look again after this
_EXIT_WAIT_S = 5.0        # at interpreter exit, the wait for every writer's items together


class _Delivery:
  """Writers with items to deliver: id -> [weakref (strong ref once closed), due time, retry]."""

  def __init__(self):
    self.cond = threading.Condition(threading.Lock())
    self.writers = {}
    self.thread = None
    self.stopping = False

  def notify(self, writer, delay: float) -> None:
    due = time.monotonic() + delay
    with self.cond:
      entry = self.writers.get(id(writer))
      if entry is not None and entry[0]() is writer:
        if entry[1] <= due:
          return   # the thread looks at this writer soon enough: no wake-up
        entry[1] = due
      else:
        self.writers[id(writer)] = [weakref.ref(writer), due, _RETRY_MIN_S]
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
          due = min((e[1] for e in self.writers.values()), default=None)
          if due is not None and due <= now:
            break
          self.cond.wait(None if due is None else due - now)
        if self.stopping:
          return
        now = time.monotonic()
        ready = [(key, e[0]()) for key, e in self.writers.items() if e[1] <= now]
      for key, writer in ready:
        delay = None if writer is None else self._deliver(writer, key)
        with self.cond:
          entry = self.writers.get(key)
          if entry is None or entry[0]() is not writer:
            continue
          if delay is None:
            del self.writers[key]
          else:
            entry[1] = time.monotonic() + delay
      ready.clear()   # no reference outlives the round
      writer = None

  def _deliver(self, writer, key):
    """Inserts what `writer`'s tables admit now; the delay before the next try, or None when
    nothing is left (or the writer cannot be served: its owner sees why at its next call)."""
    if not hot.writer_claim(writer):
      return _CLAIM_RETRY_S
    try:
      writer._deliver_now()  # pylint: disable=protected-access
    except errors.ReverbError:
      return None   # server stopped, invalid item: the owner's next call raises it
    finally:
      hot.writer_unclaim(writer)
    if not writer._undelivered():  # pylint: disable=protected-access
      return None
    with self.cond:
      entry = self.writers.get(key)
      retry = _RETRY_MIN_S if entry is None else entry[2]
      if entry is not None:
        entry[2] = min(retry * 2, _RETRY_MAX_S)
    return retry

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


_DELIVERY = _Delivery()


def notify(writer, delay: float = _BATCH_DELAY_S) -> None:
  """`writer` has a new batch (deliver it after `delay` s unless its owner does first) or, with
  delay 0, items queued behind a rate limiter."""
  _DELIVERY.notify(writer, delay)


def adopt(writer) -> None:
  """Delivers the items closed `writer` still queues, whose pins it keeps until then."""
  _DELIVERY.adopt(writer)


os.register_at_fork(after_in_child=_DELIVERY.reset_in_child)
