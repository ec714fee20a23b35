"""Calls blocked by a rate limiter sleep as SCHED_BATCH and get their own policy back.

A woken SCHED_BATCH thread does not preempt the thread running on the CPU it wakes on (see
docs/concepts/concurrency.md); these tests watch a blocked thread's policy from outside, by
its thread id, while it sleeps, and read it again after the call returned."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling")]


def _queue_table(server_factory):
  table = reverb_shm.Table("t", selectors.Fifo(), selectors.Fifo(), 100, rate_limiters.Queue(2))
  return server_factory([table]).shared_table("t")


def _insert(st, n):
  st.insert({"x": np.zeros((n, 1), np.float32)}, np.ones(n), timeout_ms=0)


def _blocked(call, setup=None):
  """Starts `call` in a thread (after `setup` there); returns (thread, record), where record
  gets the thread's id, the outcome and its policy and nice value after the call."""
  record = {}

  def run():
    if setup:
      setup()
    record["tid"] = threading.get_native_id()
    try:
      record["result"] = call()
    except Exception as e:  # pylint: disable=broad-except
      record["error"] = e
    record["after"] = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return thread, record


def _policy_while_blocked(record, want, timeout=10.0):
  """The blocked thread's policy, polled until it is `want` (or the timeout)."""
  end = time.monotonic() + timeout
  policy = None
  while time.monotonic() < end:
    if "tid" in record and "after" not in record:
      policy = os.sched_getscheduler(record["tid"])
      if policy == want:
        return policy
    time.sleep(0.002)
  return policy


def test_blocked_sample_sleeps_as_batch_and_gets_its_policy_back(server_factory):
  st = _queue_table(server_factory)
  thread, record = _blocked(lambda: st.sample_records(1, timeout_ms=20_000))
  assert _policy_while_blocked(record, os.SCHED_BATCH) == os.SCHED_BATCH
  _insert(st, 1)
  thread.join(timeout=20)
  assert not thread.is_alive() and "error" not in record, record
  assert len(record["result"][0]) == 1
  assert record["after"][0] == os.SCHED_OTHER


def test_blocked_insert_sleeps_as_batch_and_keeps_its_nice_value(server_factory):
  st = _queue_table(server_factory)
  _insert(st, 2)   # the queue is full: the next insert waits for a sample

  def nicer():
    os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 3)
  nice_before = os.getpriority(os.PRIO_PROCESS, 0)
  thread, record = _blocked(lambda: _insert_blocking(st), setup=nicer)
  assert _policy_while_blocked(record, os.SCHED_BATCH) == os.SCHED_BATCH
  assert os.getpriority(os.PRIO_PROCESS, record["tid"]) == nice_before + 3
  st.sample_records(1, timeout_ms=0)
  thread.join(timeout=20)
  assert not thread.is_alive() and "error" not in record, record
  assert record["after"] == (os.SCHED_OTHER, nice_before + 3)
  assert st.stats()["size"] == 3   # (nothing removed: the table has no max_times_sampled)


def _insert_blocking(st):
  st.insert({"x": np.zeros((1, 1), np.float32)}, np.ones(1), timeout_ms=20_000)


def test_a_thread_the_application_made_idle_keeps_its_policy(server_factory):
  st = _queue_table(server_factory)

  def idle():
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
  thread, record = _blocked(lambda: st.sample_records(1, timeout_ms=20_000), setup=idle)
  time.sleep(0.2)   # long enough to be asleep; its policy must never change
  assert _policy_while_blocked(record, os.SCHED_IDLE, timeout=1.0) == os.SCHED_IDLE
  _insert(st, 1)
  thread.join(timeout=20)
  assert not thread.is_alive() and "error" not in record, record
  assert record["after"][0] == os.SCHED_IDLE


def test_a_timed_out_wait_restores_the_policy(server_factory):
  st = _queue_table(server_factory)
  thread, record = _blocked(lambda: st.sample_records(1, timeout_ms=300))
  thread.join(timeout=20)
  assert isinstance(record.get("error"), reverb_shm.DeadlineExceededError), record
  assert record["after"][0] == os.SCHED_OTHER


_CHILD = """
import os, sys, threading, time
import numpy as np
import reverb_shm
from reverb_shm import rate_limiters, selectors
table = reverb_shm.Table("t", selectors.Fifo(), selectors.Fifo(), 100, rate_limiters.Queue(2))
with reverb_shm.Server([table], arena_bytes=8 << 20) as server:
  st = server.shared_table("t")
  seen = []
  def sample():
    seen.append(threading.get_native_id())
    st.sample_records(1, timeout_ms=20_000)
  t = threading.Thread(target=sample)
  t.start()
  while not seen:
    time.sleep(0.001)
  time.sleep(0.3)   # asleep in the limiter wait by now
  policy = os.sched_getscheduler(seen[0])
  st.insert({"x": np.zeros((1, 1), np.float32)}, np.ones(1), timeout_ms=0)
  t.join(timeout=20)
  print("POLICY", policy)
"""


def test_environment_turns_batch_sleeping_off():
  env = dict(os.environ, REVERB_SHM_BATCH_WAITS="0")
  out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                       timeout=60)
  assert out.returncode == 0, out.stderr
  assert f"POLICY {os.SCHED_OTHER}" in out.stdout, out.stdout
