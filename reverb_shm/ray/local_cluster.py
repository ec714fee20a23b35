"""A multi-node Ray cluster on one machine, for tests, examples and benchmarks.

Every node is a `ray start --block` process tree (raylet, agents, workers). With
`private_shm=True` a worker node runs in its own mount namespace (`unshare --mount`, needs root
or unprivileged user namespaces) with a private tmpfs on /dev/shm, so its processes see neither
the other nodes' shared-memory segments nor theirs: as on separate hosts, "same node" can only
be decided by trying to attach. The head node stays in the caller's namespace.

Each worker node has a custom resource `node_label` (1 unit) to find it by: node_id(label).

Every node logs under the cluster's temp dir (Ray puts a worker node's session logs in the
head's): shutdown() removes it unless `keep_logs` is set (or RVRAY_KEEP is in the environment);
log_report() gives the tails a failed test should show.
"""
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, Optional

__all__ = ["LocalRayCluster"]


def _dead_children(pid: int) -> list:
  """Names of the exited, unreaped child processes of `pid` (from /proc; [] elsewhere)."""
  dead: list = []
  try:
    entries = os.listdir("/proc")
  except OSError:
    return dead
  for entry in entries:
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", "rb") as f:
        stat = f.read().decode("ascii", "replace")
    except OSError:
      continue
    name, _, rest = stat.partition("(")[2].rpartition(")")
    fields = rest.split()
    if len(fields) > 1 and fields[0] == "Z" and fields[1] == str(pid):
      dead.append(name)
  return dead


def _free_port() -> int:
  return _free_ports(1)[0]


def _free_ports(n: int) -> list:
  """n distinct free ports of 127.0.0.1 (all bound at once: none is handed out twice)."""
  socks = []
  try:
    for _ in range(n):
      s = socket.socket()
      socks.append(s)
      s.bind(("127.0.0.1", 0))
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def _ray_bin() -> str:
  return os.path.join(os.path.dirname(sys.executable), "ray")


