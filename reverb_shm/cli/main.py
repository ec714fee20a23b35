"""`reverb-shm`: run, watch, inspect, check and clean up reverb_shm servers on this host.

Sub-commands (SERVER: a server's name, shm://NAME, or localhost:PORT; `info` and `checkpoint`
also take HOST:PORT of a gRPC bridge):
  reverb-shm list [--json]          servers whose segments exist in /dev/shm, with owner state
  reverb-shm info SERVER [--json]   segment, counters and rate-limiter state of each table
  reverb-shm top SERVER             live view of the tables: rates per second, blocked, full
  reverb-shm check SERVER [--json]  run the invariant checker over every table (exit 1 on violation)
  reverb-shm gc [SERVER ...] [--dry-run] [--storage DIR]
                                    remove segments and port aliases whose owner process is dead
                                    (and disk-tier arena files in DIR whose server is gone);
                                    exit 1 when a named SERVER has nothing on this host
  reverb-shm serve --config FILE [--checkpoint-dir DIR ...] [--metrics-port P]
                                    run a server from a ReverbServerConfig text file until Ctrl-C
  reverb-shm bridge SERVER --port P serve a server's tables over gRPC (extra `bridge`)
  reverb-shm metrics SERVER --port P
                                    serve a server's Prometheus metrics (extra `metrics`)
  reverb-shm checkpoint SERVER      write a checkpoint with the server's checkpointer

`reverb_server --config "<textproto>"` (Reverb's console script) serves a config given as text.
"""
import argparse
import os
import sys
from typing import Optional

from reverb_shm import errors
from reverb_shm._internal import counters, shm
from reverb_shm.cli import common
from reverb_shm.cli import serve as serving
from reverb_shm.server import PIN_ENTRY_BYTES

_MiB = float(1 << 20)


# ---------------------------------------------------------------- list
def _cmd_list(args) -> int:
  rows = shm.list_segments()
  if args.json:
    common.emit_json([{"name": r["name"], "size_bytes": r["size"], "owner_pid": r["pid"],
                       "state": r["state"]} for r in rows])
    return 0
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


# ---------------------------------------------------------------- info
def _segment_breakdown(info: dict) -> dict:
  """Bytes the segment holds now (it grows): arena, pin logs, and the rest (metadata, counters,
  header)."""
  pin_logs = info["pins_reserved"]
  return {"reserved_bytes": info["reserved_bytes"], "max_bytes": info["max_bytes"],
          "arena_bytes": info["arena_size"], "pin_log_bytes": pin_logs,
          "metadata_bytes": info["reserved_bytes"] - info["arena_size"] - pin_logs}


