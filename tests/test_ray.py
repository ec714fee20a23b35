"""reverb_shm.ray on a real multi-node Ray cluster on this machine.

One cluster for the module (reverb_shm.ray.local_cluster): a head node in this process's mount
namespace and worker nodes each with a private tmpfs on /dev/shm (`unshare --mount`), so no
node sees another's segments. Servers run on the head and on nodes A and B; node C has none
until the failure test (which runs last) kills node A and restores its shard on node C.
"""
import os
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import reverb_shm  # noqa: E402
from reverb_shm import rate_limiters, selectors  # noqa: E402
from reverb_shm.ray import ReplayCluster, split_batch  # noqa: E402
from reverb_shm.ray.local_cluster import LocalRayCluster  # noqa: E402
from conftest import import_error_without, stop_process, unique_server_name  # noqa: E402

pytestmark = pytest.mark.timeout(900)

EXPONENT = 0.8
# (node label, priorities written there); one item of priority 0 is never sampled.
PRIOS = {"head": [1.0, 2.0, 3.0], "nodeA": [4.0, 5.0], "nodeB": [0.5, 6.0, 0.0]}
UNIFORM_COUNTS = {"head": 2, "nodeA": 3, "nodeB": 5}
CALL_S = 60   # deadline of every blocking Ray call in this module


def _tables():
  return [
      reverb_shm.Table("prio", selectors.Prioritized(EXPONENT), selectors.Fifo(), 1000,
                       rate_limiters.MinSize(1)),
      reverb_shm.Table("unif", selectors.Uniform(), selectors.Fifo(), 1000,
                       rate_limiters.MinSize(1)),
      reverb_shm.Table("stream", selectors.Uniform(), selectors.Fifo(), 100,
                       rate_limiters.MinSize(1)),
  ]


def _unshare_works():
  return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  if not _unshare_works():
    pytest.fail("`unshare --mount` is needed for nodes with a private /dev/shm (run as root)")
  local = LocalRayCluster(num_cpus=1, object_store_mb=80, shm_mb=384)
  handle = None
  try:
    local.start()
    for label in ("nodeA", "nodeB", "nodeC"):
      local.add_node(label)
    ray.init(address=local.address, log_to_driver=False, namespace="reverb_shm_test")
    local.wait_for_nodes()
    nodes = [local.node_id(l) for l in ("head", "nodeA", "nodeB")]
    handle = ReplayCluster.start(
        _tables(), nodes=nodes, checkpoint_root=str(tmp_path_factory.mktemp("ckpt")),
        server_kwargs={"arena_bytes": 32 << 20}, timeout_s=CALL_S * 2)
    yield local, handle
  finally:
    if handle is not None:
      handle.stop(timeout_s=20)
    if ray.is_initialized():
      ray.shutdown()
    local.shutdown()


@pytest.fixture(autouse=True)
def _ray_logs_on_failure(request):
  """A test on the cluster that failed keeps the cluster's logs (temp dir) and shows their
  tails: which node Ray declared dead, and why, is only in them."""
  failed = request.session.testsfailed
  yield
  if request.session.testsfailed > failed and "cluster" in request.fixturenames:
    local, _ = request.getfixturevalue("cluster")
    local.keep_logs = True
    report = local.log_report()
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
      print(f"\n{request.node.nodeid} failed; {report}", file=sys.stderr, flush=True)


def _on(label):
  return {"resources": {label: 0.01}}


@ray.remote(num_cpus=0)
def _probe(handle):
  """What a task sees on its node: the shard there, the kind of client it gets, and which
  shards' segments it can attach to."""
  c = handle.client()
  return {"node": ray.get_runtime_context().get_node_id(), "local_shard": handle.local_shard(),
          "client": type(c).__name__,
          "attachable": [handle.attach_local(s) is not None for s in range(handle.num_shards)],
          "dev_shm": sorted(n for n in os.listdir("/dev/shm")
                            if n.startswith("rvshm.") and not n.startswith("rvshm.port."))}


@ray.remote(num_cpus=0)
def _write(handle, table, priorities, base):
  c = handle.client()
  for i, p in enumerate(priorities):
    c.insert(np.array([base + i], np.int64), {table: float(p)}, timeout_ms=10_000)
  return type(c).__name__


