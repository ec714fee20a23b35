"""Acme's `make_reverb_dataset`, called unmodified, on a table that Acme's NStepTransitionAdder
fills: a pytest module that tests/test_acme.py runs in the acme peer venv together with Acme's
adder tests (one process: TensorFlow is imported once), with `import reverb` resolved to
reverb_shm (tests/peers/reverb_shim). Every sampled transition is checked exactly.

Episode e (0..EPISODES-1) has STEPS + 1 timesteps k = 0..STEPS: observation [e, k, 0.5],
reward e * 100 + k (the first timestep's is ignored); the action taken at timestep k is
10 * e + k. With n_step=1 and discount 1 each transition is then
(obs [e, k], action 10e + k, reward 100e + k + 1, discount 1 (0 on the last), next obs
[e, k + 1]).
"""
import dm_env
import numpy as np
import reverb
import tensorflow as tf
from acme import datasets, specs
from acme.adders import reverb as adders

EPISODES, STEPS, BATCH, BATCHES = 6, 7, 16, 12


def timestep(e, k):
  obs = np.array([e, k, 0.5], np.float32)
  if k == 0:
    return dm_env.restart(obs)
  reward = np.float32(100 * e + k)
  if k == STEPS:
    return dm_env.TimeStep(dm_env.StepType.LAST, reward, np.float32(0.0), obs)
  return dm_env.TimeStep(dm_env.StepType.MID, reward, np.float32(1.0), obs)


def test_make_reverb_dataset_reads_what_its_adder_wrote():
  env_spec = specs.EnvironmentSpec(
      observations=specs.Array((3,), np.float32),
      actions=specs.Array((), np.int64),
      rewards=specs.Array((), np.float32),
      discounts=specs.BoundedArray((), np.float32, 0.0, 1.0))
  table = reverb.Table(
      name=adders.DEFAULT_PRIORITY_TABLE, sampler=reverb.selectors.Uniform(),
      remover=reverb.selectors.Fifo(), max_size=1000,
      rate_limiter=reverb.rate_limiters.MinSize(1),
      signature=adders.NStepTransitionAdder.signature(env_spec))
  server = reverb.Server([table])
  address = f"localhost:{server.port}"
  adder = adders.NStepTransitionAdder(reverb.Client(address), n_step=1, discount=1.0)
  for e in range(EPISODES):
    adder.add_first(timestep(e, 0))
    for k in range(STEPS):
      adder.add(np.int64(10 * e + k), timestep(e, k + 1))
  adder.reset()
  size = reverb.Client(address).server_info()[adders.DEFAULT_PRIORITY_TABLE].current_size
  assert size == EPISODES * STEPS, size

  dataset = datasets.make_reverb_dataset(server_address=address, batch_size=BATCH,
                                         prefetch_size=2, num_parallel_calls=3)
  spec = dataset.element_spec
  assert spec.data.observation.shape.as_list() == [BATCH, 3], spec
  assert spec.info.key.dtype == tf.uint64 and spec.info.probability.dtype == tf.float64, spec
  seen = set()
  batches = 0
  for batch in dataset.take(BATCHES):
    batches += 1
    t = tf.nest.map_structure(lambda x: x.numpy(), batch.data)
    e, k = t.observation[:, 0].astype(np.int64), t.observation[:, 1].astype(np.int64)
    assert np.all((0 <= e) & (e < EPISODES) & (0 <= k) & (k < STEPS)), t.observation
    np.testing.assert_array_equal(t.action, 10 * e + k)
    np.testing.assert_array_equal(t.reward, (100 * e + k + 1).astype(np.float32))
    np.testing.assert_array_equal(t.discount, (k + 1 < STEPS).astype(np.float32))
    np.testing.assert_array_equal(t.next_observation[:, :2], np.stack([e, k + 1], 1))
    np.testing.assert_array_equal(batch.info.probability.numpy(),
                                  np.full(BATCH, 1.0 / (EPISODES * STEPS)))
    seen.update(zip(e.tolist(), k.tolist()))
  server.stop()
  assert batches == BATCHES
  assert len(seen) >= 20, seen   # 192 uniform samples of 42 transitions
