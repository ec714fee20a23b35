"""SPEC §1 and §10: Server lifecycle across processes, the reverb_server CLI and its config."""
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import reverb_shm
from reverb_shm import cli, errors, rate_limiters, selectors
from reverb_shm.cli import server_config

pytestmark = pytest.mark.timeout(180)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_SIZE_1 = ("rate_limiter { samples_per_insert: 1 min_size_to_sample: 1 "
              "min_diff: -1.7976931348623157e+308 max_diff: 1.7976931348623157e+308 }")


_children = []


@pytest.fixture(autouse=True)
def _kill_leftover_children():
  """A failed test must not leave its server subprocess running."""
  yield
  while _children:
    proc = _children.pop()
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=10)


def _python(code: str, *args, preexec_fn=None) -> subprocess.Popen:
  proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=preexec_fn)
  _children.append(proc)
  return proc


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 60) -> str:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    line = proc.stdout.readline()
    if needle in line:
      return line
    if not line and proc.poll() is not None:
      break
  proc.kill()
  raise AssertionError(f"{needle!r} not printed; stderr: {proc.stderr.read()[-2000:]}")


@pytest.mark.parametrize("inherited_sigint", ["default", "ignored"])
def test_wait_raises_keyboard_interrupt_on_sigint_and_removes_the_segment(server_name,
                                                                          inherited_sigint):
  # "ignored": as a background job of a non-interactive shell (CI), which starts its children
  # with SIGINT ignored; Server.wait installs its own handler, as Reverb does.
  name = server_name
  proc = _python(f"""
      import reverb_shm
      from reverb_shm import rate_limiters, selectors
      server = reverb_shm.Server([reverb_shm.Table('t', selectors.Fifo(), selectors.Fifo(), 5,
                                                   rate_limiters.MinSize(1))],
                                 name={name!r}, arena_bytes=1 << 20)
      import sys, threading, time
      def announce_when_waiting():
        # 'ready' only once the main thread is blocked in the Event.wait called by Server.wait
        # (not, e.g., the one in Thread.start), so the test's SIGINT cannot land before wait's
        # handler is in place.
        main = threading.main_thread().ident
        waiting = (threading.Event.wait.__code__, type(server).wait.__code__)
        while True:
          frame = sys._current_frames().get(main)
          while frame is not None and (
              frame.f_code, getattr(frame.f_back, "f_code", None)) != waiting:
            frame = frame.f_back
          if frame is not None:
            print('ready', flush=True)
            return
          time.sleep(0.01)
      threading.Thread(target=announce_when_waiting, daemon=True).start()
      try:
        server.wait()
      except KeyboardInterrupt:
        print('KeyboardInterrupt', server.stopped, flush=True)
      """, preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
           if inherited_sigint == "ignored" else None)
  _wait_for_line(proc, "ready")
  assert os.path.exists(f"/dev/shm/rvshm.{name}")
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=60)
  assert "KeyboardInterrupt True" in out
  assert not os.path.exists(f"/dev/shm/rvshm.{name}")


@pytest.mark.parametrize("blocked_call", ["sample", "insert"])
def test_stop_wakes_calls_blocked_in_another_process(server_factory, blocked_call):
  server = server_factory([reverb_shm.Table.queue("q", 1)])
  if blocked_call == "insert":
    server.localhost_client().insert(np.int64(0), {"q": 1.0})   # full: the next insert blocks
  proc = _python(f"""
      import sys, time, numpy as np, reverb_shm
      client = reverb_shm.Client('localhost:{server.port}')
      print('blocking', flush=True)
      try:
        if {blocked_call!r} == 'sample':
          next(client.sample('q', 1))
        else:
          client.insert(np.int64(1), {{'q': 1.0}})
      except RuntimeError as e:
        print('woken', type(e).__name__, str(e).replace(chr(10), ' '), flush=True)
      """)
  _wait_for_line(proc, "blocking")
  time.sleep(0.3)
  assert proc.poll() is None          # still blocked on the rate limiter
  server.stop()
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 0, err
  assert "woken TableClosedError" in out and "closed" in out.lower()


def test_localhost_client_names_the_servers_port(server_factory):
  server = server_factory([reverb_shm.Table.queue("q", 3)])
  client = server.localhost_client()
  assert client.server_address == f"localhost:{server.port}"
  assert set(client.server_info(1)) == {"q"}


# ---- ReverbServerConfig (needs the optional protobuf dependency, extra `server`)

needs_protobuf = pytest.mark.skipif(
    importlib.util.find_spec("google.protobuf") is None,
    reason="protobuf (extra 'server') not installed")

def _config(*tables: str, port: int = 0) -> str:
  return " ".join(f"tables {{ {t} }}" for t in tables) + (f" port: {port}" if port else "")