@ray.remote(num_cpus=0)
class _Writer:
  """A writer actor that inserts into 'stream' through its node's client."""

  def __init__(self, handle):
    self.client = handle.client()
    self.kind = type(self.client).__name__
    self.n = 0

  def insert(self, k):
    for _ in range(k):
      self.client.insert(np.array([self.n], np.int64), {"stream": 1.0}, timeout_ms=10_000)
      self.n += 1
    return self.n, self.kind


def _shard(handle, local, label):
  node = local.node_id(label)
  return next(e.shard for e in handle.entries if e.node_id == node)


# ---- no cluster needed
def test_import_reverb_shm_does_not_import_ray():
  out = subprocess.run([sys.executable, "-c",
                        "import sys, reverb_shm, reverb_shm.bridge; "
                        "print('ray' in sys.modules)"], capture_output=True, text=True,
                       timeout=60)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "False"


def test_without_ray_the_import_error_names_the_extra():
  assert "pip install reverb_shm[ray]" in import_error_without("import reverb_shm.ray", "ray")


def test_split_batch_is_multinomial_over_masses():
  rng = np.random.default_rng(0)
  masses = [1.0, 3.0, 0.0, 6.0]
  counts = np.array([split_batch(10, masses, rng) for _ in range(20000)])
  assert (counts.sum(axis=1) == 10).all()
  assert (counts[:, 2] == 0).all()
  np.testing.assert_allclose(counts.mean(axis=0), [1.0, 3.0, 0.0, 6.0], atol=0.05)
  # `size` independent splits at once (a prefetched group), the same distribution.
  group = split_batch(10, masses, rng, size=20000)
  assert group.shape == (20000, 4) and (group.sum(axis=1) == 10).all()
  np.testing.assert_allclose(group.mean(axis=0), [1.0, 3.0, 0.0, 6.0], atol=0.05)
  with pytest.raises(ValueError, match="mass 0"):
    split_batch(4, [0.0, 0.0], rng)
  with pytest.raises(ValueError, match="finite and >= 0"):
    split_batch(4, [1.0, -1.0], rng)


def test_prefetched_batches_share_one_answer_per_bridge_in_slices():
  """One bridge answer for several prefetched batches: each takes its slice, in order; a short
  answer (the bridge's limiter admitted fewer) leaves the last ones empty; the answer is
  awaited once and an error reaches every sharer."""
  from reverb_shm.ray import sampling  # pylint: disable=g-import-not-at-top
  from reverb_shm.replay_sample import ReplaySample, SampleInfo  # pylint: disable=g-import-not-at-top
  calls = []

  def answer(n):
    def call():
      calls.append(n)
      keys = np.arange(n, dtype=np.uint64)
      info = SampleInfo(keys, keys / 10.0, np.full(n, 9, np.int64), keys * 1.0,
                        np.zeros(n, np.int32))
      return ReplaySample(info, [np.arange(2 * n).reshape(n, 2)]), {"size": 9}
    call.cancel = lambda: None
    return call
  shared = sampling._Shared(answer(5))  # pylint: disable=protected-access
  slices = [sampling._Slice(shared, a, k) for a, k in ((0, 3), (3, 4), (7, 2))]  # pylint: disable=protected-access
  (b0, s0), (b1, s1), (b2, s2) = [sl() for sl in slices]
  assert calls == [5] and s0 == s1 == s2 == {"size": 9}
  assert b0.info.key.tolist() == [0, 1, 2] and b0.data[0].tolist() == [[0, 1], [2, 3], [4, 5]]
  assert b1.info.key.tolist() == [3, 4] and b1.info.probability.tolist() == [0.3, 0.4]
  assert b2 is None

  # A shard's share above 1024 items goes out as several messages (a bridge pins one
  # message's items at once), joined in order into one answer.
  sizes = []

  class _FakeBridge:
    def sample_batch_async(self, table, n, timeout_ms, rpc_timeout):
      sizes.append(n)
      base, part = sum(sizes[:-1]), len(sizes)
      def call():
        keys = np.arange(base, base + n, dtype=np.uint64)
        info = SampleInfo(keys, keys / 10.0, np.full(n, 9, np.int64), keys * 1.0,
                          np.zeros(n, np.int32))
        return ReplaySample(info, [keys.reshape(n, 1) * 2]), {"size": 9, "part": part}
      call.cancel = lambda: None
      return call
  cc = sampling.ClusterClient(types.SimpleNamespace(entries=[], num_shards=0))
  cc._clients = {1: _FakeBridge()}  # pylint: disable=protected-access
  pending, failed = cc._send_remote([1], "t", {1: 2500}, None)  # pylint: disable=protected-access
  assert sizes == [833, 833, 834] and not failed
  batch, stats = pending[1]()
  assert batch.info.key.tolist() == list(range(2500)) and stats["part"] == 3
  assert batch.data[0][:, 0].tolist() == [2 * k for k in range(2500)]
  cc.close()

  def fail():
    raise ValueError("node gone")
  fail.cancel = lambda: None
  broken = sampling._Shared(fail)  # pylint: disable=protected-access
  for a in (0, 2):
    with pytest.raises(ValueError, match="node gone"):
      sampling._Slice(broken, a, 2)()  # pylint: disable=protected-access


