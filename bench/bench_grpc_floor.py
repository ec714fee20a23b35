"""Floors of one Python gRPC round trip on this machine, beside the bridge's Client.insert.

    python bench/bench_grpc_floor.py [--seconds 0.5] [--rounds 6]

Measures, interleaved in rounds (medians; CPU per round trip of this process and the server's):
  unary        sync unary call per message (a new RPC each time)
  stream       sync stream-stream call, one request per round trip through a queue-fed request
               iterator (the bridge client's Insert stream pattern)
  aio/call     grpc.aio stream driven from sync code: loop.run_until_complete per round trip
  aio/loop     grpc.aio stream inside one coroutine (no sync caller; the aio floor)
against echo servers in their own processes (grpc.aio, as the bridge, and the sync thread-pool
server), with 150-byte messages; then `RemoteClient.insert` of the bench_bridge step through a
`reverb-shm bridge` process (over its ZeroMQ port, and over its Insert stream through
grpcio's public API, the fallback), and dm-reverb's Client.insert in /tmp/refvenv (if present),
in the same rounds. Rates are round trips (or inserts) per second.
"""
import argparse
import asyncio
import os
import queue
import resource
import socket
import statistics
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # pylint: disable=g-import-not-at-top,wrong-import-position

_SERVICE = "floor.Echo"
_PAYLOAD = b"x" * 150
_REF_PYTHON = "/tmp/refvenv/bin/python"
_REF_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    import reverb
    server = reverb.Server([reverb.Table("bench", reverb.selectors.Uniform(),
                                         reverb.selectors.Fifo(), 100000,
                                         reverb.rate_limiters.MinSize(1))])
    client = reverb.Client(f"localhost:{server.port}")
    step = {"obs": np.zeros(8, np.float32), "action": np.int64(0), "reward": np.float32(0)}
    for line in sys.stdin:             # one line per measurement: its duration in seconds
      n, start = 0, time.perf_counter()
      while time.perf_counter() - start < float(line):
        for _ in range(50):
          client.insert(step, {"bench": 1.0})
        n += 50
      print(n / (time.perf_counter() - start), flush=True)
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _serve(kind: str, port: int) -> None:
  """Runs an echo server (unary U and stream-stream S) of `kind` ("aio" or "sync")."""
  if kind == "sync":
    from concurrent import futures  # pylint: disable=g-import-not-at-top

    def stream(requests, _):
      yield from requests
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {
        "U": grpc.unary_unary_rpc_method_handler(lambda request, _: request),
        "S": grpc.stream_stream_rpc_method_handler(stream)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()
    return

  async def unary(request, _):
    return request

  async def astream(_, context):
    while True:
      request = await context.read()
      if request is grpc.aio.EOF:
        return
      await context.write(request)

  async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {
        "U": grpc.unary_unary_rpc_method_handler(unary),
        "S": grpc.stream_stream_rpc_method_handler(astream)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()
  asyncio.run(main())


def _cpu_of(pid: int) -> float:
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _start(args, ready: str) -> subprocess.Popen:
  proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  line = proc.stdout.readline()
  if ready not in line:
    proc.kill()
    raise RuntimeError(f"{args} did not start: {line!r}")
  return proc


def _echo_patterns(port: int, loop: asyncio.AbstractEventLoop) -> dict:
  """{pattern: fn(k) doing k round trips} against the echo server on `port`."""
  channel = grpc.insecure_channel(f"127.0.0.1:{port}")
  unary = channel.unary_unary(f"/{_SERVICE}/U")
  requests = queue.SimpleQueue()

  def request_iterator():
    while True:
      item = requests.get()
      if item is None:
        return
      yield item
  call = channel.stream_stream(f"/{_SERVICE}/S")(request_iterator())

  async def open_aio():
    aio_channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return aio_channel.stream_stream(f"/{_SERVICE}/S")()
  aio_call = loop.run_until_complete(open_aio())

  async def aio_once():
    await aio_call.write(_PAYLOAD)
    return await aio_call.read()

  async def aio_many(k):
    for _ in range(k):
      await aio_call.write(_PAYLOAD)
      await aio_call.read()

  def stream(k):
    for _ in range(k):
      requests.put(_PAYLOAD)
      next(call)
  cases = {"unary": lambda k: [unary(_PAYLOAD) for _ in range(k)], "stream": stream}
  return {**cases,
          "aio/call": lambda k: [loop.run_until_complete(aio_once()) for _ in range(k)],
          "aio/loop": lambda k: loop.run_until_complete(aio_many(k))}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seconds", type=float, default=0.5)
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.serve:
    _serve(args.serve[0], int(args.serve[1]))
    return
  import numpy as np  # pylint: disable=g-import-not-at-top
  import reverb_shm  # pylint: disable=g-import-not-at-top
  from reverb_shm.bridge import RemoteClient  # pylint: disable=g-import-not-at-top

  procs, cases = [], {}   # name -> (fn(k), server pid or None)
  loop = asyncio.new_event_loop()
  server = reverb_shm.Server([reverb_shm.Table(
      "bench", reverb_shm.selectors.Uniform(), reverb_shm.selectors.Fifo(), 100000,
      reverb_shm.rate_limiters.MinSize(1))])
  ref = None
  try:
    for kind in ("aio", "sync"):
      port = _free_port()
      procs.append(_start([sys.executable, __file__, "--serve", kind, str(port)], "ready"))
      for name, fn in _echo_patterns(port, loop).items():
        if kind == "aio" or name in ("unary", "stream"):
          cases[f"echo {kind} server, {name}"] = (fn, procs[-1].pid)
    port = _free_port()
    procs.append(_start([sys.executable, "-m", "reverb_shm.cli", "bridge", server.name,
                         "--port", str(port)], "listening"))
    client = RemoteClient(f"127.0.0.1:{port}")
    step = {"obs": np.zeros(8, np.float32), "action": np.int64(0), "reward": np.float32(0)}
    cases["bridge RemoteClient.insert"] = (
        lambda k: [client.insert(step, {"bench": 1.0}) for _ in range(k)], procs[-1].pid)
    from reverb_shm.bridge import writes  # pylint: disable=g-import-not-at-top
    public = RemoteClient(f"127.0.0.1:{port}")
    writes.ZMQ_ENABLED = False
    public.insert(step, {"bench": 1.0})   # (learns no ZeroMQ port: its Insert stream is made)
    writes.ZMQ_ENABLED = True
    cases["bridge RemoteClient.insert, gRPC"] = (
        lambda k: [public.insert(step, {"bench": 1.0}) for _ in range(k)], procs[-1].pid)
    if os.path.exists(_REF_PYTHON):
      ref = subprocess.Popen([_REF_PYTHON, "-c", _REF_SCRIPT], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    results = {name: [] for name in cases}
    results["dm-reverb Client.insert"] = []
    for fn, _ in cases.values():
      fn(20)
    for _ in range(args.rounds):
      for name, (fn, pid) in cases.items():
        n, cpu, server_cpu, start = 0, _own_cpu(), _cpu_of(pid), time.perf_counter()
        while time.perf_counter() - start < args.seconds:
          fn(50)
          n += 50
        elapsed = time.perf_counter() - start
        results[name].append((n / elapsed, 1e6 * (_own_cpu() - cpu) / n,
                              1e6 * (_cpu_of(pid) - server_cpu) / n))
      if ref is not None:
        ref.stdin.write(f"{args.seconds}\n")
        ref.stdin.flush()
        line = ref.stdout.readline()
        if line:
          results["dm-reverb Client.insert"].append((float(line), float("nan"),
                                                     float("nan")))
    print(f"{'case':36} {'per s':>8} {'best':>8} {'client us':>10} {'server us':>10}")
    for name, rows in results.items():
      if rows:
        print(f"{name:36} {statistics.median(r[0] for r in rows):8.0f} "
              f"{max(r[0] for r in rows):8.0f} {statistics.median(r[1] for r in rows):10.0f} "
              f"{statistics.median(r[2] for r in rows):10.0f}")
    print("medians over rounds; client/server us = CPU per round trip of this process / the "
          "server process (dm-reverb: in-process server, not split)")
  finally:
    if ref is not None:
      ref.stdin.close()
      ref.wait(timeout=60)
    for proc in procs:
      proc.terminate()
      proc.wait(timeout=30)
    server.stop()


if __name__ == "__main__":
  main()
