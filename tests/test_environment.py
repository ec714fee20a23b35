"""A hostile host: a read-only or unwritable /dev/shm, too few file descriptors, another user's
server. Each gives a clear error saying what to change, leaves nothing in /dev/shm and never
hangs. Tests that need root (a private /dev/shm via unshare, another user via setpriv) skip
with the reason where those are unavailable."""
import functools
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import run_in_private_shm, unique_server_name

import reverb_shm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOBODY = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]


def _python(code: str, prefix=(), timeout=60) -> subprocess.CompletedProcess:
  return subprocess.run(list(prefix) + [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


@functools.cache
def _unshare_reason() -> str:
  """'' when this process may mount a private /dev/shm (unshare -m), else why not."""
  if shutil.which("unshare") is None:
    return "needs unshare(1)"
  if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
    return "needs root (unshare -m) to mount a private /dev/shm"
  return ""


@functools.cache
def _nobody_reason() -> str:
  """'' when a process may run this Python as user nobody, else why not."""
  if shutil.which("setpriv") is None or os.geteuid() != 0:
    return "needs root and setpriv(1) to run a process as another user"
  probe = subprocess.run(NOBODY + [sys.executable, "-c", "import reverb_shm"], cwd=ROOT,
                         capture_output=True, text=True)
  if probe.returncode != 0:
    return f"user nobody cannot import reverb_shm here: {probe.stderr.strip()[-200:]}"
  return ""


def _in_private_shm(mount_options: str, code: str, as_nobody: bool = False) -> list:
  """The lines `code` prints in a private /dev/shm of 16 MiB mounted with `mount_options`, then
  what that /dev/shm holds afterwards (the last line)."""
  if as_nobody and _nobody_reason():
    pytest.skip(_nobody_reason())
  code = textwrap.dedent(code) + "\nimport os\nprint(sorted(os.listdir('/dev/shm')))\n"
  return run_in_private_shm(code, size_mib=16, mount_options=mount_options,
                            run_as=NOBODY if as_nobody else ()).splitlines()


_START = """
import errno, resource, reverb_shm as r
{setup}
try:
  r.Server([r.Table.queue('q', 10)], arena_bytes=1 << 20, max_bytes=8 << 20)
except r.errors.SystemCallError as e:
  print(errno.errorcode[e.errno], '|', e)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mount_options, as_nobody, setup, code, says", [
    ("ro", False, "", "EROFS", "/dev/shm is mounted read-only; reverb_shm keeps its servers there"
     " and needs it writable (remount it read-write"),
    # room for two files: the segment and the port alias; the checkpointer's sidecar fails
    ("nr_inodes=3", False, "", "ENOSPC", "/dev/shm has no room left (space or inodes)"),
    ("mode=0755", True, "", "EACCES", "this user may not create files in /dev/shm"),
    ("", False, "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # SIGXFSZ: ignored",
     "EFBIG", "(RLIMIT_FSIZE 1048576 bytes, `ulimit -f`): raise the limit, or create the server "
     "with a smaller max_bytes"),
], ids=["read-only", "out-of-inodes", "not-writable", "file-size-limit"])
def test_a_host_that_refuses_a_server_says_why_and_keeps_nothing(mount_options, as_nobody, setup,
                                                                 code, says):
  message, left = _in_private_shm(mount_options, _START.format(setup=setup), as_nobody=as_nobody)
  assert message.startswith(f"{code} |") and says in message, message
  assert left == "[]"


@pytest.mark.timeout(120)
def test_a_system_without_dev_shm_says_what_to_mount():
  if _unshare_reason():
    pytest.skip(_unshare_reason())
  script = ("mount -t tmpfs tmpfs /dev && mknod -m 666 /dev/null c 1 3 || exit 77; "
            f"{sys.executable} -c \"$0\"")
  result = subprocess.run(["unshare", "-m", "bash", "-c", script, _START.format(setup="")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
  if result.returncode == 77:
    pytest.skip(f"cannot make a /dev without shm here: {result.stderr.strip()[-200:]}")
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("ENOENT |"), result.stdout
  assert "mount -t tmpfs -o size=1g tmpfs /dev/shm" in result.stdout


@pytest.mark.timeout(120)
def test_running_out_of_file_descriptors_is_a_clear_error_that_leaves_nothing():
  """With 0, 1, 2... descriptors left, starting a server or attaching to one fails at a
  different step each time (finding the temp dir or listing the checkpoint directory, creating,
  mapping, reopening the segment); every failure is a SystemCallError(EMFILE) naming the limit,
  and a failed start leaves no file behind. 'cold' starts with Python's temp dir not yet found
  (tempfile then reports ENOENT, not EMFILE)."""
  prefix = unique_server_name("nofile")
  code = f"""
  import errno, os, resource, tempfile
  import reverb_shm as r
  tempfile.gettempdir()
  resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
  host = r.Server([r.Table.queue('q', 10)], name='{prefix}_host', arena_bytes=1 << 20)
  for what in ('cold', 'start', 'attach'):
    for free in range(what == 'attach', 9):   # (attach with 0 free: numpy's lazy imports)
      tempfile.tempdir = None if what == 'cold' else tempfile.gettempdir()
      hog = []
      try:
        while True:
          hog.append(os.open(os.devnull, os.O_RDONLY))
      except OSError:
        pass
      for _ in range(free):
        os.close(hog.pop())
      try:
        if what != 'attach':
          r.Server([r.Table.queue('q', 10)], name=f'{prefix}_{{free}}', arena_bytes=1 << 20).stop()
        else:
          r.Client('shm://{prefix}_host').insert([1], {{'q': 1.0}})
        outcome = 'ok'
      except r.errors.SystemCallError as e:
        ok = e.errno == errno.EMFILE and 'RLIMIT_NOFILE 64' in str(e) and 'ulimit -n' in str(e)
        outcome = 'emfile' if ok else repr(e)
      except BaseException as e:
        outcome = repr(e)
      for fd in hog:
        os.close(fd)
      print(what, free, outcome)
  host.stop()
  print('left', sorted(n for n in os.listdir('/dev/shm') if '{prefix}' in n))
  """
  result = _python(code, timeout=120)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert lines[-1] == "left []"
  outcomes = [line.split(" ", 2) for line in lines[:-1]]
  assert all(o in ("ok", "emfile") for _, _, o in outcomes), result.stdout
  for kind in ("cold", "start"):
    starts = [o for what, _, o in outcomes if what == kind]
    assert starts[:4] == ["emfile"] * 4 and starts[-1] == "ok", result.stdout
  assert [o for what, _, o in outcomes if what == "attach"][-1] == "ok"


_ATTACH = """
import sys, time, reverb_shm as r
t = time.monotonic()
for address in sys.argv[1:]:
  try:
    r.Client(address).server_info()    # no timeout: waits for a server that is not up yet
  except r.errors.AccessDeniedError as e:
    print('denied', round(time.monotonic() - t), '|', e)
try:
  r.Server([r.Table.queue('q', 10)], name=sys.argv[1][len('shm://'):], arena_bytes=1 << 20)
except r.errors.SegmentInUseError as e:
  print('in use |', e)
"""


@pytest.mark.timeout(120)
def test_another_users_server_is_refused_at_once(server_factory):
  if _nobody_reason():
    pytest.skip(_nobody_reason())
  server = server_factory([reverb_shm.Table.queue("q", 10)], arena_bytes=1 << 20)
  result = subprocess.run(NOBODY + [sys.executable, "-c", _ATTACH, f"shm://{server.name}",
                                    f"localhost:{server.port}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  by_name, by_port, same_name = result.stdout.splitlines()
  assert by_name.startswith("denied 0 |") and "run this process as the server's user" in by_name
  assert by_port.startswith("denied 0 |") and "belongs to another user" in by_port
  assert same_name.startswith("in use |") and "of another user exists" in same_name
  assert server.localhost_client().server_info()["q"].current_size == 0   # untouched


@pytest.mark.timeout(120)
def test_no_thread_to_spare_is_a_clear_error_and_a_later_call_recovers():
  """RLIMIT_NPROC (`ulimit -u`) reached: a server cannot start its reaper, a client cannot start
  the thread that watches the server; both say so, leave nothing, and work once it is raised.
  (root ignores RLIMIT_NPROC: this runs as user nobody.)"""
  if _nobody_reason():
    pytest.skip(_nobody_reason())
  name = unique_server_name("nproc")
  serve = ("import reverb_shm as r, sys\n"
           f"s = r.Server([r.Table.queue('q', 10)], name='{name}', arena_bytes=1 << 20)\n"
           "print('up', flush=True)\n"
           "sys.stdin.read()\n")
  server = subprocess.Popen(NOBODY + [sys.executable, "-c", serve], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  try:
    assert server.stdout.readline() == "up\n"
    code = f"""
    import errno, os, resource
    import reverb_shm as r
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    resource.setrlimit(resource.RLIMIT_NPROC, (1, hard))
    client = r.Client('shm://{name}')
    for call in (lambda: r.Server([r.Table.queue('q', 10)], name='{name}_2', arena_bytes=1 << 20),
                 lambda: client.insert([1], {{'q': 1.0}})):
      try:
        call()
        print('no error')
      except r.errors.SystemCallError as e:
        print(e.errno == errno.EAGAIN and 'ulimit -u' in str(e), str(e))
    print(sorted(n for n in os.listdir('/dev/shm') if '{name}_2' in n))
    resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
    client.insert([1], {{'q': 1.0}})
    print(client.server_info()['q'].current_size)
    """
    result = _python(code, prefix=NOBODY, timeout=90)
  finally:
    server.stdin.close()
    server.wait(30)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0].startswith(f"True [Errno 11] cannot start server '{name}_2'"), result.stdout
  assert lines[1].startswith(f"True [Errno 11] cannot attach to server '{name}'"), result.stdout
  assert lines[2:] == ["[]", "1"], result.stdout


@pytest.mark.timeout(120)
def test_dev_shm_filled_by_others_while_writing():
  """Another file eats /dev/shm while a server grows: inserts fail with ResourceExhaustedError
  saying how much could not be had and why, the table stays consistent, and inserts work again
  once the space is back."""
  code = """
  import os, numpy as np, reverb_shm as r
  s = r.Server([r.Table('q', r.selectors.Uniform(), r.selectors.Fifo(), 1000,
                        r.rate_limiters.MinSize(1))], arena_bytes=1 << 20, max_bytes=12 << 20)
  c = r.Client('shm://' + s.name)
  with open('/dev/shm/hog', 'wb') as f:
    try:
      while True:
        f.write(b'x' * (1 << 16))
        f.flush()
    except OSError:
      pass
  try:
    for _ in range(1000):
      c.insert([np.zeros(10000, np.float32)], {'q': 1.0})
    print('no error')
  except r.errors.ResourceExhaustedError as e:
    print(str(e).split(': ', 1)[1])
  before = c.server_info()['q'].current_size
  os.unlink('/dev/shm/hog')
  c.insert([np.zeros(10000, np.float32)], {'q': 1.0})
  print(c.server_info()['q'].current_size - before, s.localhost_client().stats()['closed'])
  s.stop()
  """
  message, after, left = _in_private_shm("", code)
  assert message.startswith("cannot grow the arena by ") and " KiB: /dev/shm is full" in message
  assert "by 0 KiB" not in message and "--shm-size" in message, message
  assert after == "1 False"
  assert left == "[]"
