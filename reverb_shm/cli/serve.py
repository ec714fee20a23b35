"""`reverb-shm serve` and `reverb_server`: run a server from a ReverbServerConfig until a signal,
optionally keeping its data in a checkpoint directory and serving Prometheus metrics.

With --checkpoint-dir the server restores the newest valid checkpoint found there at start
(the checkpointer API's rule: damaged ones are skipped with a warning), writes one every
--checkpoint-every seconds and, with --checkpoint-on-exit, one more on SIGTERM / SIGINT before
stopping, so a restarted service loses at most one interval of data (nothing on a clean stop).

Sizing: --arena-mib is the arena's first extent; it grows by itself up to --max-bytes (default:
half of what /dev/shm has free at start). --storage DIR keeps chunk data in a file in DIR (the
disk tier: tables bigger than memory; --max-bytes then bounds that file, default half of the
disk's free space). Reverb's ReverbServerConfig has no fields for these, so they are options only.
"""
import argparse
import logging
import re
import sys
import threading
import time
from typing import Optional

from reverb_shm import errors
from reverb_shm.cli import common

_log = logging.getLogger("reverb_shm.cli")


def add_arguments(parser) -> None:
  """The options `serve` and `reverb_server` share (besides --config)."""
  parser.add_argument("--name", default=None,
                      help="server name: the segment is /dev/shm/rvshm.NAME (default reverb_PORT)")
  parser.add_argument("--arena-mib", type=int, default=None, metavar="MIB",
                      help="MiB of shared memory for chunk data and item descriptors "
                      "(default: the Server default)")
  parser.add_argument("--max-bytes", type=_size_arg, default=None, metavar="SIZE",
                      help="most bytes the server may hold (its arena grows up to it): bytes, or "
                      "with a K/M/G/T suffix (powers of 1024), e.g. 8G (default: half of what "
                      "/dev/shm, or the --storage disk, has free at start)")
  parser.add_argument("--storage", default=None, metavar="DIR",
                      help="keep chunk data in a file in DIR on a local disk (disk tier: tables "
                      "bigger than memory); item metadata and sum trees stay in /dev/shm")
  parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                      help="keep checkpoints in DIR: the newest valid one is restored at start")
  parser.add_argument("--checkpoint-every", type=float, default=None, metavar="SECONDS",
                      help="write a checkpoint to --checkpoint-dir every SECONDS seconds")
  parser.add_argument("--checkpoint-on-exit", action="store_true",
                      help="write a checkpoint to --checkpoint-dir on SIGTERM or Ctrl-C before "
                      "stopping")
  parser.add_argument("--checkpoint-keep", type=int, default=2, metavar="N",
                      help="checkpoints kept in --checkpoint-dir; older ones are deleted "
                      "(default 2)")
  parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                      help="serve Prometheus metrics on http://ADDR:PORT/metrics (needs the "
                      "`metrics` extra)")
  parser.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                      help="interface of the metrics endpoint (default 127.0.0.1; 0.0.0.0 for "
                      "a Prometheus server on another host)")


_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)
_SHIFTS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}


def parse_size(text: str) -> int:
  """Bytes of a size such as '1073741824', '512M', '8G' or '1.5TiB' (K/M/G/T: powers of 1024).

  Raises:
    ValueError: not such a size, or below 1 byte (argparse prints the message).
  """
  m = _SIZE_RE.fullmatch(str(text))
  size = int(float(m.group(1)) * (1 << _SHIFTS[m.group(2).upper()])) if m else 0
  if size < 1:
    raise ValueError(f"invalid size {text!r}: expected a positive number of bytes, optionally "
                     "with a K, M, G or T suffix (powers of 1024), e.g. 512M or 8G")
  return size


