"""Bridge benchmark: remote insert/sample over loopback vs dm-reverb's gRPC, and the hop cost.

    python bench/bench_bridge.py [--seconds 2] [--rounds 3]

Workloads (steps are {'obs': float32[8], 'action': int64, 'reward': float32}):
  insert   Client.insert of one step per call
  writer   TrajectoryWriter: append a step, create an item over the last 2 steps
  sample   Client.sample(table, N) streaming one item at a time

Each runs through (a) reverb_shm's local shared memory, (b) reverb_shm's gRPC bridge on
127.0.0.1 in the benchmark's process (like dm-reverb's in-process server, but sharing the
client's GIL), (c) the bridge as its own process (`reverb-shm bridge NAME`, the deployed
form) and (d) dm-reverb's own gRPC path in a subprocess of the reverb peer venv's python
(skipped when absent); (c) again with Client.insert on the ZeroMQ port
(REVERB_SHM_BRIDGE_DIRECT=0), and on gRPC only. Rates are items/s. Remote calls take what a
RemoteClient takes by default: Client.insert the bridge's direct port, streams its ZeroMQ port;
REVERB_SHM_BRIDGE_ZMQ=0 measures everything on gRPC instead.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_all import peer_python  # noqa: E402

# dm-reverb's python: $REVERB_PYTHON, else the reverb peer venv (tests/peers/venv.sh reverb).
REF_PYTHON = os.environ.get("REVERB_PYTHON") or peer_python("reverb") or "/tmp/refvenv/bin/python"

# Run by both interpreters: `reverb` is reverb_shm or dm-reverb.
_WORKLOADS = textwrap.dedent("""
    import time
    import numpy as np

    def step(i):
      return {"obs": np.full(8, i, np.float32), "action": np.int64(i), "reward": np.float32(i)}

    def rate(fn, seconds):
      fn(10)
      n, start = 0, time.perf_counter()
      while time.perf_counter() - start < seconds:
        fn(200)
        n += 200
      return n / (time.perf_counter() - start)

    def run_all(reverb, client, seconds):
      out = {}
      def insert(k):
        for i in range(k):
          client.insert(step(i), {"bench": 1.0})
      out["insert"] = rate(insert, seconds)
      writer = client.trajectory_writer(2)
      writer.append(step(0))
      def write(k):
        for i in range(k):
          writer.append(step(i))
          writer.create_item("bench", 1.0, {"obs": writer.history["obs"][-2:],
                                            "reward": writer.history["reward"][-1]})
        writer.flush()
      out["writer"] = rate(write, seconds)
      writer.close()
      def sample(k):
        for _ in client.sample("bench", k, emit_timesteps=False):
          pass
      out["sample"] = rate(sample, seconds)
      return out
""")

_REF_SCRIPT = _WORKLOADS + textwrap.dedent("""
    import json, sys
    import reverb
    server = reverb.Server([reverb.Table("bench", reverb.selectors.Uniform(),
                                         reverb.selectors.Fifo(), 100000,
                                         reverb.rate_limiters.MinSize(1))])
    client = reverb.Client(f"localhost:{server.port}")
    print(json.dumps(run_all(reverb, client, float(sys.argv[1]))))
    server.stop()
""")


def _bridge_process(name: str):
  """(process, address) of `reverb-shm bridge NAME` on a free loopback port."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  proc = subprocess.Popen([sys.executable, "-m", "reverb_shm.cli", "bridge", name, "--port",
                           str(port)], stdout=subprocess.PIPE, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  line = proc.stdout.readline()
  if "listening" not in line:
    proc.kill()
    raise RuntimeError(f"bridge process did not start: {line!r}")
  return proc, f"127.0.0.1:{port}"


