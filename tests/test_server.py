"""Server: validation, port, lifetime of the segment, stop semantics, /dev/shm limits."""
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import shm

pytestmark = pytest.mark.timeout(60)


def _table(name="t", **kwargs):
  return reverb_shm.Table(name, selectors.Uniform(), selectors.Fifo(), 100,
                          rate_limiters.MinSize(1), **kwargs)


def test_requires_tables_with_unique_names(server_factory):
  with pytest.raises(ValueError, match="At least one table"):
    server_factory([])
  with pytest.raises(ValueError, match=r"\['a'\]"):
    server_factory([_table("a"), _table("a"), _table("b")])


@pytest.mark.parametrize("name", ["", "a/b", "x" * 65, "sp ace", ".."])
def test_rejects_bad_server_names(server_factory, name):
  with pytest.raises(ValueError, match="server name"):
    server_factory([_table()], name=name)


def test_picks_port_and_default_name():
  server = reverb_shm.Server([_table()], arena_bytes=1 << 20)
  try:
    assert isinstance(server.port, int) and server.port > 0
    assert server.name == f"reverb_{server.port}"
    assert shm.resolve_address(f"localhost:{server.port}") == server.name
    assert shm.resolve_address(f"127.0.0.1:{server.port}") == server.name
    assert shm.resolve_address(f"shm://{server.name}") == server.name
  finally:
    server.stop()
  with pytest.raises(errors.ServerUnavailableError, match=str(server.port)):
    shm.resolve_address(f"localhost:{server.port}")


def test_port_in_use_is_value_error(server_factory):
  first = server_factory([_table()])
  with pytest.raises(ValueError, match=f"port {first.port}"):
    server_factory([_table()], port=first.port)


def test_segment_mode_0600_and_unlinked_after_stop(server_factory):
  server = server_factory([_table()])
  path = shm.segment_path(server.name)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
  server.stop()
  assert not os.path.exists(path)
  server.stop()  # idempotent
  with pytest.raises(errors.ServerUnavailableError, match=server.name):
    reverb_shm.SharedTable.attach(f"{server.name}/t")


def test_table_info_is_live_while_served(server_factory):
  table = _table()
  assert table.info.current_size == 0 and not table.can_sample(1)
  server = server_factory([table])
  server.shared_table("t").insert({"x": np.zeros((3, 2))}, 1.0)
  info = table.info
  assert info.current_size == 3 and info.rate_limiter_info.insert_stats.completed == 3
  assert info.sampler_options.uniform and info.remover_options.fifo
  assert table.can_sample(1)
  assert table.replace(max_size=5).info.max_size == 5


def test_stop_wakes_blocked_sampler_thread(server_factory):
  server = server_factory([_table()])
  st = server.shared_table("t")
  result = {}
  started = threading.Event()

  def sample():
    started.set()
    try:
      st.sample(1)
    except Exception as e:  # pylint: disable=broad-except
      result["error"] = e

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  started.wait(5)
  thread.join(0.3)
  assert thread.is_alive()  # blocked on the rate limiter
  server.stop()
  thread.join(5)
  assert not thread.is_alive()
  assert isinstance(result.get("error"), errors.TableClosedError)
  assert isinstance(result["error"], RuntimeError)
  assert "closed" in str(result["error"]).lower()


def test_full_dev_shm_is_a_clear_error(server_factory, server_name):
  free = os.statvfs("/dev/shm")
  free_bytes = free.f_bavail * free.f_frsize
  name = server_name
  with pytest.raises(errors.ResourceExhaustedError, match=r"need .* MiB, /dev/shm has .* MiB free"):
    server_factory([_table()], name=name, arena_bytes=free_bytes + (1 << 30))
  assert not os.path.exists(shm.segment_path(name))


def _serve_forever(name, ready):
  reverb_shm.Server([_table()], name=name, arena_bytes=1 << 20)
  ready.set()
  signal.pause()


def test_stale_segment_of_dead_owner_is_reclaimed(server_factory, server_name):
  name = server_name
  ctx = multiprocessing.get_context("fork")
  ready = ctx.Event()
  child = ctx.Process(target=_serve_forever, args=(name, ready))
  child.start()
  try:
    assert ready.wait(20)
    with pytest.raises(errors.SegmentInUseError, match=str(child.pid)):
      server_factory([_table()], name=name)
  finally:
    child.kill()
    child.join(10)
  assert os.path.exists(shm.segment_path(name))  # left behind by the killed owner
  server = server_factory([_table()], name=name)
  assert server.shared_table("t").size == 0
  # The dead owner's port alias was pruned when the new server registered its port.
  aliases = [shm._read_alias(os.path.join("/dev/shm", e))  # pylint: disable=protected-access
             for e in os.listdir("/dev/shm") if e.startswith("rvshm.port.")]
  assert all(a is None or a[1] != child.pid for a in aliases)


@pytest.mark.timeout(60)
def test_script_ending_without_stop_leaves_no_segment(server_name):
  code = (
      "import reverb_shm as r\n"
      "t = r.Table('t', r.selectors.Uniform(), r.selectors.Fifo(), 10, r.rate_limiters.MinSize(1))\n"
      f"s = r.Server([t], name={server_name!r}, arena_bytes=1 << 20)\n"
      "print(s.port, flush=True)\n"
      "raise RuntimeError('script dies without calling stop()')\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
  assert proc.returncode == 1 and "script dies" in proc.stderr
  port = int(proc.stdout.split()[0])
  assert not os.path.exists(f"/dev/shm/rvshm.{server_name}")
  assert not os.path.exists(f"/dev/shm/rvshm.port.{port}")
