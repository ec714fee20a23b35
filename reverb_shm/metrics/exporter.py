"""Prometheus collector and HTTP endpoint for one reverb_shm server.

Metric names follow Prometheus conventions: the `reverb_shm_` prefix, base units (seconds,
bytes), `_total` on counters; per-table metrics carry the labels `server` and `table`,
server-wide ones `server`. Counters count since the server started.
"""
import logging
import os
import threading
from typing import Any, Iterator, Optional

try:
  from prometheus_client import CollectorRegistry, start_http_server
  from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
except ImportError as e:   # pragma: no cover - exercised without the extra installed
  raise ImportError("reverb_shm.metrics needs prometheus-client: pip install "
                    "'reverb_shm[metrics]'") from e

from reverb_shm import errors
from reverb_shm._internal import counters, shm

__all__ = ["METRICS", "MetricsExporter", "ServerCollector"]

_log = logging.getLogger(__name__)

# name (without the _total of counters) -> (type, help, read_table key or None)
_TABLE_METRICS = {
    "reverb_shm_table_inserts": ("counter", "Items inserted (new keys).", "inserts"),
    "reverb_shm_table_samples": ("counter", "Items sampled.", "samples"),
    "reverb_shm_table_updates": ("counter", "Priority updates (mutate_priorities, and inserts "
                                 "of a key already in the table).", "updates"),
    "reverb_shm_table_deletes": ("counter", "Items deleted by mutate_priorities.", "deletes"),
    "reverb_shm_table_evictions": ("counter", "Items removed by the remover because the table "
                                   "was full.", "evictions"),
    "reverb_shm_table_expirations": ("counter", "Items removed on reaching max_times_sampled.",
                                     "expirations"),
    "reverb_shm_table_inserted_bytes": ("counter", "Payload bytes referenced by inserted items "
                                        "(a step in several items counts once per item).",
                                        "insert_bytes"),
    "reverb_shm_table_insert_blocked_seconds": ("counter", "Time inserts spent blocked on the "
                                                "rate limiter.", "insert_blocked_seconds"),
    "reverb_shm_table_sample_blocked_seconds": ("counter", "Time samples spent blocked on the "
                                                "rate limiter.", "sample_blocked_seconds"),
    "reverb_shm_table_items": ("gauge", "Items in the table.", "items"),
    "reverb_shm_table_max_items": ("gauge", "The table's max_size.", "max_size"),
    "reverb_shm_table_episodes": ("gauge", "Episodes with at least one step in the table.",
                                  "episodes"),
    "reverb_shm_table_blocked_inserters": ("gauge", "Threads blocked inserting now (rate "
                                           "limiter).", "blocked_inserters"),
    "reverb_shm_table_blocked_samplers": ("gauge", "Threads blocked sampling now (rate "
                                          "limiter).", "blocked_samplers"),
    "reverb_shm_table_can_insert": ("gauge", "1 when the rate limiter admits an insert now.",
                                    "can_insert"),
    "reverb_shm_table_can_sample": ("gauge", "1 when the rate limiter admits a sample now.",
                                    "can_sample"),
    "reverb_shm_table_rate_limiter_diff": ("gauge", "inserts * samples_per_insert - samples of "
                                           "the rate limiter.", "diff"),
    "reverb_shm_table_rate_limiter_min_diff": ("gauge", "The rate limiter's min_diff.",
                                               "min_diff"),
    "reverb_shm_table_rate_limiter_max_diff": ("gauge", "The rate limiter's max_diff.",
                                               "max_diff"),
    "reverb_shm_table_lock_hold_seconds": ("histogram", "Time insert, sample, mutate and reset "
                                           "calls held the table lock, per hold.", None),
}
_SERVER_METRICS = {
    "reverb_shm_up": ("gauge", "1 when the server's shared memory is readable and its owner "
                      "alive, else 0."),
    "reverb_shm_arena_bytes": ("gauge", "Size of the chunk arena."),
    "reverb_shm_arena_used_bytes": ("gauge", "Bytes of the arena in allocated blocks."),
    "reverb_shm_arena_free_bytes": ("gauge", "Bytes of the arena not allocated."),
    "reverb_shm_chunks": ("gauge", "Chunks in the arena."),
    "reverb_shm_attached_processes": ("gauge", "Processes registered with the server."),
    "reverb_shm_process_pins": ("gauge", "Pins (held chunks and sampled items) of one attached "
                                "process; label pid."),
}
METRICS = {**{n: v[:2] for n, v in _TABLE_METRICS.items()}, **_SERVER_METRICS}


def _family(kind, name, doc, labels):
  cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}[kind]
  return cls(name, doc, labels=labels)


def _finite(x: float) -> float:
  return x if abs(x) != float("inf") else (1e300 if x > 0 else -1e300)


def _live(seg: shm.Segment) -> bool:
  return not seg.is_closed() and seg.owner_alive()


