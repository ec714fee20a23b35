"""Shared fixtures: servers with unique names that are always stopped (segments unlinked)."""
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors

_counter = itertools.count()
TEST_ARENA_BYTES = 64 << 20


def unique_server_name(prefix: str = "test") -> str:
  """A server name no other test (or concurrent test run) uses."""
  return f"{prefix}_{os.getpid()}_{next(_counter)}"


@pytest.fixture
def server_factory():
  """Returns make(tables, **kwargs) -> Server with a unique name and a 64 MiB arena.

  Every server it made is stopped at teardown, which unlinks its segment.
  """
  servers = []

  def make(tables, **kwargs):
    kwargs.setdefault("name", unique_server_name())
    kwargs.setdefault("arena_bytes", TEST_ARENA_BYTES)
    server = reverb_shm.Server(tables, **kwargs)
    servers.append(server)
    return server

  yield make
  for server in servers:
    server.stop()
    assert not os.path.exists(f"/dev/shm/rvshm.{server.name}")


@pytest.fixture
def server_name():
  """A unique server name (for tests that create servers themselves)."""
  return unique_server_name()


@pytest.fixture
def uniform_table():
  """A Uniform/Fifo table of 1000 items with MinSize(1)."""
  return reverb_shm.Table("uniform", selectors.Uniform(), selectors.Fifo(), 1000,
                          rate_limiters.MinSize(1))


def run_in_fork(fn, timeout: float = 30, fork=os.fork):
  """Runs fn() in a forked child and returns "OK <result>" or "ERR <Type>: <message>".

  Raises AssertionError if the child crashes or does not finish within `timeout` seconds (it
  is then killed): a hang never blocks the test run. `fork` makes the child (os.fork, or e.g.
  libc's fork, which runs no Python at-fork hook).
  """
  read_end, write_end = os.pipe()
  pid = fork()
  if pid == 0:  # child
    code = 1
    try:
      os.close(read_end)
      try:
        out = "OK " + str(fn())
      except Exception as e:  # pylint: disable=broad-except
        out = f"ERR {type(e).__name__}: {e}"
      os.write(write_end, out.encode())
      code = 0
    finally:
      os._exit(code)  # pylint: disable=protected-access
  os.close(write_end)
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      break
    time.sleep(0.01)
  else:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(read_end)
    raise AssertionError(f"forked child hung for {timeout} s")
  with os.fdopen(read_end, "rb") as f:
    out = f.read().decode()
  assert os.waitstatus_to_exitcode(status) == 0, out
  return out


def run_threads(fn, n: int, timeout: float = 120) -> None:
  """Runs fn(0) .. fn(n - 1) in n threads at once; raises AssertionError naming the exceptions
  they raised, or if one is still running after `timeout` seconds."""
  failures = []

  def guarded(i):
    try:
      fn(i)
    except Exception as e:  # pylint: disable=broad-except
      failures.append(e)
  threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
  for th in threads:
    th.start()
  for th in threads:
    th.join(timeout=timeout)
  assert not failures and not any(th.is_alive() for th in threads), failures


def stop_process(pid: int, timeout: float = 10.0) -> None:
  """Sends SIGSTOP to `pid` and returns once every one of its threads has stopped: kill()
  only queues the signal, and a thread running on another CPU (a vCPU the host has not
  scheduled) can go on answering for a while after it returns."""
  os.kill(pid, signal.SIGSTOP)
  deadline = time.monotonic() + timeout
  while True:
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
      try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
          states.append(f.read().rsplit(")", 1)[1].split()[0])
      except OSError:
        pass   # (a thread that ended meanwhile)
    if states and all(s in "tT" for s in states):
      return
    assert time.monotonic() < deadline, f"process {pid} did not stop: thread states {states}"
    time.sleep(0.001)


@contextlib.contextmanager
def bridge_process(server):
  """A `reverb-shm bridge` process serving `server` on a free loopback port: yields (its Popen,
  its address); terminated (continued first, if stopped) at the end."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  proc = subprocess.Popen([sys.executable, "-m", "reverb_shm.cli", "bridge", server.name,
                           "--port", str(port)], stdout=subprocess.PIPE, text=True,
                          cwd=os.path.dirname(os.path.dirname(reverb_shm.__file__)))
  try:
    assert "listening" in proc.stdout.readline()
    yield proc, f"127.0.0.1:{port}"
  finally:
    if proc.poll() is None:
      os.kill(proc.pid, signal.SIGCONT)
      proc.terminate()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:   # (its threads' stacks on stderr, then the failure)
      os.kill(proc.pid, signal.SIGUSR1)
      time.sleep(1)
      proc.kill()
      proc.wait(timeout=10)
      raise


def run_in_private_shm(code: str, size_mib: int = 64, timeout: float = 120, args=(),
                       mount_options: str = "", run_as=()) -> str:
  """Runs `python -c code *args` with its own /dev/shm: a fresh tmpfs of `size_mib` MiB
  (mounted with `mount_options` too, e.g. "ro"), as `run_as` (a command prefix, e.g. setpriv's)
  when given.

  The child runs in a new mount namespace (`unshare --mount`, needs root or CAP_SYS_ADMIN),
  so it and its children see only the private tmpfs and the host's /dev/shm is untouched.
  Skips the test when a mount namespace cannot be made here. Returns the child's stdout;
  fails the test (with its stderr) when the child exits non-zero or runs past `timeout`.
  """
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  probe = (subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False)
           if shutil.which("unshare") else None)
  if probe is None or probe.returncode != 0:
    pytest.skip("a private /dev/shm needs `unshare --mount` (root or CAP_SYS_ADMIN): "
                + ("unshare is not installed" if probe is None else probe.stderr.decode()[-200:]))
  options = f"size={int(size_mib)}m" + (f",{mount_options}" if mount_options else "")
  script = f"mount -t tmpfs -o {options} tmpfs /dev/shm && " + 'exec "$0" "$@"'
  proc = subprocess.run(["unshare", "--mount", "sh", "-c", script, *run_as, sys.executable, "-c",
                         code, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                        cwd=root, env={**os.environ, "PYTHONPATH": root}, check=False)
  assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
  return proc.stdout


def without_modules(*names: str) -> str:
  """Python code that makes the interpreter running it behave as if the top-level modules
  `names` (and their submodules) were not installed."""
  return ("import sys\n"
          "class _Missing:\n"
          "  def find_spec(self, name, path=None, target=None):\n"
          f"    if name.split('.')[0] in {sorted(names)!r}:\n"
          "      raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
          "sys.meta_path.insert(0, _Missing())\n")


def import_error_without(statement: str, *names: str) -> str:
  """The message of the ImportError that `statement` raises in a fresh interpreter without the
  modules `names` (see without_modules); fails the test if it raises none."""
  code = (without_modules(*names) + "try:\n" + f"  {statement}\n" +
          "except ImportError as e:\n  print(e)\nelse:\n  sys.exit('no ImportError')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  return out.stdout