def _info_local(name: str, as_json: bool) -> int:
  seg = shm.Segment.attach(name)
  info = seg.info()
  figures = counters.read_server(seg)
  sizes = _segment_breakdown(info)
  if as_json:
    configs = {}
    for index, table in enumerate(seg.table_names()):
      st = seg.stats(index)
      configs[table] = {k: st[k] for k in ("max_times_sampled", "sampler_kind", "remover_kind",
                                            "sampler_exponent", "remover_exponent",
                                            "num_deleted_episodes", "num_unique_samples",
                                            "repairs")}
    for table, t in figures["tables"].items():
      t.update(configs[table])
    common.emit_json({**figures, "segment": sizes, "pins_per_proc": info["pins_per_proc"],
                      "live_procs": info["live_procs"]})
    return 0
  print(f"server {name!r}: {info['num_tables']} table(s), owner pid {info['owner_pid']}, "
        f"{info['live_procs']}/{info['max_procs']} process slots in use")
  print(f"arena: {info['arena_used'] / _MiB:.1f} MiB used of {info['arena_size'] / _MiB:.1f} MiB, "
        f"{info['num_chunks']} chunks, {info['num_descs']} item descriptors")
  pin_logs = sizes["pin_log_bytes"]
  arena = f"arena {info['arena_size'] / _MiB:.1f} MiB ({info['extents']} extent(s) added)"
  rest = (f"pin logs {pin_logs / _MiB:.1f} MiB (grown per process as needed, up to "
          f"{info['pins_per_proc']} pins x {PIN_ENTRY_BYTES} bytes) + tables' metadata, counters "
          f"and header {sizes['metadata_bytes'] / _MiB:.1f} MiB")
  if seg.arena_path is not None:   # (max_bytes bounds the arena's file, not /dev/shm)
    print(f"segment: {(info['reserved_bytes'] - info['arena_size']) / _MiB:.1f} MiB in /dev/shm "
          f"= {rest}")
    print(f"disk tier: {arena} of max_bytes {info['max_bytes'] / _MiB:.1f} MiB, in the file "
          f"{seg.arena_path}")
  else:
    limit = (f"max_bytes {info['max_bytes'] / _MiB:.1f} MiB" if info["max_bytes"] else
             f"arena fixed at {info['arena_max'] / _MiB:.1f} MiB")
    print(f"segment: {info['reserved_bytes'] / _MiB:.1f} MiB reserved of {limit} = {arena} + "
          f"{rest}")
  for index, table in enumerate(seg.table_names()):
    st, t = seg.stats(index), figures["tables"][table]
    print(f"  table {table!r}: size {st['size']}/{st['max_size']}, inserts {st['inserts']}, "
          f"samples {st['samples']}, deletes {st['deletes']}, episodes {st['num_episodes']}, "
          f"unique samples {st['num_unique_samples']}, repairs {st['repairs']}")
    print(f"    since start: {t['inserts']} inserted, {t['samples']} sampled, {t['updates']} "
          f"updated, {t['deletes']} deleted, {t['evictions']} evicted, {t['expirations']} expired;"
          f" limiter: can insert {'yes' if t['can_insert'] else 'NO'}, can sample "
          f"{'yes' if t['can_sample'] else 'NO'}, diff {t['diff']:g}; blocked now: "
          f"{t['blocked_inserters']} inserting, {t['blocked_samplers']} sampling")
  return 0


def _info_remote(address: str, as_json: bool) -> int:
  from reverb_shm.client import Client  # pylint: disable=import-outside-toplevel
  infos = Client(address).server_info(timeout=10)
  if as_json:
    common.emit_json({"address": address, "tables": {
        name: {"max_size": i.max_size, "current_size": i.current_size,
               "num_episodes": i.num_episodes, "num_deleted_episodes": i.num_deleted_episodes,
               "num_unique_samples": i.num_unique_samples,
               "rate_limiter": str(i.rate_limiter_info)} for name, i in infos.items()}})
    return 0
  print(f"bridge {address}: {len(infos)} table(s)")
  for name, i in infos.items():
    print(f"  table {name!r}: size {i.current_size}/{i.max_size}, episodes {i.num_episodes}, "
          f"unique samples {i.num_unique_samples}")
  return 0


def _cmd_info(args) -> int:
  kind, where = common.locate(args.server, "info", remote_ok=True)
  return (_info_local if kind == "local" else _info_remote)(where, args.json)


# ---------------------------------------------------------------- top, metrics
def _cmd_top(args) -> int:
  from reverb_shm.cli import top  # pylint: disable=import-outside-toplevel
  name = common.local_name(args.server, "top")

  def said(reason: str) -> None:
    if reason == "server stopped":
      print(f"reverb-shm top: server {name!r} stopped", flush=True)
    elif reason == "server died":
      print(f"reverb-shm top: server {name!r} died (its owner process is gone; `reverb-shm gc` "
            "removes its segment)", flush=True)

  top.run(name, interval=args.interval, iterations=1 if args.once else None, on_exit=said)
  return 0


def _cmd_metrics(args) -> int:
  from reverb_shm.metrics import MetricsExporter  # pylint: disable=import-outside-toplevel
  name = common.local_name(args.server, "metrics")
  shm.Segment.attach(name)    # a clear error now if no such server runs
  with common.StopSignals() as stop:
    exporter = MetricsExporter(name, args.port, addr=args.addr)
    try:
      print(f"reverb-shm metrics: serving Prometheus metrics of server {name!r} on "
            f"{exporter.url}; Ctrl-C or SIGTERM stops", flush=True)
      while not stop.wait(0.5):
        pass
    finally:
      exporter.stop()
  print(f"reverb-shm metrics: stopped ({stop.signal_name})", flush=True)
  return 0