def _size_arg(text: str) -> int:
  try:
    return parse_size(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _check_options(args) -> None:
  if args.checkpoint_dir is None and (args.checkpoint_every is not None or args.checkpoint_on_exit):
    raise ValueError("--checkpoint-every and --checkpoint-on-exit need --checkpoint-dir DIR")
  if args.checkpoint_every is not None and not 0 < args.checkpoint_every <= threading.TIMEOUT_MAX:
    raise ValueError(f"--checkpoint-every must be a number of seconds in (0, "
                     f"{threading.TIMEOUT_MAX:g}], got {args.checkpoint_every}")
  if args.checkpoint_keep < 1:
    raise ValueError(f"--checkpoint-keep must be >= 1, got {args.checkpoint_keep}")
  if args.arena_mib is not None and args.arena_mib < 1:
    raise ValueError(f"--arena-mib must be >= 1, got {args.arena_mib}")


class _Periodic:
  """Checkpoints `server` every `every` seconds from a thread; save() is serialised."""

  def __init__(self, server, every: Optional[float]):
    self._server = server
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = None
    if every is not None:
      self._thread = threading.Thread(target=self._loop, args=(every,), daemon=True,
                                      name="reverb_shm-checkpoint-every")
      self._thread.start()

  def save(self, why: str) -> Optional[str]:
    with self._lock:
      try:
        path = self._server.checkpoint()
      except (errors.ReverbError, OSError, ValueError) as e:
        _log.error("%s checkpoint failed: %s", why, e)
        return None
    _log.info("%s checkpoint written: %s", why, path)
    return path

  def _loop(self, every: float) -> None:
    next_at = time.monotonic() + every
    while not self._stop.wait(max(0.0, next_at - time.monotonic())):
      self.save("periodic")
      next_at = max(next_at + every, time.monotonic())

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()


def serve(config_text: str, args, prog: str) -> int:
  """Serves the tables of a text-format ReverbServerConfig until SIGINT / SIGTERM.

  Returns the exit code: 0 after a signal, 2 for a bad config or option (message on stderr).
  """
  from reverb_shm import checkpointers  # pylint: disable=import-outside-toplevel
  from reverb_shm import server as server_lib  # pylint: disable=import-outside-toplevel
  from reverb_shm.cli import server_config  # pylint: disable=import-outside-toplevel
  try:
    _check_options(args)
    tables, port = server_config.load(config_text)
    kwargs = {"name": args.name}
    if args.arena_mib is not None:
      kwargs["arena_bytes"] = int(args.arena_mib) << 20
    if args.max_bytes is not None:
      kwargs["max_bytes"] = args.max_bytes
    if args.storage is not None:
      kwargs["storage"] = args.storage
    if args.checkpoint_dir is not None:
      kwargs["checkpointer"] = checkpointers.DefaultCheckpointer(args.checkpoint_dir,
                                                                 keep_latest=args.checkpoint_keep)
    server = server_lib.Server(tables, port, **kwargs)
  except (ImportError, NotImplementedError, ValueError, OSError, errors.ReverbError) as e:
    print(f"{prog}: {e}", file=sys.stderr)
    return 2
  with common.StopSignals() as stop:   # before the first line: a signal may follow it at once
    return _run(server, args, prog, stop)


def _run(server, args, prog: str, stop) -> int:
  exporter = None
  if args.metrics_port is not None:
    try:
      from reverb_shm.metrics import MetricsExporter  # pylint: disable=import-outside-toplevel
      exporter = MetricsExporter(server.name, args.metrics_port, addr=args.metrics_addr)
    except (ImportError, OSError, ValueError) as e:
      server.stop()
      print(f"{prog}: metrics endpoint on port {args.metrics_port}: {e}", file=sys.stderr)
      return 2
  try:
    tables = server.segment.table_names()
    sizes = ", ".join(f"{t} ({server.shared_table(t).size} items)" for t in tables)
    info = server.segment.info()
    print(f"{prog}: serving tables {sizes} on localhost:{server.port} (server {server.name!r}, "
          f"segment /dev/shm/rvshm.{server.name})", flush=True)
    print(f"{prog}: arena {info['arena_size'] / 2**20:.1f} MiB, grows up to max_bytes "
          f"{info['max_bytes'] / 2**20:.1f} MiB"
          + (f"; chunk data in {server.segment.arena_path}" if info["arena_file"] else ""),
          flush=True)
    if exporter is not None:
      print(f"{prog}: Prometheus metrics on {exporter.url}", flush=True)
    if args.checkpoint_dir is not None:
      print(f"{prog}: checkpoints in {server.checkpointer.path}"
            + (f", every {args.checkpoint_every:g} s" if args.checkpoint_every else "")
            + (", and on exit" if args.checkpoint_on_exit else ""), flush=True)
    print(f"{prog}: Ctrl-C or SIGTERM stops", flush=True)
    periodic = _Periodic(server, args.checkpoint_every)
    while not stop.wait(0.5):
      pass
    periodic.stop()
    print(f"{prog}: {stop.signal_name} received, stopping server {server.name!r}", flush=True)
    if args.checkpoint_on_exit:
      path = periodic.save("exit")
      if path is not None:
        print(f"{prog}: checkpoint written to {path}", flush=True)
  finally:
    if exporter is not None:
      exporter.stop()
    server.stop()
  print(f"{prog}: server {server.name!r} stopped", flush=True)
  return 0