def test_sampled_keys_are_remembered_within_key_memory():
  """Keys are logged per answer and filed only when a lookup needs them; about the last
  key_memory keys drawn are remembered (a key drawn again keeps its first place)."""
  from reverb_shm.ray.sampling import ClusterClient  # pylint: disable=g-import-not-at-top
  cc = ClusterClient(types.SimpleNamespace(entries=[], num_shards=0), key_memory=5)
  cc._log_keys(np.array([1, 2, 3], np.uint64), 0)  # pylint: disable=protected-access
  cc._log_keys(np.array([4, 5], np.uint64), 2)  # pylint: disable=protected-access
  assert [cc.shard_of(k) for k in (1, 2, 3, 4, 5, 6)] == [0, 0, 0, 2, 2, None]
  cc._log_keys(np.array([6, 1, 7], np.uint64), 0)  # pylint: disable=protected-access
  # filed: 1..7 (1 kept its place), 7 > 5 keys: the two filed first (1, 2) are forgotten
  assert [cc.shard_of(k) for k in (1, 2, 3, 6, 7)] == [None, None, 0, 0, 0]
  for k in range(10, 16):   # 6 keys drawn without a lookup: only the last 5 are kept
    cc._log_keys(np.array([k], np.uint64), 1)  # pylint: disable=protected-access
  assert [cc.shard_of(k) for k in (3, 7, 10, 11, 15)] == [None, None, None, 1, 1]
  assert len(cc._filed_keys()) == 5  # pylint: disable=protected-access
  cc.close()


def test_group_answers_put_every_shards_rows_in_batch_order_or_decline():
  """A prefetched group's answers are assembled once: batch j holds its rows of shard 0, then
  of shard 1 (the order of the per-batch cut); a failed shard, a short answer or a shard
  without a call but with items leave the batches to be cut one by one (None)."""
  from reverb_shm.ray._group import GroupAnswers, batch_order  # pylint: disable=g-import-not-at-top
  from reverb_shm.replay_sample import ReplaySample, SampleInfo  # pylint: disable=g-import-not-at-top
  counts = np.array([[2, 1], [0, 3], [1, 1]])
  assert batch_order(counts).tolist() == [0, 1, 3, 4, 5, 6, 2, 7]

  class _Answer:
    def __init__(self, keys, error=None):
      self.keys, self.error, self.gets = np.asarray(keys, np.uint64), error, 0

    def get(self):
      self.gets += 1
      if self.error is not None:
        raise self.error
      k = self.keys
      info = SampleInfo(k, k / 10.0, np.full(len(k), 9, np.int64), k * 1.0,
                        np.zeros(len(k), np.int32))
      return ReplaySample(info, [np.stack([k, k + 1], axis=1)]), {"size": 9}

  a, b = _Answer([10, 11, 12]), _Answer([20, 21, 22, 23, 24])
  group = GroupAnswers([a, b], counts)
  batches = [group.batch(j) for j in range(3)]
  assert [x.info.key.tolist() for x in batches] == [[10, 11, 20], [21, 22, 23], [12, 24]]
  assert batches[1].data[0].tolist() == [[21, 22], [22, 23], [23, 24]]
  assert batches[2].info.probability.tolist() == [1.2, 2.4]
  assert a.gets == b.gets == 1   # (assembled once)
  # A shard that drew nothing in the whole group needs no call.
  only = GroupAnswers([None, _Answer([1, 2])], np.array([[0, 1], [0, 1]]))
  assert only.batch(1).info.key.tolist() == [2]
  for calls in ([a, _Answer([20, 21, 22, 23])],                     # short answer
                [a, _Answer([], error=ConnectionError("gone"))],   # failed shard
                [None, b]):                                       # no call for shard 0's items
    declined = GroupAnswers(calls, counts)
    assert declined.batch(0) is None and declined.batch(2) is None


