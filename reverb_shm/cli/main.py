"""`reverb-shm`: inspect, check and clean up reverb_shm servers on this host.

Sub-commands:
  reverb-shm list            servers whose segments exist in /dev/shm, with owner state
  reverb-shm info NAME       segment and per-table statistics of server NAME
  reverb-shm check NAME      run the C invariant checker over every table of NAME (exit 1 on violation)
  reverb-shm gc [NAME ...] [--dry-run] [--storage DIR]
                             remove segments and port aliases whose owner process is dead
                             (of servers NAME only, if given); a segment still being created
                             counts as live
  reverb-shm serve --config FILE [--name NAME] [--arena-mib N]
                             run a server from a ReverbServerConfig text file until Ctrl-C
  reverb-shm bridge NAME --port P   serve server NAME's tables over gRPC (extra `bridge`)
  reverb-shm checkpoint NAME write a checkpoint of server NAME with its checkpointer (progress bar
                             with the `progress` extra, tqdm; log lines otherwise)

`reverb_server --config "<textproto>"` (Reverb's console script) is :func:`reverb_server_main`.
"""
import argparse
import os
import signal
import sys

from reverb_shm import errors
from reverb_shm._internal import shm
from reverb_shm.server import PIN_ENTRY_BYTES

_MiB = float(1 << 20)


def _cmd_list(args) -> int:
  rows = shm.list_segments()
  if not rows:
    print("no reverb_shm segments in", shm.SHM_DIR)
    return 0
  print(f"{'server':32} {'size MiB':>10} {'owner pid':>10}  state")
  for row in rows:
    state = {"live": "live", "starting": "starting (being created)",
             "foreign": "another user's (not accessible)"}.get(
        row["state"], "STALE (owner dead; `reverb-shm gc` removes it)")
    print(f"{row['name']:32} {row['size'] / _MiB:10.1f} {row['pid']:10d}  {state}")
  return 0


def _cmd_info(args) -> int:
  seg = shm.Segment.attach(args.name)
  info = seg.info()
  print(f"server {args.name!r}: {info['num_tables']} table(s), owner pid {info['owner_pid']}, "
        f"{info['live_procs']}/{info['max_procs']} process slots in use")
  print(f"arena: {info['arena_used'] / _MiB:.1f} MiB used of {info['arena_size'] / _MiB:.1f} MiB, "
        f"{info['num_chunks']} chunks, {info['num_descs']} item descriptors")
  pin_logs = info["pins_reserved"]
  rest = info["reserved_bytes"] - info["arena_size"] - pin_logs
  limit = (f"max_bytes {info['max_bytes'] / _MiB:.1f} MiB" if info["max_bytes"] else
           f"arena fixed at {info['arena_max'] / _MiB:.1f} MiB")
  print(f"segment: {info['reserved_bytes'] / _MiB:.1f} MiB reserved of {limit} = arena "
        f"{info['arena_size'] / _MiB:.1f} MiB ({info['extents']} extent(s) added) + pin logs "
        f"{pin_logs / _MiB:.1f} MiB (grown per process as needed, up to {info['pins_per_proc']} "
        f"pins x {PIN_ENTRY_BYTES} bytes) + tables' metadata and header {rest / _MiB:.1f} MiB")
  if seg.arena_path is not None:
    print(f"disk tier: the arena is the file {seg.arena_path} (/dev/shm holds the rest)")
  for index, name in enumerate(seg.table_names()):
    st = seg.stats(index)
    print(f"  table {name!r}: size {st['size']}/{st['max_size']}, inserts {st['inserts']}, "
          f"samples {st['samples']}, deletes {st['deletes']}, episodes {st['num_episodes']}, "
          f"unique samples {st['num_unique_samples']}, repairs {st['repairs']}")
  return 0


def _cmd_check(args) -> int:
  seg = shm.Segment.attach(args.name)
  try:
    seg.check()
  except errors.CorruptError as e:
    print(f"server {args.name!r}: invariant check FAILED\n{e}", file=sys.stderr)
    return 1
  print(f"server {args.name!r}: all invariants hold")
  return 0


def _cmd_gc(args) -> int:
  if args.dry_run:
    removed = shm.remove_stale(dry_run=True, names=args.names or None, storage=args.storage)
    freed = sum(shm.allocated_bytes(path) for path in removed)
  else:
    removed, freed = shm.reclaim_dead(names=args.names or None, storage=args.storage)
  verb = "would remove" if args.dry_run else "removed"
  for path in removed:
    print(f"{verb} {path}")
  print(f"{verb} {len(removed)} stale object(s), {freed / (1 << 20):.1f} MiB")
  return 0


def _serve(config_text: str, *, name=None, arena_mib=None, prog: str) -> int:
  """Builds the tables of a ReverbServerConfig, serves them until SIGINT/SIGTERM; exit code."""
  from reverb_shm import server as server_lib  # pylint: disable=g-import-not-at-top
  from reverb_shm.cli import server_config
  try:
    tables, port = server_config.load(config_text)
    kwargs = {"name": name}
    if arena_mib is not None:
      kwargs["arena_bytes"] = int(arena_mib) << 20
    server = server_lib.Server(tables, port, **kwargs)
  except (ImportError, NotImplementedError, ValueError, errors.ReverbError) as e:
    print(f"{prog}: {e}", file=sys.stderr)
    return 2
  try:
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print(f"{prog}: serving {[t.name for t in tables]} on localhost:{server.port} "
          f"(server {server.name!r}); Ctrl-C or SIGTERM stops", flush=True)
    server.wait()
  except KeyboardInterrupt:
    pass
  finally:
    server.stop()
  return 0


