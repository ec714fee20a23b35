"""The command line as a service operator uses it: servers that keep their data across SIGTERM
and SIGKILL restarts, metrics from `serve` and from the sidecar, addresses instead of names,
JSON output, quiet broken pipes, help text on every argument, and no print() in the library."""
import argparse
import ast
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

import reverb_shm
from reverb_shm import cli, rate_limiters, selectors

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(reverb_shm.__file__)))
needs_protobuf = pytest.mark.skipif(
    __import__("importlib").util.find_spec("google.protobuf") is None,
    reason="protobuf (extra 'server') not installed")
CONFIG = ('tables { table_name: "t" sampler { fifo: true } remover { fifo: true } max_size: 1000 '
          'rate_limiter { samples_per_insert: 1 min_size_to_sample: 1 '
          'min_diff: -1.7976931348623157e+308 max_diff: 1.7976931348623157e+308 } }')


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _Proc:
  """A `reverb-shm` / `reverb_server` child process whose stdout lines are read as they come."""

  def __init__(self, *args):
    self.proc = subprocess.Popen([sys.executable, "-m", "reverb_shm.cli", *args], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    self.lines = []

  def line_with(self, text, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      line = self.proc.stdout.readline()
      if not line:
        raise AssertionError(f"exited before printing {text!r}: {self.lines} "
                             f"{self.proc.stderr.read()}")
      self.lines.append(line)
      if text in line:
        return line
    raise AssertionError(f"no {text!r} within {timeout} s: {self.lines}")

  def finish(self, sig=signal.SIGTERM, timeout=60):
    self.proc.send_signal(sig)
    out, err = self.proc.communicate(timeout=timeout)
    self.lines += out.splitlines(keepends=True)
    return self.proc.returncode, "".join(self.lines), err

  def kill(self):
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait(10)


@pytest.fixture
def procs(server_name):
  started = []

  def start(*args):
    p = _Proc(*args)
    started.append(p)
    return p

  yield start
  for p in started:
    p.kill()
  # only this test's server: other runs on the host keep their dead-server fixtures
  subprocess.run([sys.executable, "-m", "reverb_shm.cli", "gc", server_name], cwd=REPO,
                 capture_output=True, timeout=60, check=False)


def _serve(procs, tmp_path, name, port, *extra):
  cfg = tmp_path / "cfg.txt"
  cfg.write_text(CONFIG + f" port: {port}")
  p = procs("serve", "--config", str(cfg), "--name", name, "--arena-mib", "8", *extra)
  p.line_with("Ctrl-C or SIGTERM stops")
  return p


def _items(port):
  table = reverb_shm.Client(f"localhost:{port}").shared_table("t")
  items = table.items()
  return sorted(int(k) for k in items["key"])


@needs_protobuf
def test_serve_keeps_its_data_across_sigterm_with_checkpoint_on_exit(procs, tmp_path, server_name):
  port, ckpt = _free_port(), str(tmp_path / "ckpt")
  p = _serve(procs, tmp_path, server_name, port, "--checkpoint-dir", ckpt, "--checkpoint-on-exit")
  assert any(f"checkpoints in {ckpt}" in line and "on exit" in line for line in p.lines)
  client = reverb_shm.Client(f"localhost:{port}")
  for i in range(20):
    client.insert(np.full(3, i, np.float32), {"t": 1.0})
  keys = _items(port)
  keys_in_order = [int(k) for k in client.shared_table("t").items()["key"]]
  code, out, _ = p.finish(signal.SIGTERM)
  assert code == 0
  assert "SIGTERM received" in out and "checkpoint written to" in out and "stopped" in out
  assert not os.path.exists(f"/dev/shm/rvshm.{server_name}")

  p = _serve(procs, tmp_path, server_name, port, "--checkpoint-dir", ckpt)
  assert any("t (20 items)" in line for line in p.lines), p.lines
  assert _items(port) == keys
  client = reverb_shm.Client(f"localhost:{port}")   # the first one holds the stopped segment
  first = next(client.sample("t", 1, emit_timesteps=False))   # Fifo sampler: the oldest item
  assert first.info.key == keys_in_order[0] and first.data[0].tolist() == [[0.0, 0.0, 0.0]]
  assert p.finish(signal.SIGINT)[0] == 0


@needs_protobuf
def test_serve_keeps_what_a_periodic_checkpoint_saved_across_sigkill(procs, tmp_path, server_name):
  port, ckpt = _free_port(), str(tmp_path / "ckpt")
  p = _serve(procs, tmp_path, server_name, port, "--checkpoint-dir", ckpt,
             "--checkpoint-every", "0.3")
  client = reverb_shm.Client(f"localhost:{port}")
  for i in range(7):
    client.insert(np.full(3, i, np.float32), {"t": 1.0})
  keys = _items(port)
  first = time.time()
  while time.time() - first < 30:   # a checkpoint written after the inserts
    done = [d for d in glob.glob(os.path.join(ckpt, "*")) if os.path.basename(d)[0].isdigit()]
    if done and os.path.getmtime(max(done)) > first + 0.05:
      break
    time.sleep(0.1)
  else:
    raise AssertionError(f"no periodic checkpoint in {ckpt}")
  time.sleep(0.5)   # the next one, complete
  p.proc.kill()
  p.proc.wait(10)
  p = _serve(procs, tmp_path, server_name, port, "--checkpoint-dir", ckpt)
  assert _items(port) == keys
  assert p.finish()[0] == 0


@needs_protobuf
def test_checkpoint_options_need_a_directory(capsys):
  assert cli.main(["serve", "--config", "/dev/null", "--checkpoint-every", "5"]) == 2
  assert "--checkpoint-every and --checkpoint-on-exit need --checkpoint-dir" in capsys.readouterr().err


@needs_protobuf
@pytest.mark.parametrize("every", ["0", "-1", "nan", "inf", "1e10"])
def test_checkpoint_every_out_of_range_is_refused(capsys, tmp_path, every):
  assert cli.main(["serve", "--config", "/dev/null", "--checkpoint-dir", str(tmp_path),
                   "--checkpoint-every", every]) == 2
  assert "--checkpoint-every must be a number of seconds in (0, " in capsys.readouterr().err
  assert not os.listdir(tmp_path)   # refused before anything started


@needs_protobuf
def test_reverb_server_takes_the_checkpoint_options(tmp_path, server_name):
  port, ckpt = _free_port(), str(tmp_path / "ckpt")
  code = "import sys; from reverb_shm import cli; sys.exit(cli.reverb_server_main(sys.argv[1:]))"
  proc = subprocess.Popen([sys.executable, "-c", code, "--config", CONFIG + f" port: {port}",
                           "--checkpoint-dir", ckpt, "--checkpoint-on-exit"], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    while "Ctrl-C or SIGTERM stops" not in proc.stdout.readline():
      assert proc.poll() is None
    reverb_shm.Client(f"localhost:{port}").insert(np.float32([1, 2, 3]), {"t": 1.0})
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "checkpoint written to" in out
    assert "checkpoint of server" in err    # the library's log line, through the CLI's handler
  finally:
    if proc.poll() is None:
      proc.kill()
  assert len([d for d in os.listdir(ckpt) if d[0].isdigit()]) == 1


@needs_protobuf
def test_serve_metrics_port_and_the_sidecar_serve_the_same_counts(procs, tmp_path, server_name):
  parser = pytest.importorskip("prometheus_client.parser")
  port = _free_port()
  p = _serve(procs, tmp_path, server_name, port, "--metrics-port", "0")
  url = next(l for l in p.lines if "Prometheus metrics on" in l).split()[-1]
  side = procs("metrics", f"localhost:{port}", "--port", "0")
  side_url = side.line_with("serving Prometheus metrics").split(" on ")[-1].split(";")[0]
  client = reverb_shm.Client(f"localhost:{port}")
  for i in range(5):
    client.insert(np.float32([i, i, i]), {"t": 1.0})
  list(client.sample("t", 2))
  for u in (url, side_url):
    text = urllib.request.urlopen(u, timeout=10).read().decode()
    values = {(s.name, s.labels.get("table")): s.value
              for f in parser.text_string_to_metric_families(text) for s in f.samples}
    assert values[("reverb_shm_table_inserts_total", "t")] == 5
    assert values[("reverb_shm_table_samples_total", "t")] == 2
    assert values[("reverb_shm_table_items", "t")] == 5
  code, out, _ = side.finish(signal.SIGTERM)
  assert code == 0 and "stopped (SIGTERM)" in out
  assert p.finish()[0] == 0


# ---------------------------------------------------------------- addresses, JSON, pipes
def _table():
  return reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100, rate_limiters.MinSize(1))


def test_every_server_command_takes_an_address_or_a_name(server_factory, capsys, tmp_path):
  server = server_factory([_table()])
  server.localhost_client().insert(np.float32(1), {"t": 1.0})
  for target in (server.name, f"shm://{server.name}", f"localhost:{server.port}",
                 f"127.0.0.1:{server.port}"):
    assert cli.main(["info", target, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == server.name and info["tables"]["t"]["items"] == 1
    assert cli.main(["check", target, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"server": server.name, "ok": True, "report": ""}
    assert cli.main(["top", target, "--once"]) == 0
    out = capsys.readouterr().out
    assert server.name in out and "1/100" in out
    assert cli.main(["gc", target, "--dry-run"]) == 0
    assert "would remove 0 stale object(s)" in capsys.readouterr().out
    assert cli.main(["checkpoint", target]) == 0
    assert os.path.isdir(capsys.readouterr().out.strip().splitlines()[-1])


def test_an_address_with_no_server_is_a_clear_error(capsys):
  port = _free_port()
  assert cli.main(["info", f"localhost:{port}"]) == 2
  assert f"no reverb_shm server is registered on port {port}" in capsys.readouterr().err


def test_an_address_of_a_grpc_server_that_is_no_bridge_is_a_clear_error(capsys):
  grpc = pytest.importorskip("grpc")
  from concurrent import futures  # pylint: disable=import-outside-toplevel
  other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))   # (serves no method)
  port = other.add_insecure_port("127.0.0.1:0")
  other.start()
  try:
    for command in ("info", "checkpoint"):
      assert cli.main([command, f"localhost:{port}"]) == 2
      err = capsys.readouterr().err
      assert err.startswith(f"reverb-shm {command}: bridge localhost:{port}: UNIMPLEMENTED") \
          and err.count("\n") == 1, err
  finally:
    other.stop(0)


def test_commands_that_need_shared_memory_refuse_a_remote_address(capsys):
  assert cli.main(["top", "example.invalid:1234"]) == 2
  assert "run it on the server's host" in capsys.readouterr().err


def test_list_json_names_the_live_server(server_factory, capsys):
  server = server_factory([_table()])
  assert cli.main(["list", "--json"]) == 0
  rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
  assert rows[server.name]["state"] == "live" and rows[server.name]["owner_pid"] == os.getpid()


def test_output_into_a_closed_pipe_ends_quietly(server_factory):
  server = server_factory([reverb_shm.Table(f"t{i}", selectors.Uniform(), selectors.Fifo(), 10,
                                            rate_limiters.MinSize(1)) for i in range(300)])
  for args in (["info", server.name], ["info", server.name, "--json"], ["list"]):
    read, write = os.pipe()
    os.close(read)      # the reader (`head`) is gone before the first write
    proc = subprocess.run([sys.executable, "-m", "reverb_shm.cli", *args], cwd=REPO, stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    os.close(write)
    assert proc.returncode == 128 + signal.SIGPIPE, proc.stderr
    assert proc.stderr == "", proc.stderr
  head = subprocess.run(f"{sys.executable} -m reverb_shm.cli info {server.name} | head -n 2",
                        shell=True, cwd=REPO, capture_output=True, text=True, timeout=60,
                        check=False)
  assert len(head.stdout.splitlines()) == 2 and head.stderr == ""


def _walk(parser, path=()):
  yield path, parser
  for action in parser._actions:  # pylint: disable=protected-access
    if isinstance(action, argparse._SubParsersAction):  # pylint: disable=protected-access
      for name, sub in action.choices.items():
        yield from _walk(sub, path + (name,))


def test_every_argument_of_every_command_has_help():
  parsers = list(_walk(cli.build_parser()))
  parsers.append((("reverb_server",), cli.reverb_server_parser()))
  assert {p[0] for p, _ in parsers if p} >= {"list", "info", "top", "check", "gc", "serve",
                                              "bridge", "metrics", "checkpoint", "reverb_server"}
  for path, parser in parsers:
    for action in parser._actions:  # pylint: disable=protected-access
      if isinstance(action, argparse._HelpAction):  # pylint: disable=protected-access
        continue
      assert action.help and action.help != argparse.SUPPRESS, (path, action.dest)


def test_the_library_never_prints():
  root = os.path.dirname(os.path.abspath(reverb_shm.__file__))
  offenders = []
  for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
    rel = os.path.relpath(path, root)
    if rel.startswith("cli" + os.sep):
      continue
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
        offenders.append(f"{rel}:{node.lineno}")
  assert not offenders, offenders


def test_info_and_checkpoint_work_through_a_bridge_address(server_factory, capsys):
  pytest.importorskip("grpc")
  from conftest import bridge_process  # pylint: disable=import-outside-toplevel
  server = server_factory([_table()])
  server.localhost_client().insert(np.float32([1, 2]), {"t": 1.0})
  with bridge_process(server) as (proc, address):
    assert cli.main(["info", address, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["address"] == address and info["tables"]["t"]["current_size"] == 1
    assert cli.main(["checkpoint", address]) == 0
    assert os.path.isdir(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli.main(["top", address]) == 2
    assert "where no reverb_shm server is registered" in capsys.readouterr().err
  # bridge_process ended it with SIGTERM: a clean stop, with a line saying so
  assert proc.returncode == 0 and "stopped (SIGTERM)" in proc.stdout.read()


def test_a_local_port_of_another_service_is_not_called_a_bridge(server_factory, capsys):
  server = server_factory([_table()], metrics_port=0)   # (an HTTP endpoint, not a bridge)
  assert cli.main(["top", f"localhost:{server.metrics_port}"]) == 2
  err = capsys.readouterr().err
  assert "is a gRPC bridge" not in err and \
      f"something else listens on port {server.metrics_port}" in err, err


@needs_protobuf
def test_a_bridge_stopped_past_its_wait_ends_at_sigterm_after_sigcont(server_factory):
  """SIGTERM right after SIGCONT, to a `reverb-shm bridge` process stopped longer than its
  serving loop's 0.5 s wait: the process resumes inside that wait, and the stop signal lands
  there. A handler that set a threading.Event deadlocked on the Event's own lock (the process
  never ended); the process must end, with status 0, every time."""
  pytest.importorskip("grpc")
  from conftest import bridge_process, stop_process  # pylint: disable=import-outside-toplevel
  server = server_factory([reverb_shm.Table.queue("queue", 10)])
  for _ in range(3):
    with bridge_process(server) as (proc, _):
      stop_process(proc.pid)
      time.sleep(0.7)
      os.kill(proc.pid, signal.SIGCONT)
      os.kill(proc.pid, signal.SIGTERM)
      assert proc.wait(timeout=15) == 0
      assert "stopped (SIGTERM)" in proc.stdout.read()


def test_serve_takes_max_bytes_and_storage(procs, tmp_path, server_name):
  from reverb_shm._internal import shm  # pylint: disable=import-outside-toplevel
  port, disk = _free_port(), tmp_path / "disk"
  disk.mkdir()
  p = _serve(procs, tmp_path, server_name, port, "--max-bytes", "96M", "--storage", str(disk))
  assert any("grows up to max_bytes 96.0 MiB" in line and str(disk) in line
             for line in p.lines), p.lines
  info = shm.Segment.attach(server_name).info()
  assert info["max_bytes"] == 96 << 20 and info["arena_file"] == 1, info
  files = os.listdir(disk)
  assert len(files) == 1 and files[0].startswith(f"rvshm.{server_name}.") and \
      files[0].endswith(".arena"), files
  client = reverb_shm.Client(f"localhost:{port}")
  for i in range(20):
    client.insert(np.full(3, i, np.float32), {"t": 1.0})
  first = next(client.sample("t", 1, emit_timesteps=False))   # Fifo: the oldest
  assert first.data[0].tolist() == [[0.0, 0.0, 0.0]]
  code, _, _ = p.finish(signal.SIGTERM)
  assert code == 0 and os.listdir(disk) == []     # the arena file went with the server


@needs_protobuf
@pytest.mark.parametrize("option, message", [
    (("--max-bytes", "12X"), "invalid size '12X'"),
    (("--max-bytes", "0"), "expected a positive number of bytes"),
    (("--max-bytes", "1K"), "is below the"),
    (("--storage", "/nonexistent/reverb_shm"), "is not a directory"),
])
def test_serve_refuses_bad_sizing_options(tmp_path, server_name, option, message):
  cfg = tmp_path / "cfg.txt"
  cfg.write_text(CONFIG)
  proc = subprocess.run([sys.executable, "-m", "reverb_shm.cli", "serve", "--config", str(cfg),
                         "--name", server_name, *option], cwd=REPO, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr
  assert not os.path.exists(f"/dev/shm/rvshm.{server_name}")
