"""Prometheus export of a server's counters (optional extra `metrics`: prometheus-client).

  MetricsExporter      an HTTP endpoint serving the Prometheus text format for one server;
                       started by `Server(metrics_port=P)`, `reverb-shm serve --metrics-port P`
                       and the `reverb-shm metrics ADDRESS --port P` sidecar
  ServerCollector      a prometheus_client collector for one server, for a registry of your own
  METRICS              name -> (type, help) of every metric exported

Figures are read lock-free from the server's shared memory on each scrape (see
reverb_shm._internal.counters), so scraping never slows inserts or samples.
"""
import importlib

_EXPORTS = {"MetricsExporter": "exporter", "ServerCollector": "exporter", "METRICS": "exporter"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'reverb_shm.metrics' has no attribute {name!r}")
  return getattr(importlib.import_module(f"reverb_shm.metrics.{module}"), name)