def test_prefetch_draws_the_local_share_per_group_within_the_rate_limiter(server_factory):
  """This node's share of a prefetched group is one C gather at the group's first use, of
  what the shard's rate limiter admits then: batches it leaves short draw their missing items
  again (waiting for the limiter, within the call's timeout). One local shard, no Ray."""
  from reverb_shm.ray.cluster import ClusterHandle, ShardEntry  # pylint: disable=g-import-not-at-top
  name = unique_server_name("ray")
  table = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 1000,
                           rate_limiters.SampleToInsertRatio(1.0, 1, (0.0, 10_000.0)))
  server = server_factory([table], name=name)
  client = reverb_shm.Client(f"shm://{name}")
  for i in range(100):
    client.insert(np.array([i], np.int64), {"t": 1.0})
  generation = int(client._segment().info()["generation"])  # pylint: disable=protected-access
  handle = ClusterHandle("unit", [ShardEntry(0, "n0", name, server.port, "", generation, "a0")],
                         "token", "/tmp", [table], {})
  cc = handle.global_client(prefetch=4)
  assert cc.live_shards == [0] and cc.is_local(0)
  st = client.shared_table("t")
  # 100 samples admitted: the first batch (drawn alone), then a group of 4 x 30 gets 70 at
  # its first use.
  for samples in (30, 100, 100):
    batch = cc.sample_batch("t", 30, rate_limiter_timeout_ms=50)
    assert len(batch.info.key) == 30 and st.stats()["samples"] == samples
    np.testing.assert_array_equal(batch.info.probability, np.full(30, 1 / 100))
    assert (batch.info.table_size == 100).all()
  with pytest.raises(reverb_shm.errors.DeadlineExceededError):
    cc.sample_batch("t", 30, rate_limiter_timeout_ms=50)   # 10 in its slice, 20 refused
  for i in range(100, 200):
    client.insert(np.array([i], np.int64), {"t": 1.0})
  batch = cc.sample_batch("t", 30, rate_limiter_timeout_ms=1000)   # empty slice: drawn anew
  assert len(batch.info.key) == 30 and (batch.info.table_size == 200).all()
  np.testing.assert_array_equal(batch.info.probability, np.full(30, 1 / 200))
  assert cc.shard_of(int(batch.info.key[0])) == 0
  cc.close()


# ---- on the cluster
def test_same_node_is_decided_by_attaching(cluster):
  local, handle = cluster
  seen = {l: ray.get(_probe.options(**_on(l)).remote(handle), timeout=CALL_S)
          for l in ("nodeA", "nodeB", "nodeC")}
  a, b = _shard(handle, local, "nodeA"), _shard(handle, local, "nodeB")
  head = _shard(handle, local, "head")
  # Each worker node sees only its own server's segment (a private /dev/shm).
  assert seen["nodeA"]["dev_shm"] == [f"rvshm.{handle.entries[a].server_name}"]
  assert seen["nodeB"]["dev_shm"] == [f"rvshm.{handle.entries[b].server_name}"]
  assert seen["nodeC"]["dev_shm"] == []
  for label, shard in (("nodeA", a), ("nodeB", b)):
    assert seen[label]["local_shard"] == shard
    assert seen[label]["client"] == "Client"   # shared memory
    assert seen[label]["attachable"] == [s == shard for s in range(3)]
  # No server on node C: a bridge client, and no segment reachable.
  assert seen["nodeC"]["local_shard"] is None
  assert seen["nodeC"]["client"] == "RemoteClient"
  assert seen["nodeC"]["attachable"] == [False] * 3
  # The driver runs on the head node, in the head's namespace.
  assert handle.local_shard() == head
  assert [handle.attach_local(s) is not None for s in range(3)] == [s == head for s in range(3)]
  assert type(handle.client()).__name__ == "Client"
  # A client asked for another node's shard goes through that shard's bridge.
  assert type(handle.client(shard=a)).__name__ == "RemoteClient"