# ---------------------------------------------------------------- check, gc
def _cmd_check(args) -> int:
  name = common.local_name(args.server, "check")
  seg = shm.Segment.attach(name)
  try:
    seg.check()
  except errors.CorruptError as e:
    if args.json:
      common.emit_json({"server": name, "ok": False, "report": str(e)})
    else:
      print(f"server {name!r}: invariant check FAILED\n{e}", file=sys.stderr)
    return 1
  if args.json:
    common.emit_json({"server": name, "ok": True, "report": ""})
  else:
    print(f"server {name!r}: all invariants hold")
  return 0


def _gc_name(target: str) -> Optional[str]:
  """Server name of a gc target, None for a 'HOST:PORT' no server was registered on: a port
  alias may belong to a dead server, so it is read without requiring a live owner."""
  if ":" not in target or target.startswith("shm://"):
    return common.local_name(target, "gc")
  from reverb_shm._internal import addresses  # pylint: disable=import-outside-toplevel
  host, port = addresses.split(target)
  if not shm.is_local_host(host):
    raise ValueError(f"{target!r} is not on this host; `reverb-shm gc` cleans this host only")
  alias = shm._read_alias(shm._alias_path(port))  # pylint: disable=protected-access
  return None if alias is None else alias[0]


def _gc_unknown(target: str, name: Optional[str], storage: Optional[str]) -> Optional[str]:
  """Why `target` names nothing on this host (no segment, port alias, sidecar or arena file of
  that server), else None."""
  if name is None:
    return f"no server was registered on port {target.rsplit(':', 1)[1]} of this host"
  if shm.list_segments([name]) or shm.remove_stale(dry_run=True, names=[name], storage=storage):
    return None
  files = f"segment, port alias or sidecar file in {shm.SHM_DIR}"
  if storage is not None:
    files += f", nor arena file in {storage}"
  return f"no server named {errors.quoted_name(name)} on this host (no {files})"


def _cmd_gc(args) -> int:
  targets = [(t, _gc_name(t)) for t in args.servers]
  found = [(name, _gc_unknown(t, name, args.storage)) for t, name in targets]
  unknown = [why for _, why in found if why]
  names = [name for name, why in found if name is not None and not why]
  if targets and not names:   # (no names would mean every server)
    for why in unknown:
      print(f"reverb-shm gc: {why}", file=sys.stderr)
    return 1
  if args.dry_run:
    removed = shm.remove_stale(dry_run=True, names=names or None, storage=args.storage)
    freed = sum(shm.allocated_bytes(path) for path in removed)
  else:
    removed, freed = shm.reclaim_dead(names=names or None, storage=args.storage)
  verb = "would remove" if args.dry_run else "removed"
  for path in removed:
    print(f"{verb} {path}")
  for row in shm.list_segments(names) if names else ():
    if row["alive"]:
      print(f"server {row['name']!r} is {row['state']} (owner pid {row['pid']}): left alone")
  print(f"{verb} {len(removed)} stale object(s), {freed / (1 << 20):.1f} MiB")
  for why in unknown:
    print(f"reverb-shm gc: {why}", file=sys.stderr)
  return 1 if unknown else 0


# ---------------------------------------------------------------- serve, reverb_server
def _cmd_serve(args) -> int:
  try:
    with open(args.config, encoding="utf-8") as f:
      text = f.read()
  except OSError as e:
    print(f"reverb-shm serve: cannot read --config {args.config!r}: {e.strerror}", file=sys.stderr)
    return 2
  except UnicodeDecodeError as e:
    print(f"reverb-shm serve: --config {args.config!r} is not UTF-8 text (byte {e.start}: "
          f"{e.reason}); expected a text-format ReverbServerConfig", file=sys.stderr)
    return 2
  return serving.serve(text, args, prog="reverb-shm serve")


