"""`reverb-shm top` driven in a pseudo-terminal (pexpect) against a server process under load:
rates move, a blocked table shows as blocked, q exits, and it ends when the server goes away."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pexpect = pytest.importorskip("pexpect")
pytest.importorskip("rich")

pytestmark = pytest.mark.timeout(90)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")

_LOADED_SERVER = textwrap.dedent("""
    import sys, threading, time
    import numpy as np
    import reverb_shm as reverb
    from reverb_shm import rate_limiters, selectors
    tables = [
        reverb.Table("busy", selectors.Uniform(), selectors.Fifo(), 100_000, rate_limiters.MinSize(1)),
        reverb.Table("starved", selectors.Uniform(), selectors.Fifo(), 100,
                     rate_limiters.SampleToInsertRatio(1.0, 1, 2.0)),
    ]
    server = reverb.Server(tables, name=sys.argv[1], arena_bytes=32 << 20, max_procs=16,
                           pins_per_proc=1024)
    client = server.localhost_client()

    def insert():
      i = 0
      while not server.stopped:
        try:
          client.insert(np.float32(i), {"busy": 1.0})
        except Exception:
          return
        i += 1
        time.sleep(0.002)

    def starve():   # blocks on the rate limiter: the table is empty
      try:
        server.shared_table("starved").sample(1, timeout_ms=120_000)
      except Exception:
        pass

    for fn in (insert, starve):
      threading.Thread(target=fn, daemon=True).start()
    print(server.port, flush=True)
    sys.stdin.read()      # until the test closes stdin
    server.stop()
""")


@pytest.fixture
def loaded_server(server_name):
  proc = subprocess.Popen([sys.executable, "-c", _LOADED_SERVER, server_name],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  port = int(proc.stdout.readline())
  yield proc, port
  if proc.poll() is None:
    proc.stdin.close()
    try:
      proc.wait(20)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def _default_sigint():
  """(In the child before exec) SIGINT and SIGQUIT at their defaults, as a shell gives a
  foreground command: a suite started in the background by a non-interactive shell (`cmd &`)
  runs with both ignored, which every child would inherit, and Python keeps an inherited SIGINT
  ignore (no KeyboardInterrupt)."""
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _top(target):
  exe = os.path.join(os.path.dirname(sys.executable), "reverb-shm")
  return pexpect.spawn(exe, ["top", target, "--interval", "0.5"], dimensions=(40, 220),
                       encoding="utf-8", timeout=20, env={**os.environ, "TERM": "xterm"},
                       preexec_fn=_default_sigint)


def _rate(cell):
  scale = {"k": 1e3, "M": 1e6}.get(cell[-1:], 1.0)
  return float(cell.rstrip("kM")) * scale


def _rows(text, table):
  """The table's rows in the captured screen output, as lists of cells."""
  rows = []
  for line in _ANSI.sub("", text).split("\n"):
    cells = [c.strip() for c in line.split("│")]
    if cells and cells[0] == table:
      rows.append(cells)
  return rows


def test_top_shows_rates_and_a_blocked_table_and_quits_on_q(loaded_server):
  _, port = loaded_server
  top = _top(f"localhost:{port}")
  seen = ""
  deadline = time.monotonic() + 15
  while time.monotonic() < deadline:
    try:
      top.expect("q or Ctrl-C quits", timeout=10)
    except pexpect.TIMEOUT:
      break
    seen += top.before
    busy = _rows(seen, "busy")
    if len([r for r in busy if _rate(r[2]) > 0]) >= 2:
      break
  busy, starved = _rows(seen, "busy"), _rows(seen, "starved")
  rates = [_rate(r[2]) for r in busy]            # column "ins/s"
  assert len(rates) >= 3 and sum(r > 0 for r in rates) >= 2, rates
  counts = [int(r[1].split("/")[0]) for r in busy]   # items grow between refreshes
  assert counts[-1] > counts[0]
  assert starved and starved[-1][-1] == "BLOCKED sample" and starved[-1][9] == "1"
  top.send("q")
  top.expect(pexpect.EOF, timeout=10)
  top.close()
  assert top.exitstatus == 0


def test_top_exits_when_the_server_goes_away(loaded_server, server_name):
  proc, _ = loaded_server
  top = _top(server_name)
  top.expect("q or Ctrl-C quits")
  proc.stdin.close()     # the server stops
  top.expect(f"server '{server_name}' stopped", timeout=20)
  top.expect(pexpect.EOF, timeout=10)
  top.close()
  assert top.exitstatus == 0