@needs_protobuf
def test_config_builds_every_selector_and_the_limiter_verbatim():
  config = _config(
      f'table_name: "a" sampler {{ fifo: true }} remover {{ lifo: true }} max_size: 7 '
      f'max_times_sampled: 2 {MIN_SIZE_1}',
      'table_name: "b" sampler { uniform: true } remover { heap { min_heap: true } } '
      'max_size: 3 rate_limiter { samples_per_insert: 2 min_size_to_sample: 4 min_diff: -1 '
      'max_diff: 9 sample_count: 5 }',
      'table_name: "c" sampler { prioritized { priority_exponent: 0.6 } } '
      'remover { heap { } } max_size: 1 rate_limiter { samples_per_insert: 1 '
      'min_size_to_sample: 1 max_diff: 1 }', port=4321)
  tables, port = server_config.load(config)
  assert port == 4321
  a, b, c = tables
  assert (a.name, a.sampler, a.remover, a.max_size, a.max_times_sampled) == (
      "a", selectors.Fifo(), selectors.Lifo(), 7, 2)
  assert a.rate_limiter == rate_limiters.RateLimiter(1, 1, -1.7976931348623157e308,
                                                     1.7976931348623157e308)
  assert (b.sampler, b.remover) == (selectors.Uniform(), selectors.MinHeap())
  assert b.rate_limiter == rate_limiters.RateLimiter(2, 4, -1, 9)   # counters ignored
  assert (c.sampler, c.remover) == (selectors.Prioritized(0.6), selectors.MaxHeap())
  assert server_config.load(_config(f'table_name: "a" sampler {{ fifo: true }} '
                                    f'remover {{ fifo: true }} max_size: 1 {MIN_SIZE_1}'))[1] is None


@needs_protobuf
@pytest.mark.parametrize("config, error, match", [
    ('tables { table_nam: "x" }', ValueError, r'no field named "table_nam"'),
    ('tables { table_name: "x" max_size: "big" }', ValueError, r"max_size"),
    ('tables { table_name: "x" sampler { fifo: false } remover { fifo: true } max_size: 1 }',
     ValueError, r"tables\[0\]\.sampler\.fifo is false"),
    ('tables { table_name: "x" sampler { fifo: true } max_size: 1 }', NotImplementedError,
     r"tables\[0\]\.remover"),
    ('tables { table_name: "x" sampler { fifo: true } remover { fifo: true } max_size: 1 '
     'rate_limiter { min_size_to_sample: 1 } }', ValueError,
     r"tables\[0\]\.rate_limiter: samples_per_insert"),
    ('tables { table_name: "x" sampler { fifo: true } remover { fifo: true } max_size: 0 '
     f'{MIN_SIZE_1} }}', ValueError, r"tables\[0\].*max_size"),
])
def test_bad_config_errors_name_the_field(config, error, match):
  with pytest.raises(error, match=match):
    server_config.load(config)


@needs_protobuf
def test_bad_config_on_the_command_line_is_one_line_not_a_traceback(capsys):
  assert cli.reverb_server_main(["--config", 'tables { table_name: "x" max_siz: 3 }']) == 2
  err = capsys.readouterr().err
  assert err.startswith("reverb_server: invalid ReverbServerConfig") and "max_siz" in err
  assert "Traceback" not in err


def test_serve_reports_an_unreadable_config_file(capsys, tmp_path):
  assert cli.main(["serve", "--config", str(tmp_path / "missing.txt")]) == 2
  assert "cannot read --config" in capsys.readouterr().err


@needs_protobuf
@pytest.mark.parametrize("how", ["reverb_server", "serve"])
def test_cli_serves_the_config_until_sigint(how, tmp_path, server_name):
  name = server_name
  config = _config(f'table_name: "my_table" sampler {{ fifo: true }} remover {{ fifo: true }} '
                   f'max_size: 200 {MIN_SIZE_1}')
  if how == "reverb_server":
    code = "import sys; from reverb_shm import cli; sys.exit(cli.reverb_server_main(sys.argv[1:]))"
    args = ["--config", config]
  else:
    (tmp_path / "cfg.txt").write_text(config)
    code = "import sys; from reverb_shm import cli; sys.exit(cli.main(sys.argv[1:]))"
    args = ["serve", "--config", str(tmp_path / "cfg.txt"), "--name", name, "--arena-mib", "4"]
  proc = _python(code, *args)
  line = _wait_for_line(proc, "serving")
  port = int(line.split("localhost:")[1].split()[0])
  client = reverb_shm.Client(f"localhost:{port}")
  client.insert(np.arange(3), {"my_table": 1.0})
  info = client.server_info(5)["my_table"]
  assert info.max_size == 200 and info.current_size == 1 and info.sampler_options.fifo
  segment = f"/dev/shm/rvshm.{name if how == 'serve' else f'reverb_{port}'}"
  assert os.path.exists(segment)
  proc.send_signal(signal.SIGINT)
  proc.communicate(timeout=60)
  assert proc.returncode == 0
  assert not os.path.exists(segment)
  with pytest.raises(errors.DeadlineExceededError):
    reverb_shm.Client(f"localhost:{port}").server_info(0.2)



def test_serve_reports_a_config_file_that_is_not_utf8(capsys, tmp_path):
  path = tmp_path / "latin1.txt"
  path.write_bytes(b'tables { table_name: "caf\xe9" }')
  assert cli.main(["serve", "--config", str(path)]) == 2
  err = capsys.readouterr().err
  assert f"--config {str(path)!r} is not UTF-8 text (byte 25:" in err, err