def reverb_server_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="reverb_server", description="Serve reverb_shm tables from a ReverbServerConfig.")
  parser.add_argument("--config", required=True,
                      help="text-format ReverbServerConfig: tables { ... } port: N")
  serving.add_arguments(parser)
  parser.add_argument("--log-level", default="INFO", choices=_LEVELS,
                      help="level of the log lines on stderr (default INFO)")
  return parser


def reverb_server_main(argv=None) -> int:
  """`reverb_server --config "<textproto>"`: Reverb's server executable."""
  args = reverb_server_parser().parse_args(argv)
  common.setup_logging(args.log_level)
  return common.run_quietly_on_broken_pipe(
      lambda: serving.serve(args.config, args, prog="reverb_server"))


# ---------------------------------------------------------------- bridge
def _read(path):
  if path is None:
    return None
  with open(path, "rb") as f:
    return f.read()


def _cmd_bridge(args) -> int:
  from reverb_shm import bridge  # pylint: disable=import-outside-toplevel  (optional extra)
  from reverb_shm.bridge import security  # pylint: disable=import-outside-toplevel
  name = common.local_name(args.server, "bridge")
  tls = None
  if args.tls_cert or args.tls_key:
    if not (args.tls_cert and args.tls_key):
      raise ValueError("--tls-cert and --tls-key go together")
    tls = bridge.ServerTLS(_read(args.tls_cert), _read(args.tls_key), _read(args.client_ca))
  config = bridge.BridgeConfig(
      port=args.port, host=args.host, tls=tls,
      token=args.token or os.environ.get(security.ENV_TOKEN) or None,
      max_message_bytes=args.max_message_mb << 20, max_stream_chunks=args.max_stream_chunks)
  tables = shm.Segment.attach(name).table_names()
  with common.StopSignals() as stop:
    server = bridge.Bridge(name, config)
    try:
      _serve_bridge(server, name, tables, tls, config, stop)
    finally:
      server.stop()
  print(f"reverb-shm bridge: stopped ({stop.signal_name or 'the bridge ended'})", flush=True)
  return 0


def _serve_bridge(server, name, tables, tls, config, stop) -> None:
  print(f"reverb-shm bridge: listening on {server.address} ({'TLS' if tls else 'plaintext'}"
        f"{', token required' if config.token else ''}), serving tables {tables} of server "
        f"{errors.quoted_name(name)} over gRPC; Ctrl-C or SIGTERM stops", flush=True)
  while not stop.wait(0.5) and server._thread.is_alive():  # pylint: disable=protected-access
    pass


# ---------------------------------------------------------------- checkpoint
def _cmd_checkpoint(args) -> int:
  kind, where = common.locate(args.server, "checkpoint", remote_ok=True)
  if kind == "remote":
    from reverb_shm.client import Client  # pylint: disable=import-outside-toplevel
    print(Client(where).checkpoint())
    return 0
  from reverb_shm import checkpointers  # pylint: disable=import-outside-toplevel
  seg = shm.Segment.attach(where)
  print(checkpointers.for_server(where).save(seg))
  return 0