def _fill(handle, local):
  kinds = []
  base = 0
  for label, prios in PRIOS.items():
    kinds.append(ray.get(_write.options(**_on(label)).remote(handle, "prio", prios, base),
                         timeout=CALL_S))
    base += 100
  for label, n in UNIFORM_COUNTS.items():
    kinds.append(ray.get(_write.options(**_on(label)).remote(handle, "unif", [1.0] * n, base),
                         timeout=CALL_S))
    base += 100
  assert kinds == ["Client"] * 6   # every writer wrote through its node's shared memory


@pytest.fixture(scope="module")
def filled(cluster):
  local, handle = cluster
  _fill(handle, local)
  return local, handle


def test_global_prioritized_sampling_matches_one_table(filled):
  local, handle = filled
  cc = handle.global_client(seed=1, timeout_s=10)
  # value -> priority (values: 100 * node index + position)
  prio_of = {}
  for n, prios in enumerate(PRIOS.values()):
    for i, p in enumerate(prios):
      prio_of[100 * n + i] = p
  total = sum(p ** EXPONENT for p in prio_of.values())
  counts = dict.fromkeys(prio_of, 0)
  draws = 0
  for _ in range(60):
    for s in cc.sample("prio", 250, rate_limiter_timeout_ms=10_000):
      value = int(np.asarray(s.data[0]).reshape(-1)[0])
      expected = prio_of[value] ** EXPONENT / total
      assert s.info.probability == pytest.approx(expected, rel=1e-12, abs=0)
      assert s.info.table_size == len(prio_of)
      assert s.info.priority == prio_of[value]
      counts[value] += 1
      draws += 1
  assert draws == 15000
  for value, p in prio_of.items():
    q = p ** EXPONENT / total
    sigma = np.sqrt(draws * q * (1 - q))
    assert abs(counts[value] - draws * q) <= 5 * sigma + 1, (value, counts[value], draws * q)
  assert counts[202] == 0   # priority 0
  batch = cc.sample_batch("prio", 64, rate_limiter_timeout_ms=10_000)
  assert batch.info.key.dtype == np.uint64 and batch.info.probability.shape == (64,)
  values = np.asarray(batch.data[0]).reshape(64)
  np.testing.assert_allclose(batch.info.probability,
                             [prio_of[v] ** EXPONENT / total for v in values], rtol=1e-12)
  assert (batch.info.table_size == len(prio_of)).all()
  assert cc.failures == 0
  # Prefetching (the bridges' parts of the next batches requested ahead and together, split by
  # the masses of earlier answers): the same distribution and exact probabilities.
  pf = handle.global_client(seed=6, timeout_s=10, prefetch=2, max_mass_age_s=60)
  counts = dict.fromkeys(prio_of, 0)
  for _ in range(40):
    batch = pf.sample_batch("prio", 250, rate_limiter_timeout_ms=10_000)
    values = np.asarray(batch.data[0]).reshape(-1)
    assert len(values) == 250 and (batch.info.table_size == len(prio_of)).all()
    np.testing.assert_allclose(batch.info.probability,
                               [prio_of[v] ** EXPONENT / total for v in values], rtol=1e-12)
    for v in values.tolist():
      counts[v] += 1
  # (fewer than 2 ahead: the next 2 are requested together, one request per bridge)
  assert 1 <= len(pf._pending) <= 3   # pylint: disable=protected-access
  for value, p in prio_of.items():
    q = p ** EXPONENT / total
    assert abs(counts[value] - 10_000 * q) <= 5 * np.sqrt(10_000 * q * (1 - q)) + 1, counts
  assert len(pf.sample_batch("prio", 7, rate_limiter_timeout_ms=10_000).info.key) == 7
  pf.close()
  assert not pf._pending   # pylint: disable=protected-access
  assert cc.is_local(_shard(handle, local, "head"))
  assert not cc.is_local(_shard(handle, local, "nodeA"))
  info = cc.server_info()
  assert info["prio"].current_size == len(prio_of)
  assert info["unif"].current_size == sum(UNIFORM_COUNTS.values())
  cc.close()