def _cmd_serve(args) -> int:
  try:
    with open(args.config, encoding="utf-8") as f:
      text = f.read()
  except OSError as e:
    print(f"reverb-shm serve: cannot read --config {args.config!r}: {e.strerror}", file=sys.stderr)
    return 2
  return _serve(text, name=args.name, arena_mib=args.arena_mib, prog="reverb-shm serve")


def reverb_server_main(argv=None) -> int:
  """`reverb_server --config "<textproto>"`: Reverb's server executable."""
  parser = argparse.ArgumentParser(
      prog="reverb_server", description="Serve reverb_shm tables from a ReverbServerConfig.")
  parser.add_argument("--config", required=True,
                      help="text-format ReverbServerConfig: tables { ... } port: N")
  args = parser.parse_args(argv)
  return _serve(args.config, prog="reverb_server")


def _read(path):
  if path is None:
    return None
  with open(path, "rb") as f:
    return f.read()


def _cmd_bridge(args) -> int:
  from reverb_shm import bridge  # pylint: disable=g-import-not-at-top  (optional extra)
  from reverb_shm.bridge import security  # pylint: disable=g-import-not-at-top
  tls = None
  if args.tls_cert or args.tls_key:
    if not (args.tls_cert and args.tls_key):
      raise ValueError("--tls-cert and --tls-key go together")
    tls = bridge.ServerTLS(_read(args.tls_cert), _read(args.tls_key), _read(args.client_ca))
  config = bridge.BridgeConfig(
      port=args.port, host=args.host, tls=tls,
      token=args.token or os.environ.get(security.ENV_TOKEN) or None,
      max_message_bytes=args.max_message_mb << 20, max_stream_chunks=args.max_stream_chunks)
  server = bridge.Bridge(args.name, config)
  print(f"bridge for server {args.name!r} listening on {server.address}", flush=True)
  try:
    server.wait()
  except KeyboardInterrupt:
    pass
def _progress_bars():
  """A checkpoint Progress callback drawing tqdm bars, or None when tqdm is not installed."""
  try:
    import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  bars = {}

  def report(phase: str, done: int, total: int) -> None:
    bar = bars.get(phase)
    if bar is None:
      scale = phase != "items"
      bar = bars[phase] = tqdm.tqdm(total=total, desc=phase, unit="B" if scale else "item",
                                    unit_scale=scale, unit_divisor=1024, file=sys.stderr)
    bar.update(done - bar.n)
    if done >= total:
      bar.close()

  return report


def _cmd_checkpoint(args) -> int:
  import logging  # pylint: disable=g-import-not-at-top
  from reverb_shm import checkpointers  # pylint: disable=g-import-not-at-top
  seg = shm.Segment.attach(args.name)
  progress = _progress_bars()
  if progress is None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
  path = checkpointers.for_server(args.name).save(seg, progress=progress)
  print(path)
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="reverb-shm", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("list", help="list servers on this host").set_defaults(func=_cmd_list)
  p = sub.add_parser("info", help="statistics of one server")
  p.add_argument("name")
  p.set_defaults(func=_cmd_info)
  p = sub.add_parser("check", help="run the invariant checker")
  p.add_argument("name")
  p.set_defaults(func=_cmd_check)
  p = sub.add_parser("gc", help="remove segments of dead servers")
  p.add_argument("names", nargs="*", metavar="NAME",
                 help="only consider the segments of these servers (default: all)")
  p.add_argument("--dry-run", action="store_true")
  p.add_argument("--storage", metavar="DIR", default=None,
                 help="a disk-tier directory (Server storage=): also remove its arena files "
                      "whose server is gone (e.g. after /dev/shm was cleared by a reboot)")
  p.set_defaults(func=_cmd_gc)
  p = sub.add_parser("serve", help="serve tables from a ReverbServerConfig text file")
  p.add_argument("--config", required=True, help="file holding a text-format ReverbServerConfig")
  p.add_argument("--name", default=None, help="server name (default reverb_PORT)")
  p.add_argument("--arena-mib", type=int, default=None, help="shared memory for chunk data")
  p.set_defaults(func=_cmd_serve)
  p = sub.add_parser("bridge", help="serve a server's tables over gRPC")
  p.add_argument("name")
  p.add_argument("--port", type=int, required=True)
  p.add_argument("--host", default="127.0.0.1",
                 help="bind address; non-loopback needs TLS or a token")
  p.add_argument("--token", help="auth token (default: $REVERB_SHM_BRIDGE_TOKEN)")
  p.add_argument("--tls-cert", help="PEM server certificate chain")
  p.add_argument("--tls-key", help="PEM server private key")
  p.add_argument("--client-ca", help="PEM CA that client certificates must chain to")
  p.add_argument("--max-message-mb", type=int, default=1024,
                 help="largest item/chunk message accepted (MiB)")
  p.add_argument("--max-stream-chunks", type=int, default=1 << 16,
                 help="chunks one writer stream may hold")
  p.set_defaults(func=_cmd_bridge)
  p = sub.add_parser("checkpoint", help="write a checkpoint of a server")
  p.add_argument("name")
  p.set_defaults(func=_cmd_checkpoint)
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except (errors.ReverbError, ValueError, OSError) as e:
    print(f"reverb-shm {args.command}: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