class LocalRayCluster:
  """Head node plus worker nodes on this machine.

  Args:
    num_cpus: CPUs each node advertises.
    object_store_mb: object store size of each node (Ray's minimum is about 75 MB).
    shm_mb: size of each private /dev/shm tmpfs (object store + reverb_shm segments).
    private_shm: run worker nodes with a private /dev/shm (see module docstring).

  Use as a context manager, or call start() / shutdown(). start() does not call ray.init.
  """

  def __init__(self, num_cpus: int = 1, object_store_mb: int = 80, shm_mb: int = 512,
               private_shm: bool = True):
    self.num_cpus = num_cpus
    self.object_store_mb = object_store_mb
    self.shm_mb = shm_mb
    self.private_shm = private_shm
    self.temp_dir = tempfile.mkdtemp(prefix="rvray", dir="/tmp")
    self.port = _free_port()
    self.address = f"127.0.0.1:{self.port}"
    self.nodes: Dict[str, subprocess.Popen] = {}
    self._logs: list = []
    self.keep_logs = bool(os.environ.get("RVRAY_KEEP"))   # shutdown() leaves temp_dir

  def _common(self, label: str):
    # Nodes on one host must not share a port: each gets its own (Ray's defaults are fixed).
    ports = _free_ports(6)
    base = 20000 + 400 * (len(self.nodes) % 100)
    return [f"--node-manager-port={ports[0]}", f"--object-manager-port={ports[1]}",
            f"--metrics-export-port={ports[2]}", f"--dashboard-agent-listen-port={ports[3]}",
            f"--dashboard-agent-grpc-port={ports[4]}", f"--runtime-env-agent-port={ports[5]}",
            f"--min-worker-port={base}", f"--max-worker-port={base + 399}",
            f"--num-cpus={self.num_cpus}",
            f"--object-store-memory={self.object_store_mb << 20}",
            "--node-ip-address=127.0.0.1", "--disable-usage-stats", "--block"]

  def _spawn(self, label: str, cmd, private: bool) -> None:
    if private:
      script = (f"mount -t tmpfs -o size={self.shm_mb}m,mode=1777 tmpfs /dev/shm && exec "
                + " ".join(f"'{a}'" for a in cmd))
      cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    log = open(os.path.join(self.temp_dir, f"{label}.log"), "wb")
    self._logs.append(log)
    # A loaded machine registers a node slowly, and a busy node answers health checks late:
    # give it minutes rather than Ray's defaults (which declare a node dead after ~15 s
    # without an answer, taking its actors with it). (A node whose raylet is gone refuses the
    # checks at once: it is declared dead after 12 checks, ~40 s.)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_raylet_start_wait_time_s="300",
               RAY_health_check_timeout_ms="20000", RAY_health_check_failure_threshold="12",
               RAY_worker_register_timeout_seconds="180",
               # a token left in ~/.ray by another cluster must not decide this one's auth
               RAY_AUTH_MODE="disabled",
               RAY_AUTH_TOKEN_PATH=os.path.join(self.temp_dir, "no-auth-token"))
    self.nodes[label] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

  def start(self, timeout_s: float = 300.0) -> "LocalRayCluster":
    """Starts the head node (in this namespace) and waits until it accepts drivers."""
    for attempt in range(3):   # a port taken meanwhile by another process: new ports, again
      cmd = [_ray_bin(), "start", "--head", f"--port={self.port}", "--include-dashboard=false",
             f"--temp-dir={self.temp_dir}", "--resources=" + json.dumps({"head": 1})]
      if importlib.util.find_spec("grpc") is not None:   # Ray starts its client server then
        cmd.append(f"--ray-client-server-port={_free_port()}")
      self._spawn("head", cmd + self._common("head"), private=False)
      try:
        self._wait_started("head", timeout_s)
        return self
      except RuntimeError:
        self.kill_node("head")
        del self.nodes["head"]
        if attempt == 2:
          raise
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
    return self

  def add_node(self, label: str, private_shm: Optional[bool] = None,
               timeout_s: float = 180.0) -> None:
    """Starts a worker node with resource `label` and waits until it runs (nodes are started
    one at a time: Ray names a node's sockets after the ones already in the session)."""
    if label in self.nodes:
      raise ValueError(f"node {label!r} exists")
    private = self.private_shm if private_shm is None else private_shm
    for attempt in range(3):   # a node that failed to register (an overloaded GCS, a port taken
      cmd = [_ray_bin(), "start", f"--address={self.address}",   # meanwhile) is retried
             "--resources=" + json.dumps({label: 1})] + self._common(label)
      self._spawn(label, cmd, private)
      try:
        self._wait_started(label, timeout_s)
        return
      except RuntimeError:
        self.kill_node(label)
        del self.nodes[label]
        if attempt == 2:
          raise

  def _wait_started(self, label: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in self.log(label):
      if self.nodes[label].poll() is not None:
        raise RuntimeError(f"ray node {label} exited: {self.log(label)[-3000:]}")
      # A raylet that died at start (another process took its port meanwhile) leaves
      # `ray start` waiting for ever.
      dead = [n for n in _dead_children(self.nodes[label].pid) if n in ("raylet", "gcs_server")]
      if dead:
        raise RuntimeError(f"ray node {label}: {dead} died while it started")
      if time.monotonic() > deadline:
        raise TimeoutError(f"ray node {label} did not start within {timeout_s} s")
      time.sleep(0.3)

  def wait_for_nodes(self, timeout_s: float = 300.0) -> None:
    """Waits until every started node is alive in the cluster (needs ray.init)."""
    import ray  # pylint: disable=g-import-not-at-top
    deadline = time.monotonic() + timeout_s
    while True:
      labels = {k for n in ray.nodes() if n.get("Alive") for k in n.get("Resources", {})}
      missing = [lab for lab in self.nodes if lab != "head" and lab not in labels
                 and self.nodes[lab].poll() is None]
      if not missing:
        return
      if time.monotonic() > deadline:
        raise TimeoutError(f"nodes {missing} did not join within {timeout_s} s")
      time.sleep(0.5)

  def node_id(self, label: str) -> str:
    """Ray node id of the alive node holding resource `label` ('head' for the head)."""
    import ray  # pylint: disable=g-import-not-at-top
    for n in ray.nodes():
      if n.get("Alive") and n.get("Resources", {}).get(label):
        return n["NodeID"]
    raise KeyError(f"no alive node with resource {label!r}")

  def raylet_pid(self, label: str) -> int:
    """Pid of node `label`'s raylet (a child of its `ray start` process)."""
    root = self.nodes[label].pid
    children: dict = {}
    for pid in os.listdir("/proc"):
      if not pid.isdigit():
        continue
      try:
        with open(f"/proc/{pid}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/comm") as f:
          comm = f.read().strip()
      except OSError:
        continue
      children.setdefault(int(fields[1]), []).append((int(pid), comm))
    stack = [root]
    while stack:
      p = stack.pop()
      for child, comm in children.get(p, []):
        if comm == "raylet":
          return child
        stack.append(child)
    raise KeyError(f"no raylet under node {label!r} (pid {root})")

  def kill_raylet(self, label: str) -> int:
    """SIGKILLs node `label`'s raylet (its workers exit when they lose it); returns its pid."""
    pid = self.raylet_pid(label)
    os.kill(pid, signal.SIGKILL)
    return pid

  def kill_node(self, label: str, timeout_s: float = 30.0) -> None:
    """SIGKILLs every process of node `label` (its process group) and waits for it."""
    p = self.nodes[label]
    try:
      os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    p.wait(timeout=timeout_s)

  def log(self, label: str) -> str:
    with open(os.path.join(self.temp_dir, f"{label}.log"), "rb") as f:
      return f.read().decode("utf-8", "replace")

  def log_report(self, tail_lines: int = 12, max_matches: int = 40) -> str:
    """What to show when a test on this cluster failed: the temp dir, each node's `ray start`
    output tail, and from the Ray session logs (GCS, raylets) the warnings and errors, the
    lines about node health, deaths and actor leases, and each log's tail. Bounded (a few
    hundred lines)."""
    kept = "" if self.keep_logs else " (removed at shutdown)"
    out = [f"ray cluster logs: {self.temp_dir}{kept}"]
    for label in self.nodes:
      try:
        tail = self.log(label).splitlines()[-4:]
      except OSError as e:
        tail = [repr(e)]
      out += [f"--- node {label} (`ray start` pid {self.nodes[label].pid}, exit "
              f"{self.nodes[label].poll()}):"] + tail
    # Ray's log lines: "[date time LEVEL pid tid] ..."; warnings, errors and deaths matter.
    # (and where the GCS sends each actor's lease: a node it still counts alive may be dead)
    notable = re.compile(r"^\[\S+ \S+ [WEF] |health check|heartbeat|\bdead\b|died|death|"
                         r"killed|\boom\b|leasing worker", re.IGNORECASE)
    for path in sorted(glob.glob(os.path.join(self.temp_dir, "session_*", "logs", "*"))):
      name = os.path.basename(path)
      if not (name.startswith(("gcs_server", "raylet")) and name.endswith((".out", ".err"))):
        continue
      try:
        with open(path, "rb") as f:
          lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines()
                   if ln.strip() and not ln.startswith(("[state-dump]", "\t"))]
      except OSError:
        continue
      hits = [ln for ln in lines if notable.search(ln)][-max_matches:]
      if hits:
        out += [f"--- {name}: warnings, errors, deaths (last {max_matches}):"] + hits
      if lines:
        out += [f"--- {name}: tail:"] + lines[-tail_lines:]
    return "\n".join(out)

  def shutdown(self) -> None:
    """Kills every node (workers first, then the head) and removes the temp dir (kept, with
    every node's logs, when keep_logs is set)."""
    for label in [lab for lab in self.nodes if lab != "head"] + ["head"]:
      if label in self.nodes:
        self.kill_node(label)
    # Processes a node left in its session (workers re-parented elsewhere) are in its group.
    for log in self._logs:
      log.close()
    if not self.keep_logs:
      shutil.rmtree(self.temp_dir, ignore_errors=True)

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.shutdown()