class ServerCollector:
  """prometheus_client collector of one server, found by name or 'localhost:PORT' address.

  It attaches (without registering a process slot) on the first scrape and again after the
  server restarts; while no live server answers, only `reverb_shm_up 0` is exported.
  Thread-safe: scrapes are serialised by a lock.
  """

  def __init__(self, address: str):
    self._address = address
    # the `server` label of reverb_shm_up while no server answers: the name of the server last
    # seen (that of its metrics while it was up), else the name or address given
    self._label = address[len("shm://"):] if address.startswith("shm://") else address
    self._seg: Optional[shm.Segment] = None
    self._lock = threading.Lock()

  def _segment(self) -> Optional[shm.Segment]:
    seg = self._seg
    if seg is None or not _live(seg):
      try:
        name = self._address if "://" not in self._address and ":" not in self._address \
            else shm.resolve_address(self._address)
        seg = shm.Segment.attach(name)
      except (errors.ReverbError, ValueError, OSError):
        seg = None
      # (checked again: attach may return the process's cached mapping of a server that died
      # moments ago, before the owner watch has marked it dead)
      if seg is not None and not _live(seg):
        seg = None
    self._seg = seg
    return seg

  def describe(self):
    return []   # no fixed list: the registry calls collect() at scrape time only

  def collect(self) -> Iterator:
    with self._lock:
      seg = self._segment()
      up = GaugeMetricFamily("reverb_shm_up", _SERVER_METRICS["reverb_shm_up"][1],
                             labels=["server"])
      if seg is None:
        up.add_metric([self._label], 0)
        yield up
        return
      try:
        figures = counters.read_server(seg)
      except errors.ReverbError:
        up.add_metric([seg.name], 0)
        yield up
        return
      server = self._label = figures["name"]
    up.add_metric([server], 1)
    yield up
    for name, field in (("reverb_shm_arena_bytes", "arena_bytes"),
                      ("reverb_shm_arena_used_bytes", "arena_used_bytes"),
                      ("reverb_shm_arena_free_bytes", "arena_free_bytes"),
                      ("reverb_shm_chunks", "chunks")):
      g = GaugeMetricFamily(name, _SERVER_METRICS[name][1], labels=["server"])
      g.add_metric([server], figures[field])
      yield g
    procs = [p for p in figures["processes"] if p["alive"]]
    g = GaugeMetricFamily("reverb_shm_attached_processes",
                          _SERVER_METRICS["reverb_shm_attached_processes"][1], labels=["server"])
    g.add_metric([server], len(procs))
    yield g
    g = GaugeMetricFamily("reverb_shm_process_pins", _SERVER_METRICS["reverb_shm_process_pins"][1],
                          labels=["server", "pid"])
    for p in procs:
      g.add_metric([server, str(p["pid"])], p["pins"])
    yield g
    tables = figures["tables"]
    for name, (kind, doc, key) in _TABLE_METRICS.items():
      if kind == "histogram":
        h = HistogramMetricFamily(name, doc, labels=["server", "table"])
        for table, t in tables.items():
          cumulative, buckets = 0, []
          for bound, count in zip(counters.HOLD_BUCKET_BOUNDS, t["lock_hold_histogram"]):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
          h.add_metric([server, table], buckets, t["lock_hold_seconds"])
        yield h
        continue
      fam = _family(kind, name, doc, ["server", "table"])
      for table, t in tables.items():
        fam.add_metric([server, table], _finite(float(t[key])))
      yield fam


class MetricsExporter:
  """Serves one server's metrics over HTTP in the Prometheus text format (GET /metrics).

  Args:
    address: server name or 'localhost:PORT'.
    port: TCP port to listen on (0: any free port; see .port).
    addr: interface to bind; the default serves this host only. Use '0.0.0.0' for a Prometheus
      server on another host.

  Raises:
    OSError: the port cannot be bound.

  The endpoint runs in a daemon thread; stop() shuts it down. Thread-safe. `.port` is the port
  it listens on, `.url` the endpoint's URL.
  """

  def __init__(self, address: str, port: int, addr: str = "127.0.0.1"):
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
      raise ValueError(f"metrics port must be an int in 0..65535, got {port!r}")
    self.registry = CollectorRegistry(auto_describe=False)
    self.collector = ServerCollector(address)
    self.registry.register(self.collector)
    httpd, self._thread = start_http_server(port, addr=addr, registry=self.registry)
    self._httpd: Optional[Any] = httpd
    self.addr = addr
    self.port = httpd.server_port
    host = f"[{addr}]" if ":" in addr else addr   # (an IPv6 address: in brackets in a URL)
    self.url = f"http://{host}:{self.port}/metrics"
    _log.info("serving Prometheus metrics of %s on %s (pid %d)", address, self.url, os.getpid())

  def stop(self) -> None:
    """Stops serving (idempotent)."""
    httpd, self._httpd = self._httpd, None
    if httpd is not None:
      httpd.shutdown()
      httpd.server_close()
      self._thread.join(timeout=5)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()