def test_global_uniform_sampling_splits_by_item_counts(filled):
  local, handle = filled
  cc = handle.global_client(seed=2, timeout_s=10)
  n_items = sum(UNIFORM_COUNTS.values())
  per_node = dict.fromkeys(UNIFORM_COUNTS, 0)
  labels = list(UNIFORM_COUNTS)
  draws = 0
  for _ in range(20):
    for s in cc.sample("unif", 250, rate_limiter_timeout_ms=10_000):
      value = int(np.asarray(s.data[0]).reshape(-1)[0])
      per_node[labels[value // 100 - 3]] += 1
      assert s.info.probability == pytest.approx(1 / n_items, rel=1e-12, abs=0)
      assert s.info.table_size == n_items
      draws += 1
  for label, n in UNIFORM_COUNTS.items():
    q = n / n_items
    assert abs(per_node[label] - draws * q) <= 5 * np.sqrt(draws * q * (1 - q)), per_node
  cc.close()


def _mass(handle, shard, table="prio"):
  c = handle.remote_client(shard)
  try:
    entry = next(e for e in c._fetch_tables(timeout=10) if e["name"] == table)
    return entry["stats"]["sampler_total_weight"]
  finally:
    c.close()


def test_priority_updates_reach_the_shard_holding_the_key(filled):
  local, handle = filled
  cc = handle.global_client(seed=3, timeout_s=10)
  a = _shard(handle, local, "nodeA")
  samples = cc.sample("prio", 200, rate_limiter_timeout_ms=10_000)
  on_a = [s for s in samples if cc.shard_of(s.info.key) == a]
  assert on_a, "no sample from node A in 200 draws"
  key, old = int(on_a[0].info.key), float(on_a[0].info.priority)
  before = [_mass(handle, s) for s in range(3)]
  assert cc.mutate_priorities("prio", updates={key: 50.0}) == (1, 0)
  after = [_mass(handle, s) for s in range(3)]
  for s in range(3):
    if s == a:
      assert after[s] == pytest.approx(before[s] - old ** EXPONENT + 50.0 ** EXPONENT,
                                       rel=1e-12)
    else:
      assert after[s] == before[s]
  # Keys the client has not sampled go to every shard; unknown everywhere: nothing changes.
  assert cc.mutate_priorities("prio", updates={12345: 1.0}) == (0, 0)
  assert cc.mutate_priorities("prio", updates={key: old}) == (1, 0)
  assert _mass(handle, a) == pytest.approx(before[a], rel=1e-12)
  cc.close()

  # A prefetching learner's batches (the bridges' parts cut from shared answers) route the
  # same way.
  pf = handle.global_client(seed=7, timeout_s=10, prefetch=4)
  pf.sample_batch("prio", 200, rate_limiter_timeout_ms=10_000)
  batch = pf.sample_batch("prio", 200, rate_limiter_timeout_ms=10_000)
  labels = list(PRIOS)   # values written on node i are 100 * i + position
  writer = [_shard(handle, local, labels[v // 100])
            for v in np.asarray(batch.data[0]).reshape(-1).tolist()]
  assert [pf.shard_of(k) for k in batch.info.key.tolist()] == writer
  i = writer.index(a)
  key, old = int(batch.info.key[i]), float(batch.info.priority[i])
  before = [_mass(handle, s) for s in range(3)]
  assert pf.mutate_priorities("prio", updates={key: 40.0}) == (1, 0)
  after = [_mass(handle, s) for s in range(3)]
  assert after[a] == pytest.approx(before[a] - old ** EXPONENT + 40.0 ** EXPONENT, rel=1e-12)
  assert [m for s, m in enumerate(after) if s != a] == [m for s, m in enumerate(before)
                                                          if s != a]
  assert pf.mutate_priorities("prio", updates={key: old}) == (1, 0)
  pf.close()


def test_a_stalled_node_is_dropped_within_the_deadline_and_rejoins(filled):
  local, handle = filled
  b = _shard(handle, local, "nodeB")
  cc = handle.global_client(seed=5, timeout_s=2, revive_after_s=0.5)
  assert len(cc.sample("prio", 32, rate_limiter_timeout_ms=10_000)) == 32
  pid = handle.entries[b].pid
  stop_process(pid)   # the server process (and its bridge) stops answering
  try:
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=f"shard {b} .* dropped"):
      got = cc.sample("prio", 32, rate_limiter_timeout_ms=10_000)
    assert time.monotonic() - t0 < 20
    assert len(got) == 32 and cc.failures == 1 and list(cc.dead) == [b]
    assert all(cc.shard_of(s.info.key) != b for s in got)
    # Probing the stalled shard (up to timeout_s = 2 s) happens in the background: sampling
    # from the live shards does not wait for it.
    time.sleep(0.6)
    for _ in range(3):
      t0 = time.monotonic()
      assert len(cc.sample("prio", 32, rate_limiter_timeout_ms=10_000)) == 32
      assert time.monotonic() - t0 < 1.0
    assert list(cc.dead) == [b]
  finally:
    os.kill(pid, signal.SIGCONT)
  time.sleep(0.6)
  # The first call starts the probe in the background and does not wait for it; a later one
  # takes its answer in.
  t0 = time.monotonic()
  with pytest.warns(RuntimeWarning, match=f"shard {b} answers again"):
    while not cc.revived and time.monotonic() - t0 < 30:
      got = cc.sample("prio", 32, rate_limiter_timeout_ms=10_000)
      time.sleep(0.05)
  assert cc.revived == 1 and not cc.dead and cc.live_shards == [0, 1, 2]
  cc.close()


def test_node_failure_checkpoint_and_restore(filled):
  local, handle = filled
  a, b = _shard(handle, local, "nodeA"), _shard(handle, local, "nodeB")
  paths = handle.checkpoint(timeout_s=CALL_S)
  # Replacing a live shard is refused and changes nothing (it would lose what follows the
  # checkpoint).
  entry_a = handle.entries[a]
  with pytest.raises(ValueError, match=f"shard {a}'s server .* is still alive"):
    handle.replace(a, local.node_id("head"), timeout_s=CALL_S)
  assert handle.entries[a] == entry_a and handle.alive(timeout_s=CALL_S)[a]
  assert len(paths) == 3 and all(p and os.path.isdir(p) for p in paths)
  assert all(p.startswith(os.path.join(handle.checkpoint_root, f"shard-{i}"))
             for i, p in enumerate(paths))
  writer_b = _Writer.options(**_on("nodeB")).remote(handle)
  assert ray.get(writer_b.insert.remote(10), timeout=CALL_S) == (10, "Client")
  cc = handle.global_client(seed=4, timeout_s=10, revive_after_s=1e9)
  assert len(cc.sample("prio", 64, rate_limiter_timeout_ms=10_000)) == 64

  node_a = local.node_id("nodeA")
  local.kill_raylet("nodeA")
  t0 = time.monotonic()
  with pytest.warns(RuntimeWarning, match=f"shard {a} .* dropped"):
    got = None
    while time.monotonic() - t0 < 60:   # until node A's processes are gone
      got = cc.sample("prio", 64, rate_limiter_timeout_ms=10_000)
      if cc.failures:
        break
  assert cc.failures == 1 and list(cc.dead) == [a]
  assert time.monotonic() - t0 < 60
  # Sampling goes on from the head and node B only, with their global probabilities.
  total = sum(p ** EXPONENT for l, ps in PRIOS.items() if l != "nodeA" for p in ps)
  for _ in range(3):
    got = cc.sample("prio", 64, rate_limiter_timeout_ms=10_000)
    assert len(got) == 64
    for s in got:
      assert cc.shard_of(s.info.key) != a
      assert s.info.probability == pytest.approx(s.info.priority ** EXPONENT / total,
                                                 rel=1e-12)
  # The writer on node B is unaffected.
  assert ray.get(writer_b.insert.remote(10), timeout=CALL_S) == (20, "Client")
  # Checkpointing now reports the dead shard as None (within the deadline).
  with pytest.warns(UserWarning, match=f"shard {a} .* did not checkpoint"):
    paths2 = handle.checkpoint(timeout_s=20)
  assert paths2[a] is None and paths2[b] is not None

  # Ray declares node A dead (its raylet refuses the health checks) within the deadline.
  while any(n["NodeID"] == node_a and n.get("Alive") for n in ray.nodes()):
    assert time.monotonic() - t0 < CALL_S * 2, "Ray still counts node A alive"
    time.sleep(0.5)

  # A replacement node (node C, which had no server) restores node A's shard from its last
  # checkpoint.
  entry = handle.replace(a, local.node_id("nodeC"), timeout_s=CALL_S * 2)
  assert entry.restored_from == paths[a]
  assert entry.node_id == local.node_id("nodeC")
  assert cc.refresh(handle) == [0, 1, 2]
  info = cc.shard_infos()[a]
  assert info["prio"].current_size == len(PRIOS["nodeA"])
  assert info["unif"].current_size == UNIFORM_COUNTS["nodeA"]
  full = sum(p ** EXPONENT for ps in PRIOS.values() for p in ps)
  seen_a = 0
  for s in cc.sample("prio", 500, rate_limiter_timeout_ms=10_000):
    assert s.info.probability == pytest.approx(s.info.priority ** EXPONENT / full, rel=1e-12)
    seen_a += cc.shard_of(s.info.key) == a
  assert seen_a > 0
  probe = ray.get(_probe.options(**_on("nodeC")).remote(handle), timeout=CALL_S)
  assert probe["local_shard"] == a and probe["client"] == "Client"
  ray.kill(writer_b)
  cc.close()


def test_a_killed_server_on_the_learners_node_is_dropped_for_every_table(filled):
  """This node's shard is sampled through shared memory, whose tables stay readable in this
  process after its server dies: the learner drops it at once all the same, for a table it
  sampled before the kill as for one it had not."""
  local, handle = filled
  h = _shard(handle, local, "head")
  cc = handle.global_client(seed=7, timeout_s=2, revive_after_s=0.2)
  assert cc.is_local(h)
  for call in (cc.sample, cc.sample_batch):   # (a bad timeout: the local clients' message)
    with pytest.raises(ValueError, match=r"rate_limiter_timeout_ms must be None \(wait forever\) "
                                         r"or >= 0 milliseconds, got -1"):
      call("prio", 4, rate_limiter_timeout_ms=-1)
  # (sample_batch draws this node's share straight from the cached table)
  before = cc.sample_batch("prio", 64, rate_limiter_timeout_ms=10_000)
  assert len(before.info.key) == 64
  os.kill(handle.entries[h].pid, signal.SIGKILL)
  t0 = time.monotonic()
  with pytest.warns(RuntimeWarning, match=f"shard {h} .* dropped"):
    while not cc.dead and time.monotonic() - t0 < 10:
      got = cc.sample_batch("prio", 64, rate_limiter_timeout_ms=10_000)
      time.sleep(0.01)
  assert list(cc.dead) == [h] and "DeadOwnerError" in cc.dead[h]
  assert time.monotonic() - t0 < 5
  for table in ("prio", "unif"):
    for _ in range(3):
      keys = cc.sample_batch(table, 64, rate_limiter_timeout_ms=10_000).info.key.tolist()
      keys += [s.info.key for s in cc.sample(table, 64, rate_limiter_timeout_ms=10_000)]
      assert len(keys) == 128 and all(cc.shard_of(k) != h for k in keys)
      time.sleep(0.1)   # (probes of the dead shard start, and fail, meanwhile)
  assert list(cc.dead) == [h] and cc.revived == 0

  # Batches sampled before the death still carry the dead shard's keys: their priority updates
  # and deletes are dropped at once and counted, not sent to every live shard (where they
  # would be counted as not found); the other keys still reach their shards.
  dead_keys = sorted({k for k in before.info.key.tolist() if cc.shard_of(k) == h})
  live = list({k: p for k, p in zip(before.info.key.tolist(), before.info.priority.tolist())
               if cc.shard_of(k) != h}.items())[:2]   # (distinct keys)
  assert len(dead_keys) >= 2 and live, "the batch holds no keys of the killed shard"
  sent = []
  for s in cc.live_shards:
    real = cc._clients[s].mutate_priorities

    def recording(table, updates=None, deletes=None, s=s, real=real):
      sent.append((s, dict(updates or {}), list(deletes or ())))
      return real(table, updates, deletes)
    cc._clients[s].mutate_priorities = recording
  updates = {k: 9.0 for k in dead_keys[1:]}
  updates.update(live)   # (their own priorities: nothing changes on the live shards)
  assert cc.mutate_priorities("prio", updates=updates, deletes=dead_keys[:1]) == (len(live), 0)
  assert all(k not in u and k not in d for _, u, d in sent for k in dead_keys)
  assert sorted(s for s, _, _ in sent) == sorted({cc.shard_of(k) for k, _ in live})
  assert cc.dead_shard_keys == len(dead_keys)
  cc.close()
  # A writer on this node asking for its node's client hears of the death at once (not from a
  # bridge client that retries the dead bridge for reconnect_timeout_s).
  t0 = time.monotonic()
  with pytest.raises(reverb_shm.errors.DeadOwnerError, match="is dead"):
    handle.client(h, reconnect_timeout_s=10)
  assert time.monotonic() - t0 < 2