# ---------------------------------------------------------------- parser
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def build_parser() -> argparse.ArgumentParser:
  """The `reverb-shm` parser; every argument carries help text."""
  parser = argparse.ArgumentParser(prog="reverb-shm", description=__doc__.splitlines()[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n".join(__doc__.splitlines()[2:]))
  parser.add_argument("--log-level", default="INFO", choices=_LEVELS,
                      help="level of the log lines on stderr (default INFO)")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                              help="what to do (see the list below)")

  p = sub.add_parser("list", help="list servers on this host")
  p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
  p.set_defaults(func=_cmd_list)

  p = sub.add_parser("info", help="segment, counters and rate-limiter state of a server")
  p.add_argument("server", metavar="SERVER", help=common.REMOTE_TARGET_HELP)
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.set_defaults(func=_cmd_info)

  p = sub.add_parser("top", help="live view of a server's tables (extra `cli`: rich)")
  p.add_argument("server", metavar="SERVER", help=common.TARGET_HELP)
  p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                 help="seconds between refreshes (default 1)")
  p.add_argument("--once", action="store_true",
                 help="print the view once and exit (no live screen, no rates)")
  p.set_defaults(func=_cmd_top)

  p = sub.add_parser("check", help="run the invariant checker over every table")
  p.add_argument("server", metavar="SERVER", help=common.TARGET_HELP)
  p.add_argument("--json", action="store_true",
                 help="print {server, ok, report} as JSON (exit code 1 still means a violation)")
  p.set_defaults(func=_cmd_check)

  p = sub.add_parser(
      "gc", help="remove segments and port aliases of dead servers",
      description="Remove the segments, port aliases and sidecar files (and with --storage the "
      "arena files) that servers whose owner process is dead left on this host.",
      epilog="exit status: 0 when every named server exists on this host (whether or not "
      "anything of it was stale: a live server is left alone and reported), and always without "
      "SERVER; 1 when a named SERVER has nothing on this host (the others are still cleaned); "
      "2 on a bad argument or an error")
  p.add_argument("servers", nargs="*", metavar="SERVER",
                 help="only consider these servers (names, shm://NAME or localhost:PORT; "
                 "default: all)")
  p.add_argument("--dry-run", action="store_true",
                 help="print what would be removed; remove nothing")
  p.add_argument("--storage", metavar="DIR", default=None,
                 help="a disk-tier directory (Server storage=): also remove its arena files "
                      "whose server is gone (e.g. after /dev/shm was cleared by a reboot)")
  p.set_defaults(func=_cmd_gc)

  p = sub.add_parser("serve", help="serve tables from a ReverbServerConfig text file")
  p.add_argument("--config", required=True, help="file holding a text-format ReverbServerConfig")
  serving.add_arguments(p)
  p.set_defaults(func=_cmd_serve)

  p = sub.add_parser("bridge", help="serve a server's tables over gRPC (extra `bridge`)")
  p.add_argument("server", metavar="SERVER", help=common.TARGET_HELP)
  p.add_argument("--port", type=int, required=True, help="TCP port to listen on (0: any free one)")
  p.add_argument("--host", default="127.0.0.1",
                 help="bind address (default 127.0.0.1); non-loopback needs TLS or a token")
  p.add_argument("--token", help="auth token clients must send (default: $REVERB_SHM_BRIDGE_TOKEN)")
  p.add_argument("--tls-cert", metavar="PEM", help="PEM server certificate chain")
  p.add_argument("--tls-key", metavar="PEM", help="PEM server private key")
  p.add_argument("--client-ca", metavar="PEM", help="PEM CA that client certificates must chain to")
  p.add_argument("--max-message-mb", type=int, default=1024, metavar="MIB",
                 help="largest item/chunk message accepted (MiB, default 1024)")
  p.add_argument("--max-stream-chunks", type=int, default=1 << 16, metavar="N",
                 help="chunks one writer stream may hold (default 65536)")
  p.set_defaults(func=_cmd_bridge)

  p = sub.add_parser("metrics", help="serve a server's Prometheus metrics (extra `metrics`)")
  p.add_argument("server", metavar="SERVER", help=common.TARGET_HELP)
  p.add_argument("--port", type=int, required=True,
                 help="TCP port of the endpoint http://ADDR:PORT/metrics (0: any free one)")
  p.add_argument("--addr", default="127.0.0.1",
                 help="interface to listen on (default 127.0.0.1; 0.0.0.0 for a Prometheus "
                 "server on another host)")
  p.set_defaults(func=_cmd_metrics)

  p = sub.add_parser("checkpoint", help="write a checkpoint of a server")
  p.add_argument("server", metavar="SERVER", help=common.REMOTE_TARGET_HELP)
  p.set_defaults(func=_cmd_checkpoint)
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  common.setup_logging(args.log_level)

  def run() -> int:
    try:
      return args.func(args)
    except (errors.ReverbError, ValueError, OSError, ImportError, NotImplementedError) as e:
      # (NotImplementedError: a HOST:PORT whose gRPC server is not a reverb_shm bridge)
      if isinstance(e, BrokenPipeError):
        raise
      print(f"reverb-shm {args.command}: {e}", file=sys.stderr)
      return 2
  return common.run_quietly_on_broken_pipe(run)


if __name__ == "__main__":
  sys.exit(main())
