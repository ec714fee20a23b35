"""Input validation and consistency found by a new user (tests/test_bad_input.py has the rest)."""
import os
import socket
import time
import warnings

import numpy as np
import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors, table as table_lib
from reverb_shm._internal import shm, timeouts
from reverb_shm._internal._lib import ffi, lib

from conftest import run_in_fork

pytestmark = pytest.mark.timeout(60)


def _table(name="t", max_size=10, limiter=None):
  return reverb_shm.Table(name, selectors.Uniform(), selectors.Fifo(), max_size,
                          limiter or rate_limiters.MinSize(1))


# ---- timeouts
@pytest.mark.parametrize("timeout_ms", [float("inf"), 1e30, 2**80])
def test_infinite_or_huge_timeout_waits_forever(timeout_ms):
  assert timeouts.deadline_from_ms(timeout_ms) == -1
  assert timeouts.deadline_from_ms(1e9) > time.monotonic_ns()    # 11.6 days is a deadline
  with pytest.raises(ValueError, match="timeout_ms must be None"):
    timeouts.deadline_from_ms(float("nan"))


def test_sample_with_infinite_timeout_samples(server_factory):
  client = server_factory([_table()]).localhost_client()
  client.insert(np.int32(7), {"t": 1.0})
  for timeout_ms in (float("inf"), 1e30):
    sample = next(client.sample("t", 1, rate_limiter_timeout_ms=timeout_ms))
    assert int(sample[0].data[0]) == 7


def test_client_insert_timeout(server_factory):
  client = server_factory([reverb_shm.Table.queue("q", 1)]).localhost_client()
  client.insert(1.0, {"q": 1.0}, timeout_ms=0)
  t0 = time.monotonic()
  with pytest.raises(errors.DeadlineExceededError):
    client.insert(2.0, {"q": 1.0}, timeout_ms=100)      # the queue is full
  assert 0.09 < time.monotonic() - t0 < 5
  with pytest.raises(ValueError, match="timeout_ms"):
    client.insert(2.0, {"q": 1.0}, timeout_ms=-1)
  assert float(next(client.sample("q", 1))[0].data[0]) == 1.0
  client.insert(3.0, {"q": 1.0}, timeout_ms=None)
  assert float(next(client.sample("q", 1))[0].data[0]) == 3.0


# ---- client arguments
def test_insert_of_an_int_beyond_64_bits_is_a_value_error(server_factory):
  client = server_factory([_table()]).localhost_client()
  with pytest.raises(ValueError, match=r"data leaf 1: integer 1180591620717411303424 does not fit"):
    client.insert([np.int32(1), 2**70], {"t": 1.0})
  assert client.server_info()["t"].current_size == 0


def test_mutate_priorities_argument_types(server_factory):
  client = server_factory([_table()]).localhost_client()
  client.insert(np.int32(1), {"t": 1.0})
  key = int(client.shared_table("t").items()[0]["key"])
  with pytest.raises(TypeError, match="deletes must be a sequence of item keys, got int"):
    client.mutate_priorities("t", deletes=5)
  with pytest.raises(TypeError, match="updates must be a dict item key -> priority, got list"):
    client.mutate_priorities("t", updates=[(key, 1.0)])
  assert client.mutate_priorities("t", deletes=(k for k in [key])) == (0, 1)


def test_this_hosts_own_ip_is_local(server_factory):
  server = server_factory([_table()])
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    try:   # the address of the interface that routes outwards; no packet is sent
      probe.connect(("192.0.2.1", 9))
      own_ip = probe.getsockname()[0]
    except OSError:
      pytest.skip("no non-loopback IPv4 interface")
  assert shm.is_local_host(own_ip) and shm.is_local_host("127.0.0.1")
  assert not shm.is_local_host("192.0.2.254") and not shm.is_local_host("example.invalid")
  client = reverb_shm.Client(f"{own_ip}:{server.port}")
  assert type(client) is reverb_shm.Client
  client.insert(np.int32(3), {"t": 1.0})
  assert server.shared_table("t").size == 1


# ---- configuration objects
@pytest.mark.parametrize("spi,error_buffer", [(float("inf"), 2.0), (float("nan"), 2.0),
                                              (1.0, float("inf")), (1.0, (0.0, float("inf"))),
                                              (1.0, float("nan"))])
def test_sample_to_insert_ratio_rejects_non_finite_numbers(spi, error_buffer):
  with pytest.raises(ValueError, match="finite"):
    rate_limiters.SampleToInsertRatio(spi, 1, error_buffer)


def test_rate_limiter_rejects_infinite_samples_per_insert():
  with pytest.raises(ValueError, match="samples_per_insert must be finite and > 0"):
    rate_limiters.RateLimiter(float("inf"), 1, -1.0, 1.0)


@pytest.mark.parametrize("exponent", [float("nan"), float("inf"), -0.5])
def test_prioritized_rejects_bad_exponents_at_construction(exponent):
  with pytest.raises(ValueError, match="priority_exponent must be finite and >= 0"):
    selectors.Prioritized(exponent)


def test_tensor_spec_dims():
  assert reverb_shm.TensorSpec([-1, None, 3], np.float32).shape == (None, None, 3)
  with pytest.raises(ValueError, match="invalid dimension -5"):
    reverb_shm.TensorSpec([2, -5], np.float32)


