"""Prometheus export of a server's counters (optional extra `metrics`: prometheus-client).

  MetricsExporter      an HTTP endpoint serving the Prometheus text format for one server;
                       started by `Server(metrics_port=P)`, `reverb-shm serve --metrics-port P`
                       and the `reverb-shm metrics ADDRESS --port P` sidecar
  ServerCollector      a prometheus_client collector for one server, for a registry of your own
  METRICS              name -> (type, help) of every metric exported

Figures are read lock-free from the server's shared memory on each scrape (see
reverb_shm._internal.counters), so scraping never slows inserts or samples.
"""
from reverb_shm.metrics.exporter import METRICS, MetricsExporter, ServerCollector

__all__ = ["METRICS", "MetricsExporter", "ServerCollector"]