def test_top_says_when_the_server_process_died(loaded_server, server_name):
  proc, _ = loaded_server
  top = _top(server_name)
  top.expect("q or Ctrl-C quits")
  proc.kill()     # SIGKILL: the server never stops
  proc.wait()
  try:
    top.expect(f"server '{server_name}' died", timeout=20)
    top.expect(pexpect.EOF, timeout=10)
    top.close()
    assert top.exitstatus == 0
  finally:
    subprocess.run([sys.executable, "-m", "reverb_shm.cli", "gc", server_name],
                   capture_output=True, timeout=60, check=True)


def _where(pid: int) -> str:
  """What a process that did not end is doing: its signal masks and state, and the kernel's
  and its threads' wait channels (for the failure message)."""
  out = []
  try:
    with open(f"/proc/{pid}/status") as f:
      out += [line.strip() for line in f if line.split(":")[0] in
              ("State", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt", "Threads")]
    for tid in os.listdir(f"/proc/{pid}/task"):
      with open(f"/proc/{pid}/task/{tid}/wchan") as f:
        wchan = f.read()
      with open(f"/proc/{pid}/task/{tid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
      out.append(f"thread {tid}: state {state} wchan {wchan}")
  except OSError as e:
    out.append(f"({e})")
  return "; ".join(out)


def test_top_ends_on_ctrl_c(loaded_server, server_name):
  top = _top(server_name)
  top.expect("q or Ctrl-C quits")
  top.kill(signal.SIGINT)
  try:
    top.expect(pexpect.EOF, timeout=10)
  except pexpect.TIMEOUT:
    pytest.fail(f"top did not end within 10 s of SIGINT: {_where(top.pid)}")
  top.close()
  assert top.exitstatus == 0 and "Traceback" not in top.before


def test_names_and_titles_are_shown_as_written_and_the_last_line_ends(server_factory):
  # (rich would read "[bold]" or "[min, max]" as markup and drop it)
  import io  # pylint: disable=import-outside-toplevel
  import reverb_shm  # pylint: disable=import-outside-toplevel
  from rich.console import Console  # pylint: disable=import-outside-toplevel
  from reverb_shm import rate_limiters, selectors  # pylint: disable=import-outside-toplevel
  from reverb_shm.cli import top as top_view  # pylint: disable=import-outside-toplevel
  server = server_factory([reverb_shm.Table("[bold]x", selectors.Uniform(), selectors.Fifo(),
                                            10, rate_limiters.MinSize(1))])
  out = io.StringIO()
  assert top_view.run(server.name, iterations=1, console=Console(file=out, width=240)) == "done"
  rows = _rows(out.getvalue(), "[bold]x")
  assert len(rows) == 1 and rows[0][1] == "0/10", out.getvalue()
  assert "diff [min, max]" in out.getvalue()
  out = io.StringIO()   # (the live view into a file: what a reason printed after it follows)
  assert top_view.run(server.name, interval=0.01, iterations=2,
                      console=Console(file=out, width=240)) == "done"
  assert out.getvalue().endswith("q or Ctrl-C quits\n"), out.getvalue()[-100:]


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "inf", "1e308"])
def test_an_interval_out_of_range_is_a_clear_error(server_name, interval):
  out = subprocess.run([sys.executable, "-m", "reverb_shm.cli", "top", server_name, "--interval",
                        interval], capture_output=True, text=True, timeout=60)
  assert out.returncode == 2 and out.stderr.startswith(
      "reverb-shm top: interval must be > 0 and at most 86400 seconds"), out.stderr


def test_a_narrow_terminal_leaves_columns_out_instead_of_squeezing_them(server_factory):
  import io  # pylint: disable=import-outside-toplevel
  import reverb_shm  # pylint: disable=import-outside-toplevel
  from rich.console import Console  # pylint: disable=import-outside-toplevel
  from reverb_shm import rate_limiters, selectors  # pylint: disable=import-outside-toplevel
  from reverb_shm.cli import top as top_view  # pylint: disable=import-outside-toplevel
  server = server_factory([reverb_shm.Table("replay_buffer", selectors.Uniform(),
                                            selectors.Fifo(), 1000, rate_limiters.MinSize(1))])
  out = io.StringIO()
  top_view.run(server.name, iterations=1, console=Console(file=out, width=80))
  text = out.getvalue()
  assert "…" not in text, text
  (row,) = _rows(text, "replay_buffer")
  assert row[1] == "0/1000" and row[-1] == "ok", row
  assert "columns left out (terminal 80 wide): del/s, evict/s" in text
  out = io.StringIO()
  top_view.run(server.name, iterations=1, console=Console(file=out, width=240))
  assert "left out" not in out.getvalue() and len(_rows(out.getvalue(), "replay_buffer")[0]) == 14