def test_table_max_size_limit_is_the_c_layouts():
  assert table_lib.MAX_SIZE == 2**30 - 2
  with pytest.raises(ValueError, match=r"max_size must be <= 1073741822 \(2\*\*30 - 2"):
    _table(max_size=table_lib.MAX_SIZE + 1)
  # The C core lays out exactly MAX_SIZE (sizing only: nothing is allocated).
  cfg = ffi.new("rs_table_config[1]")
  cfg[0].name = b"t"
  cfg[0].samples_per_insert, cfg[0].min_size_to_sample = 1.0, 1
  cfg[0].min_diff, cfg[0].max_diff = -1.0, 1.0
  for max_size, fits in ((table_lib.MAX_SIZE, True), (table_lib.MAX_SIZE + 1, False)):
    cfg[0].max_size = max_size
    assert (lib.rs_segment_size(cfg, 1, 4, 16, 1 << 20) > 0) == fits


def test_numpy_integers_are_taken_where_reverb_takes_ints():
  """As Reverb's bindings: numpy integer scalars where an int is wanted (a float, even 3.0, is
  an ArgumentTypeError: tests/test_bad_input.py); Queue / Stack sizes are numbers."""
  for value in (np.int64(3), np.int32(3), np.uint8(3), 3):
    limiters = [rate_limiters.MinSize(value), rate_limiters.SampleToInsertRatio(1.0, value, 10.0),
                rate_limiters.RateLimiter(1.0, value, -1.0, 1.0)]
    assert [(type(r.min_size_to_sample), r.min_size_to_sample) for r in limiters] == \
        [(int, 3)] * 3
    t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), value * 2,
                         rate_limiters.MinSize(1), max_times_sampled=value)
    assert (type(t.max_size), t.max_size, type(t.max_times_sampled), t.max_times_sampled) == \
        (int, 6, int, 3)
    assert reverb_shm.Table.queue("q", value).max_size == 3
  assert rate_limiters.MinSize(True).min_size_to_sample == 1   # (a bool is an int, as in Reverb)
  assert rate_limiters.Queue(2.5).max_diff == 2.5              # (Reverb's size is a float)
  assert rate_limiters.Stack(np.float64(4.0)).max_diff == 4.0
  assert _table(max_size=2**30 - 2).max_size == 2**30 - 2
  for bound in (2**31 - 1, -2**31):
    assert reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10,
                            rate_limiters.MinSize(1),
                            max_times_sampled=bound).max_times_sampled == bound


def test_min_size_above_max_size_warns():
  with pytest.warns(UserWarning, match=r"min_size_to_sample \(20\) > max_size \(10\)"):
    _table(limiter=rate_limiters.MinSize(20))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _table(limiter=rate_limiters.MinSize(10))


# ---- after stop, and Table reuse
def test_handles_after_stop_in_the_same_process_raise(server_factory):
  server = server_factory([_table()])
  client = server.localhost_client()
  st = server.shared_table("t")
  client.insert(np.int32(1), {"t": 1.0})
  assert client.server_info()["t"].current_size == 1 and st.size == 1
  server.stop()
  with pytest.raises(errors.DeadlineExceededError, match="no server answered"):
    client.server_info(timeout=0.1)
  with pytest.raises(errors.TableClosedError, match="closed"):
    st.size  # pylint: disable=pointless-statement
  with pytest.raises(errors.TableClosedError, match="closed"):
    st.info  # pylint: disable=pointless-statement
  with pytest.raises(errors.TableClosedError, match="closed"):
    st.check()
  with pytest.raises(errors.ServerUnavailableError):
    client.insert(np.int32(1), {"t": 1.0})


def test_a_table_serves_one_running_server_at_a_time(server_factory):
  table = _table()
  first = server_factory([table])
  with pytest.raises(ValueError, match=f"already belongs to running server '{first.name}'"):
    server_factory([table])
  second = server_factory([table.replace()])
  first.localhost_client().insert(np.int32(1), {"t": 1.0})
  assert second.shared_table("t").size == 0 and table.info.current_size == 1
  first.stop()
  third = server_factory([table])      # free again once its server stopped
  assert table.info.current_size == 0 and third.shared_table("t").size == 0


# ---- messages
def test_forked_child_using_the_parents_writer_is_told_about_the_fork(server_factory):
  server = server_factory([_table()])
  writer = server.localhost_client().trajectory_writer(2)
  writer.append({"x": np.int64(0)})
  parent = os.getpid()

  def child():
    writer.append({"x": np.int64(1)})
    writer.create_item("t", 1.0, {"x": writer.history["x"][-1:]})
    writer.flush()

  out = run_in_fork(child)
  assert out.startswith("ERR TableClosedError"), out
  assert f"belongs to process {parent}, which forked this process" in out
  assert "re-attach after fork" in out and "server stopped" not in out
  writer.close()


def test_full_process_slots_do_not_suggest_gc(server_factory):
  server = server_factory([_table()], max_procs=1)
  server.localhost_client().insert(np.int32(1), {"t": 1.0})   # this process takes the slot
  out = run_in_fork(lambda: server.localhost_client().insert(np.int32(1), {"t": 1.0}))
  assert "all 1 process slots are in use" in out and "raise max_procs" in out, out
  assert "gc" not in out
