"""Prometheus export: scraped over loopback, parsed with prometheus_client's parser, values
checked against a known workload."""
import urllib.request

import numpy as np
import pytest

import reverb_shm as reverb
from reverb_shm import rate_limiters, selectors

parser = pytest.importorskip("prometheus_client.parser")
from reverb_shm.metrics import METRICS, MetricsExporter  # noqa: E402


def scrape(port):
  """{(sample name, frozenset(labels)): value} of one scrape of http://127.0.0.1:port/metrics."""
  text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
  samples = {}
  for family in parser.text_string_to_metric_families(text):
    for s in family.samples:
      samples[(s.name, frozenset(s.labels.items()))] = s.value
  return samples


def _tables():
  return [reverb.Table("t", selectors.Uniform(), selectors.Fifo(), 10, rate_limiters.MinSize(1)),
          reverb.Table("p", selectors.Prioritized(1.0), selectors.Fifo(), 100,
                       rate_limiters.MinSize(1))]


def test_server_metrics_port_serves_known_counts(server_factory):
  srv = server_factory(_tables(), metrics_port=0)
  client = srv.localhost_client()
  for i in range(12):
    client.insert(np.float32([i, i, i]), {"t": 1.0, "p": 1.0})
  list(client.sample("t", num_samples=5))
  keys = client.shared_table("p").items()["key"]
  client.mutate_priorities("p", updates={int(keys[0]): 3.0}, deletes=[int(keys[1])])
  got = scrape(srv.metrics_port)

  def v(name, table=None):
    labels = {"server": srv.name}
    if table:
      labels["table"] = table
    return got[(name, frozenset(labels.items()))]

  assert v("reverb_shm_up") == 1
  assert v("reverb_shm_table_inserts_total", "t") == 12
  assert v("reverb_shm_table_evictions_total", "t") == 2
  assert v("reverb_shm_table_samples_total", "t") == 5
  assert v("reverb_shm_table_items", "t") == 10 and v("reverb_shm_table_max_items", "t") == 10
  assert v("reverb_shm_table_inserted_bytes_total", "t") == 12 * 12
  assert v("reverb_shm_table_updates_total", "p") == 1
  assert v("reverb_shm_table_deletes_total", "p") == 1
  assert v("reverb_shm_table_items", "p") == 11
  assert v("reverb_shm_table_can_insert", "t") == 1 and v("reverb_shm_table_can_sample", "t") == 1
  assert v("reverb_shm_table_blocked_samplers", "t") == 0
  holds = v("reverb_shm_table_lock_hold_seconds_count", "t")
  assert holds >= 12 + 1
  inf = got[("reverb_shm_table_lock_hold_seconds_bucket",
             frozenset({"server": srv.name, "table": "t", "le": "+Inf"}.items()))]
  assert inf == holds and v("reverb_shm_table_lock_hold_seconds_sum", "t") > 0
  assert v("reverb_shm_attached_processes") >= 1
  assert v("reverb_shm_arena_used_bytes") + v("reverb_shm_arena_free_bytes") == \
      v("reverb_shm_arena_bytes")
  exported = {name for name, _ in got}
  for name, (kind, _) in METRICS.items():
    base = {"counter": name + "_total", "histogram": name + "_count"}.get(kind, name)
    assert base in exported, name


def test_metric_names_follow_prometheus_conventions():
  for name, (kind, doc) in METRICS.items():
    assert name.startswith("reverb_shm_") and name == name.lower() and doc
    assert not name.endswith("_total"), "counters get _total from the client library"
    if "seconds" in name or "bytes" in name:
      assert name.endswith(("_seconds", "_bytes")), name


def test_exporter_reports_down_after_the_server_stops(server_factory):
  srv = server_factory(_tables())
  with MetricsExporter(srv.name, 0) as exporter:
    assert scrape(exporter.port)[("reverb_shm_up", frozenset({"server": srv.name}.items()))] == 1
    srv.stop()
    got = scrape(exporter.port)
    assert got == {("reverb_shm_up", frozenset({"server": srv.name}.items())): 0}


@pytest.mark.parametrize("by", ["port", "shm"])
def test_a_server_named_by_its_address_is_down_under_its_own_name(server_factory, by):
  srv = server_factory(_tables())
  address = f"localhost:{srv.port}" if by == "port" else f"shm://{srv.name}"
  with MetricsExporter(address, 0) as exporter:
    up = ("reverb_shm_up", frozenset({"server": srv.name}.items()))
    assert scrape(exporter.port)[up] == 1
    srv.stop()
    assert scrape(exporter.port) == {up: 0}


def test_exporter_follows_a_restarted_server(server_name):
  with reverb.Server(_tables(), name=server_name) as first:
    exporter = MetricsExporter(server_name, 0)
    first.localhost_client().insert(np.float32(1), {"t": 1.0})
    key = ("reverb_shm_table_inserts_total",
           frozenset({"server": server_name, "table": "t"}.items()))
    assert scrape(exporter.port)[key] == 1
  try:
    with reverb.Server(_tables(), name=server_name) as second:
      for _ in range(3):
        second.localhost_client().insert(np.float32(1), {"t": 1.0})
      assert scrape(exporter.port)[key] == 3
  finally:
    exporter.stop()


def test_the_url_of_an_ipv6_endpoint_has_its_address_in_brackets(server_factory):
  import socket  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  if not socket.has_ipv6:
    pytest.skip("no IPv6 here")
  srv = server_factory(_tables())
  proc = subprocess.Popen([sys.executable, "-m", "reverb_shm.cli", "metrics", srv.name, "--port",
                           "0", "--addr", "::1"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    line = proc.stdout.readline()
    if not line and "Cannot assign requested address" in proc.stderr.read():
      pytest.skip("no IPv6 loopback here")
    url = line.split(" on ", 1)[1].split(";")[0]
    assert url.startswith("http://[::1]:") and url.endswith("/metrics"), line
    assert b"reverb_shm_up" in urllib.request.urlopen(url, timeout=10).read()
  finally:
    proc.terminate()
    proc.wait(timeout=30)


def test_bad_metrics_port_is_rejected():
  with pytest.raises(ValueError, match="metrics port"):
    MetricsExporter("x", 70000)


def test_exporter_reports_down_at_once_when_the_server_process_is_killed(server_name,
                                                                         monkeypatch):
  import signal  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from reverb_shm._internal import shm  # pylint: disable=import-outside-toplevel
  # (the owner watch marks an attached segment dead within milliseconds of its owner's death;
  # keep it from doing so, as when a scrape comes first: the scrape must see the death itself)
  monkeypatch.setattr(shm.Segment, "_owner_died", lambda self: None)
  code = ("import sys, reverb_shm as reverb\n"
          "from reverb_shm import rate_limiters, selectors\n"
          f"s = reverb.Server([reverb.Table('t', selectors.Uniform(), selectors.Fifo(), 10, "
          f"rate_limiters.MinSize(1))], name={server_name!r})\n"
          "print('up', flush=True)\nsys.stdin.read()\n")
  proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "up"
    with MetricsExporter(server_name, 0) as exporter:
      up = ("reverb_shm_up", frozenset({"server": server_name}.items()))
      assert scrape(exporter.port)[up] == 1
      proc.send_signal(signal.SIGKILL)
      proc.wait(timeout=30)
      assert scrape(exporter.port) == {up: 0}
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    subprocess.run([sys.executable, "-m", "reverb_shm.cli", "gc", server_name],
                   capture_output=True, timeout=60, check=True)
