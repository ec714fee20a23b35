"""A TensorFlow learner reading a reverb_shm table through `reverb.TrajectoryDataset`.

    python examples/tf_learner.py [--actors 2] [--steps 300] [--batch-size 64]

As a Reverb program: a Server holds one table whose signature describes a trajectory of
SEQUENCE steps; actor processes (spawned) step a toy environment, append each step to a
TrajectoryWriter and create an item of the last SEQUENCE steps; the learner builds
`reverb.TrajectoryDataset.from_table_signature(...).batch(B)` and fits, with Keras' SGD, a
linear model of the environment's reward (reward = obs . W_TRUE + noise). Only
`import reverb_shm as reverb` differs from a dm-reverb program.

Exits 0 when the learnt weights are within --tolerance of W_TRUE, 1 otherwise, 2 if an actor
failed. Needs the `tf` extra (pip install reverb_shm[tf]).
"""
import argparse
import multiprocessing as mp
import sys
import time

import numpy as np

import reverb_shm as reverb

TABLE = "trajectories"
SEQUENCE = 4
OBS_DIM = 3
W_TRUE = np.array([0.5, -1.0, 2.0], np.float32)


def actor(address: str, seed: int, stop) -> None:
  """Steps a random walk and writes items of its last SEQUENCE steps until `stop` is set."""
  rng = np.random.default_rng(seed)
  client = reverb.Client(address)
  with client.trajectory_writer(num_keep_alive_refs=SEQUENCE) as writer:
    obs = rng.normal(size=OBS_DIM).astype(np.float32)
    step = 0
    while not stop.is_set():
      reward = np.float32(obs @ W_TRUE + rng.normal(scale=0.01))
      writer.append({"observation": obs, "reward": reward})
      step += 1
      if step >= SEQUENCE:
        writer.create_item(TABLE, priority=1.0, trajectory={
            "observation": writer.history["observation"][-SEQUENCE:],
            "reward": writer.history["reward"][-SEQUENCE:]})
      if step % 100 == 0:
        writer.end_episode(timeout_ms=1000)
        step = 0
      obs = (0.9 * obs + rng.normal(scale=0.5, size=OBS_DIM)).astype(np.float32)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--actors", type=int, default=2)
  p.add_argument("--steps", type=int, default=300, help="learner steps (batches)")
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--tolerance", type=float, default=0.1)
  args = p.parse_args(argv)

  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  signature = {"observation": tf.TensorSpec([SEQUENCE, OBS_DIM], tf.float32),
               "reward": tf.TensorSpec([SEQUENCE], tf.float32)}
  server = reverb.Server(tables=[reverb.Table(
      name=TABLE, sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
      max_size=10_000, rate_limiter=reverb.rate_limiters.MinSize(args.batch_size),
      signature=signature)])
  address = f"localhost:{server.port}"
  ctx = mp.get_context("spawn")
  stop = ctx.Event()
  actors = [ctx.Process(target=actor, args=(address, seed, stop), daemon=True)
            for seed in range(args.actors)]
  for a in actors:
    a.start()
  try:
    dataset = reverb.TrajectoryDataset.from_table_signature(
        server_address=address, table=TABLE,
        max_in_flight_samples_per_worker=2 * args.batch_size,
        rate_limiter_timeout_ms=60_000).batch(args.batch_size, drop_remainder=True)
    model = tf.keras.Sequential([tf.keras.Input([OBS_DIM]),
                                 tf.keras.layers.Dense(1, use_bias=False)])
    optimizer = tf.keras.optimizers.SGD(0.05)

    @tf.function
    def train_step(sample):
      obs = tf.reshape(sample.data["observation"], [-1, OBS_DIM])
      reward = tf.reshape(sample.data["reward"], [-1, 1])
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(obs) - reward))
      optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
      return loss

    start = time.monotonic()
    loss = float("nan")
    for step, sample in enumerate(dataset.take(args.steps)):
      loss = float(train_step(sample))
      if any(not a.is_alive() for a in actors):
        print("an actor died", file=sys.stderr)
        return 2
      if step % 100 == 0:
        print(f"step {step}: loss {loss:.4f}, table size "
              f"{reverb.Client(address).server_info()[TABLE].current_size}", flush=True)
    learnt = model.layers[0].kernel.numpy().ravel()
    error = float(np.max(np.abs(learnt - W_TRUE)))
    print(f"{args.steps} steps in {time.monotonic() - start:.1f} s; final loss {loss:.4f}; "
          f"weights {np.round(learnt, 3)} (true {W_TRUE}); max error {error:.3f}")
    return 0 if error <= args.tolerance else 1
  finally:
    stop.set()
    for a in actors:
      a.join(timeout=30)
      if a.is_alive():
        a.kill()
    server.stop()


if __name__ == "__main__":
  sys.exit(main())
