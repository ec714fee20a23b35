"""Servers and clients in different pid namespaces sharing one /dev/shm (containers that share
it, `docker run --ipc=container:...`): a pid means nothing across them, so liveness is judged by
each process's liveness lock on the segment's file as well as by pid.

Each test runs in a private /dev/shm (a tmpfs in a new mount namespace); the other side runs
under `unshare --pid --fork --mount-proc` (its own pid namespace, pid 1 there).
"""
import json
import subprocess
import textwrap

import pytest

from conftest import run_in_private_shm

pytestmark = pytest.mark.timeout(180)


def _need_pid_namespaces():
  probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                         capture_output=True, check=False)
  if probe.returncode:
    pytest.skip("needs `unshare --pid --fork --mount-proc` (root or CAP_SYS_ADMIN): "
                + probe.stderr.decode()[-200:])


_CLIENT = textwrap.dedent('''
    import json, os, sys, time
    import numpy as np
    import reverb_shm
    from reverb_shm._internal import shm
    client = reverb_shm.Client(f"localhost:{sys.argv[1]}")     # port resolution
    table = client.shared_table("t")
    print("ready", flush=True)
    t0 = time.monotonic()
    sample = table.sample(1, timeout_ms=30000)[0]     # blocks ~1.5 s: the table is empty
    waited = time.monotonic() - t0
    print("sampled", flush=True)
    sys.stdin.readline()          # meanwhile the server evicts the item and reaps slots
    intact = bool(np.array_equal(sample.data[0][0], np.arange(1000.0)))
    client.insert({"x": np.full(1000, 7.0)}, {"t": 1.0})
    seg = shm.Segment.attach("nshost")
    print("RESULT " + json.dumps(dict(pid=os.getpid(), waited=waited, intact=intact,
                                      owner_dead=seg.owner_dead, owner_alive=seg.owner_alive())),
          flush=True)
    sys.stdin.readline()
''')

_SERVER_HERE = textwrap.dedent('''
    import json, os, subprocess, sys, time
    import numpy as np
    import reverb_shm
    from reverb_shm import rate_limiters, selectors
    from reverb_shm._internal import counters
    t = reverb_shm.Table("t", selectors.Fifo(), selectors.Fifo(), 100, rate_limiters.MinSize(1))
    server = reverb_shm.Server([t], name="nshost", max_procs=8)
    client = server.localhost_client()
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                          sys.executable, "-c", sys.argv[1], str(server.port)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
      assert p.stdout.readline().strip() == "ready"
      time.sleep(1.5)             # the client waits through several owner checks
      client.insert({"x": np.arange(1000.0)}, {"t": 1.0})
      assert p.stdout.readline().strip() == "sampled"
      procs = [q for q in counters.processes(server.segment) if q["pid"] != os.getpid()]
      for i in range(300):        # evicts the sampled item: only the client's pin keeps its chunk
        client.insert({"x": np.full(1000, float(-i))}, {"t": 1.0})
      time.sleep(1.6)             # the reaper runs every 0.5 s
      procs_later = [q for q in counters.processes(server.segment) if q["pid"] != os.getpid()]
      p.stdin.write("go\\n"); p.stdin.flush()
      line = p.stdout.readline()
      result = json.loads(line[len("RESULT "):])
      size = server.shared_table("t").size
      p.stdin.write("bye\\n"); p.stdin.flush()
      p.wait(timeout=30)
      for _ in range(100):        # the client has exited: its slot is reaped
        gone = [q for q in counters.processes(server.segment) if q["pid"] != os.getpid()]
        if not gone:
          break
        time.sleep(0.1)
      server.segment.check()
      print("RESULT " + json.dumps(dict(client=result, procs=procs, procs_later=procs_later,
                                        gone=gone, size=size)))
    finally:
      p.kill()
      server.stop()
''')


def test_client_in_another_pid_namespace_sees_a_live_server_and_keeps_its_slot():
  _need_pid_namespaces()
  out = run_in_private_shm(_SERVER_HERE, size_mib=64, args=(_CLIENT,))
  r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  c = r["client"]
  assert c["pid"] == 1, r                  # really another pid namespace
  assert c["waited"] >= 1.0, r             # a blocked sample through several owner checks
  assert not c["owner_dead"] and c["owner_alive"], r
  # Its pin held the evicted item's chunk through three reaps: the payload is intact.
  assert c["intact"], r
  assert [q["alive"] for q in r["procs"]] == [True] and r["procs"] == r["procs_later"], r
  assert r["size"] == 100, r
  assert r["gone"] == [], r                # and once it exited, its slot was reaped


_SERVER_THERE = textwrap.dedent('''
    import sys, time, reverb_shm
    from reverb_shm import rate_limiters, selectors
    t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10, rate_limiters.MinSize(1))
    s = reverb_shm.Server([t], name="nsaway")
    print(s.port, flush=True)
    time.sleep(120)
''')

_CLIENT_HERE = textwrap.dedent('''
    import json, os, signal, subprocess, sys, time
    import numpy as np
    import reverb_shm
    from reverb_shm import errors
    from reverb_shm._internal import shm
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                          sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    try:
      port = int(p.stdout.readline())
      client = reverb_shm.Client(f"localhost:{port}")        # port alias of a pid-1 owner
      client.insert({"x": np.arange(10.0)}, {"t": 1.0})
      seg = shm.Segment.attach("nsaway")
      time.sleep(1.0)                                        # the owner watch polls meanwhile
      alive = dict(owner_dead=seg.owner_dead, owner_alive=seg.owner_alive(),
                   registered=shm.port_is_registered(port), listed=shm.list_segments(["nsaway"]),
                   sample=client.shared_table("t").sample(1, timeout_ms=1000)[0].data[0].tolist())
      t0 = time.monotonic()
      p.send_signal(signal.SIGKILL)    # unshare --kill-child: the server dies with it
      p.wait()
      while not seg.owner_dead and time.monotonic() - t0 < 10:
        time.sleep(0.05)
      noticed = time.monotonic() - t0
      try:
        client.shared_table("t").sample(1, timeout_ms=1000)
        error = None
      except errors.DeadOwnerError as e:
        error = str(e)
      try:
        shm.resolve_address(f"localhost:{port}")
        resolved = True
      except errors.ServerUnavailableError:
        resolved = False
      print("RESULT " + json.dumps(dict(alive=alive, noticed=noticed, error=error,
                                        resolved=resolved, removed=shm.remove_stale())))
    finally:
      p.kill()
''')


def test_server_in_another_pid_namespace_is_live_until_killed():
  _need_pid_namespaces()
  out = run_in_private_shm(_CLIENT_HERE, size_mib=64, args=(_SERVER_THERE,))
  r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  a = r["alive"]
  assert not a["owner_dead"] and a["owner_alive"] and a["registered"], r
  assert a["listed"][0]["state"] == "live" and a["listed"][0]["pid"] == 1, r
  assert a["sample"] == [list(range(10))], r
  # Killed: the lock went with it, and the client noticed within the watch's polling.
  assert r["noticed"] < 5, r
  assert r["error"] and "dead" in r["error"], r
  assert not r["resolved"], r
  assert "/dev/shm/rvshm.nsaway" in r["removed"], r
