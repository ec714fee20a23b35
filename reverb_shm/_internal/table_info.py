"""TableInfo: the snapshot of a table's configuration and counters (field order as Reverb's).

Below both `reverb_shm.table` (the configuration a user builds) and `reverb_shm.shared_table`
(the live table), which both return it; `reverb_shm.table` re-exports every name.
"""
import dataclasses
from typing import Any

from reverb_shm import selectors as selectors_lib
from reverb_shm import specs

__all__ = ["RateLimiterCallStats", "RateLimiterInfo", "TableWorkerTime", "TableInfo",
           "table_info"]


@dataclasses.dataclass
class RateLimiterCallStats:
  completed: int = 0


@dataclasses.dataclass
class RateLimiterInfo:
  samples_per_insert: float
  min_diff: float
  max_diff: float
  min_size_to_sample: int
  insert_stats: RateLimiterCallStats = dataclasses.field(default_factory=RateLimiterCallStats)
  sample_stats: RateLimiterCallStats = dataclasses.field(default_factory=RateLimiterCallStats)


@dataclasses.dataclass
class TableWorkerTime:
  """Cumulative times in milliseconds."""
  running_ms: int = 0
  sampling_ms: int = 0
  inserting_ms: int = 0
  sleeping_ms: int = 0
  waiting_for_sampling_ms: int = 0
  waiting_for_inserts_ms: int = 0


@dataclasses.dataclass
class TableInfo:
  """Snapshot of a table (field order as Reverb's)."""
  name: str
  sampler_options: selectors_lib.KeyDistributionOptions
  remover_options: selectors_lib.KeyDistributionOptions
  max_size: int
  max_times_sampled: int
  rate_limiter_info: RateLimiterInfo
  signature: Any
  current_size: int
  num_episodes: int
  num_deleted_episodes: int
  num_unique_samples: int
  table_worker_time: TableWorkerTime


def table_info(name: str, stats: dict, signature: Any) -> TableInfo:
  """Builds a TableInfo from a table's rs_table_stats (as a dict) and its signature."""
  def ms(ns) -> int:
    return int(ns // 1_000_000)

  sampler = selectors_lib.from_kind(stats["sampler_kind"], stats["sampler_exponent"])
  remover = selectors_lib.from_kind(stats["remover_kind"], stats["remover_exponent"])
  return TableInfo(
      name=name, sampler_options=sampler.options(), remover_options=remover.options(),
      max_size=int(stats["max_size"]), max_times_sampled=int(stats["max_times_sampled"]),
      rate_limiter_info=RateLimiterInfo(
          samples_per_insert=stats["samples_per_insert"], min_diff=stats["min_diff"],
          max_diff=stats["max_diff"], min_size_to_sample=int(stats["min_size_to_sample"]),
          insert_stats=RateLimiterCallStats(int(stats["inserts"])),
          sample_stats=RateLimiterCallStats(int(stats["samples"]))),
      signature=specs.user_signature(signature), current_size=int(stats["size"]),
      num_episodes=int(stats["num_episodes"]),
      num_deleted_episodes=int(stats["num_deleted_episodes"]),
      num_unique_samples=int(stats["num_unique_samples"]),
      table_worker_time=TableWorkerTime(
          running_ms=ms(stats["inserting_ns"] + stats["sampling_ns"]),
          sampling_ms=ms(stats["sampling_ns"]), inserting_ms=ms(stats["inserting_ns"]),
          sleeping_ms=ms(stats["waiting_for_sampling_ns"] + stats["waiting_for_inserts_ns"]),
          waiting_for_sampling_ms=ms(stats["waiting_for_sampling_ns"]),
          waiting_for_inserts_ms=ms(stats["waiting_for_inserts_ns"])))
