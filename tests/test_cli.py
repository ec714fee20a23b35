"""`reverb-shm` command line: list, info, check and gc against real servers."""
import os
import signal
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import reverb_shm
from reverb_shm import cli, rate_limiters, selectors
from reverb_shm._internal import shm

pytestmark = pytest.mark.timeout(60)


def _table():
  return reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 100, rate_limiters.MinSize(1))


def test_info_and_check_on_a_live_server(server_factory, capsys):
  server = server_factory([_table()])
  client = reverb_shm.Client(f"localhost:{server.port}")
  client.insert([1.0, 2.0], {"t": 1.0})
  assert cli.main(["info", server.name]) == 0
  out = capsys.readouterr().out
  assert "table 't': size 1/100, inserts 1" in out
  assert cli.main(["check", server.name]) == 0
  assert "all invariants hold" in capsys.readouterr().out


def test_info_prints_the_segment_breakdown_of_what_is_reserved(server_factory, capsys):
  server = server_factory([_table()], max_procs=8, pins_per_proc=1024, arena_bytes=4 << 20,
                          max_bytes=64 << 20)
  server.localhost_client().insert([0, 1], priorities={"t": 1.0})   # this process: 1024 pins
  info = server.segment.info()
  # A growable segment reserves the first 1024 pins of every slot's pin log at start.
  assert info["pins_per_proc"] == 1024 and info["pins_reserved"] == 8 * 1024 * 12
  assert cli.main(["info", server.name]) == 0
  out = capsys.readouterr().out
  rest = info["reserved_bytes"] - (4 << 20) - 8 * 1024 * 12
  assert (f"segment: {info['reserved_bytes'] / 2**20:.1f} MiB reserved of max_bytes 64.0 MiB = "
          f"arena 4.0 MiB (0 extent(s) added) + pin logs 0.1 MiB (grown per process as needed, "
          f"up to 1024 pins x 12 bytes) + tables' metadata, counters and header "
          f"{rest / 2**20:.1f} MiB") in out
  assert 0 < rest < 1 << 20
  # What the file holds in /dev/shm is what the segment reserved (plus page rounding).
  held = os.stat(f"/dev/shm/rvshm.{server.name}").st_blocks * 512
  assert info["reserved_bytes"] <= held <= info["reserved_bytes"] + 3 * 4096


def test_info_of_a_disk_tier_server_bounds_the_file_by_max_bytes_not_dev_shm(
    server_factory, capsys, tmp_path):
  server = server_factory([_table()], storage=str(tmp_path), arena_bytes=4 << 20,
                          max_bytes=24 << 20)
  for _ in range(30):   # 30 rows of 400 KB: the arena grows past 4 MiB, in the file
    server.localhost_client().insert(np.zeros(100_000, np.float32), priorities={"t": 1.0})
  info = server.segment.info()
  assert info["arena_size"] > 4 << 20
  assert cli.main(["info", server.name]) == 0
  out = capsys.readouterr().out
  in_shm = (info["reserved_bytes"] - info["arena_size"]) / 2**20
  assert f"segment: {in_shm:.1f} MiB in /dev/shm = pin logs " in out, out
  assert (f"disk tier: arena {info['arena_size'] / 2**20:.1f} MiB ({info['extents']} extent(s) "
          f"added) of max_bytes 24.0 MiB, in the file {server.segment.arena_path}") in out, out
  assert "reserved of max_bytes" not in out


def test_unknown_server_is_a_clear_error(capsys):
  assert cli.main(["info", "no_such_server_xyz"]) == 2
  assert "no reverb_shm server named 'no_such_server_xyz'" in capsys.readouterr().err


def test_gc_removes_segment_of_a_killed_server(server_name, capsys):
  code = textwrap.dedent(f"""
      import sys, time, reverb_shm
      from reverb_shm import selectors, rate_limiters
      t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10, rate_limiters.MinSize(1))
      s = reverb_shm.Server([t], name={server_name!r}, arena_bytes=1 << 20)
      print(s.port, flush=True)
      time.sleep(60)
  """)
  proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  try:
    port = int(proc.stdout.readline())
    path = f"/dev/shm/rvshm.{server_name}"
    assert os.path.exists(path)
    assert cli.main(["list"]) == 0
    assert f"{server_name}" in capsys.readouterr().out
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
  assert cli.main(["list"]) == 0
  listing = capsys.readouterr().out
  assert server_name in listing and "STALE" in listing
  # Only this test's server: the suite never removes other people's stale segments.
  assert cli.main(["gc", server_name, "--dry-run"]) == 0
  assert os.path.exists(path)
  dry = capsys.readouterr().out   # the dry run names what the real one removes
  assert f"would remove /dev/shm/rvshm-checkpointer.{server_name}" in dry, dry
  assert "would remove 3 stale object(s)" in dry, dry
  assert cli.main(["gc", server_name]) == 0
  out = capsys.readouterr().out
  assert path in out and f"/dev/shm/rvshm.port.{port}" in out
  # nothing but this server's segment, port alias and checkpointer settings
  assert f"/dev/shm/rvshm-checkpointer.{server_name}" in out
  assert "removed 3 stale object(s)" in out
  assert not os.path.exists(path)
  assert not os.path.exists(f"/dev/shm/rvshm.port.{port}")