def _reverb_shm(seconds: float) -> dict:
  import reverb_shm as reverb  # pylint: disable=g-import-not-at-top
  from reverb_shm.bridge import BridgeConfig, RemoteClient, writes  # pylint: disable=g-import-not-at-top
  enabled, direct = writes.ZMQ_ENABLED, writes.DIRECT_ENABLED
  scope = {}
  exec(_WORKLOADS, scope)  # pylint: disable=exec-used
  table = reverb.Table("bench", reverb.selectors.Uniform(), reverb.selectors.Fifo(), 100000,
                       reverb.rate_limiters.MinSize(1))
  server = reverb.Server([table], bridge=BridgeConfig())
  try:
    local = scope["run_all"](reverb, server.localhost_client(), seconds)
    remote = scope["run_all"](reverb, RemoteClient(server.bridge_address), seconds)
    proc, address = _bridge_process(server.name)
    try:
      own = scope["run_all"](reverb, RemoteClient(address), seconds)
      try:   # (read when a client learns the bridge's ports)
        writes.DIRECT_ENABLED = False
        own_zmq = scope["run_all"](reverb, RemoteClient(address), seconds)
        writes.ZMQ_ENABLED = False
        own_grpc = scope["run_all"](reverb, RemoteClient(address), seconds)
      finally:
        writes.ZMQ_ENABLED, writes.DIRECT_ENABLED = enabled, direct
    finally:
      proc.terminate()
      proc.wait(timeout=30)
  finally:
    server.stop()
  return {"local": local, "bridge": remote, "own": own, "own_zmq": own_zmq, "own_grpc": own_grpc}


def _dm_reverb(seconds: float):
  if not os.path.exists(REF_PYTHON):
    return None
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run([REF_PYTHON, "-c", _REF_SCRIPT, str(seconds)], capture_output=True,
                        text=True, timeout=600, env=env)
  if proc.returncode:
    print("dm-reverb run failed:", proc.stderr[-2000:], file=sys.stderr)
    return None
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seconds", type=float, default=2.0)
  parser.add_argument("--rounds", type=int, default=1,
                      help="alternate reverb_shm and dm-reverb this many times; medians")
  args = parser.parse_args()
  rounds = []
  for _ in range(args.rounds):   # (alternating: a change of machine load weighs on both)
    rounds.append((_reverb_shm(args.seconds), _dm_reverb(args.seconds)))
  med = lambda values: float(np.median(values))  # pylint: disable=unnecessary-lambda-assignment
  nan = float("nan")
  print(f"{'workload':10} {'shm local':>10} {'bridge':>10} {'bridge/own':>10} {'own, ZMQ':>10} "
        f"{'own, gRPC':>10} {'dm-reverb':>10} {'bridge/dm':>10} {'own/dm':>8} {'ZMQ/dm':>8} "
        f"{'gRPC/dm':>8} {'hop cost':>9}")
  for w in ("insert", "writer", "sample"):
    local, bridge, own, own_zmq, own_grpc = (
        med([ours[k][w] for ours, _ in rounds])
        for k in ("local", "bridge", "own", "own_zmq", "own_grpc"))
    dm = med([ref[w] if ref else nan for _, ref in rounds])
    # ratios: the median of each round's ratio (both measured back to back)
    bridge_dm, own_dm, zmq_dm, grpc_dm = (
        med([ours[k][w] / (ref[w] if ref else nan) for ours, ref in rounds])
        for k in ("bridge", "own", "own_zmq", "own_grpc"))
    print(f"{w:10} {local:10.0f} {bridge:10.0f} {own:10.0f} {own_zmq:10.0f} {own_grpc:10.0f} "
          f"{dm:10.0f} {bridge_dm:9.2f}x {own_dm:7.2f}x {zmq_dm:7.2f}x {grpc_dm:7.2f}x "
          f"{local / bridge:8.1f}x")
  print(f"rates in items/s (medians of {args.rounds} rounds); bridge = in this process, "
        "bridge/own = `reverb-shm bridge` process (defaults: Client.insert on the direct port,\n"
        "streams on the ZeroMQ port), own, ZMQ = the same with REVERB_SHM_BRIDGE_DIRECT=0, "
        "own, gRPC = with REVERB_SHM_BRIDGE_ZMQ=0 (grpcio's public API);\n"
        "hop cost = local shared memory rate / in-process bridge rate")


if __name__ == "__main__":
  main()