def test_gc_removes_sidecars_of_servers_that_are_gone(server_name, capsys):
  path = shm.sidecar_path(server_name, "checkpointer")
  with open(path, "w") as f:   # as left by a server killed before it could remove it
    f.write("{}")
  try:
    assert os.path.exists(path) and not os.path.exists(shm.segment_path(server_name))
    assert cli.main(["gc", server_name]) == 0
    assert path in capsys.readouterr().out
    assert not os.path.exists(path)
  finally:
    if os.path.exists(path):
      os.unlink(path)


def test_gc_keeps_sidecars_of_live_servers(server_factory):
  server = server_factory([_table()])
  path = shm.sidecar_path(server.name, "checkpointer")
  assert os.path.exists(path)   # the default checkpointer's published settings
  assert cli.main(["gc", server.name]) == 0
  assert os.path.exists(path)


def test_gc_of_a_name_that_matches_nothing_exits_1_and_says_so(server_factory, server_name,
                                                               capsys):
  live = server_factory([_table()])
  stale = shm.sidecar_path(server_name, "checkpointer")   # left by a server that is gone
  with open(stale, "w") as f:
    f.write("{}")
  nosuch = server_name + "_nosuch"
  try:
    for argv in (["gc", nosuch], ["gc", "--dry-run", nosuch]):
      assert cli.main(argv) == 1
      out = capsys.readouterr()
      assert out.out == "", out   # nothing considered: not every server's files
      assert out.err == (f"reverb-shm gc: no server named {nosuch!r} on this host (no segment, "
                         "port alias or sidecar file in /dev/shm)\n")
    assert os.path.exists(stale)
    # One unknown name among known ones: the known ones are still cleaned, the exit code says.
    assert cli.main(["gc", nosuch, server_name, live.name]) == 1
    out = capsys.readouterr()
    assert not os.path.exists(stale) and f"removed {stale}" in out.out
    assert (f"server {live.name!r} is live (owner pid {os.getpid()}): left alone"
            in out.out), out.out
    assert "removed 1 stale object(s)" in out.out
    assert f"no server named {nosuch!r}" in out.err and live.name not in out.err
  finally:
    if os.path.exists(stale):
      os.unlink(stale)


def test_gc_with_nothing_stale_exits_0(server_factory, capsys):
  live = server_factory([_table()])
  assert cli.main(["gc", live.name]) == 0
  out = capsys.readouterr()
  assert out.out == (f"server {live.name!r} is live (owner pid {os.getpid()}): left alone\n"
                     "removed 0 stale object(s), 0.0 MiB\n")
  assert out.err == ""
  assert os.path.exists(shm.segment_path(live.name))


def test_gc_of_a_port_no_server_registered_exits_1(capsys):
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    assert not os.path.exists(f"/dev/shm/rvshm.port.{port}")
    assert cli.main(["gc", f"localhost:{port}"]) == 1
  out = capsys.readouterr()
  assert out.out == ""
  assert out.err == f"reverb-shm gc: no server was registered on port {port} of this host\n"


def test_gc_help_documents_its_exit_status(capsys):
  with pytest.raises(SystemExit):
    cli.main(["gc", "--help"])
  help_text = " ".join(capsys.readouterr().out.split())
  assert "1 when a named SERVER has nothing on this host" in help_text
  assert "exit status: 0 when every named server exists on this host" in help_text


def test_python_dash_m_reverb_shm_is_the_command_line():
  out = subprocess.run([sys.executable, "-m", "reverb_shm", "info", "no-such-server-here"],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 2 and "no-such-server-here" in out.stderr, out


def test_help_is_plain_text_and_python_m_reverb_shm_is_the_same_command():
  outs = [subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                         text=True, timeout=60) for module in ("reverb_shm", "reverb_shm.cli")]
  assert [o.returncode for o in outs] == [0, 0]
  assert outs[0].stdout == outs[1].stdout
  assert "reverb-shm gc [SERVER ...]" in outs[0].stdout and "reverb_server --config" in outs[0].stdout
  assert ":func:" not in outs[0].stdout and ":class:" not in outs[0].stdout
