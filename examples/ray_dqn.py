"""Distributed DQN on CartPole-v1 on a Ray cluster: a reverb_shm server on every node.

    python examples/ray_dqn.py                       # a local 3-node Ray cluster on this machine
    python examples/ray_dqn.py --address HEAD:6379   # an existing Ray cluster

The job (this process, the learner) starts a reverb_shm server on each Ray node it uses
(``reverb_shm.ray.ReplayCluster``) and one actor per node (a Ray actor pinned there). Each actor
writes n-step transitions through ``handle.client()``: shared memory to its own node's server,
no network hop. The learner samples prioritized batches across all nodes with
``ClusterClient.sample_batch`` (the batch is split by each node's priority mass, so items are
drawn as from one global table, with global probabilities for the importance weights) and
routes the new priorities back to the node that holds each item. Actors fetch the learner's
weights from a small Ray actor.

The DQN pieces are those of the single-host example (actor_learner.py: the table, the run
configuration; dqn.py: the learner; policy.py: the numpy policy; transitions.py: the n-step
writer). Rate limiters are per node: each node's table waits for its own actor's inserts.

On a real cluster: install reverb_shm[ray] and gymnasium on every node, start Ray there
(`ray start --head` on one node, `ray start --address=HEAD:6379` on the others), and run this
script on the head node with --address HEAD:6379 and --checkpoint-root on storage every node
sees. Exit codes as actor_learner.py: 0 learnt, 1 not learnt, 2 an actor failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402

import reverb_shm as reverb  # noqa: E402
from actor_learner import (ENV_ID, HIDDEN, NUM_ACTIONS, OBS_DIM, RETURN_WINDOW, TABLE,  # noqa: E402
                           RunConfig, act_and_write, make_table)
from policy import NumpyQNetwork, linear_epsilon  # noqa: E402
from reverb_shm.ray import ReplayCluster  # noqa: E402
from reverb_shm.ray.local_cluster import LocalRayCluster  # noqa: E402
from transitions import NStepTransitionWriter  # noqa: E402


@ray.remote(num_cpus=0)
class Coordinator:
    """The learner's published weights, the stop flag, and what the actors report."""

    def __init__(self):
        self.version, self.flat, self.stop = 0, None, False
        self.steps, self.returns = {}, []

    def publish(self, flat):
        self.version += 1
        self.flat = flat

    def fetch(self, version):
        """(version, weights or None if unchanged, stop)."""
        return self.version, (self.flat if self.version != version else None), self.stop

    def report(self, actor_id, steps, returns):
        self.steps[actor_id] = steps
        self.returns.extend(returns)

    def progress(self):
        """(total env steps, episode returns since the last call)."""
        returns, self.returns = self.returns, []
        return sum(self.steps.values()), returns

    def finish(self):
        self.stop = True


@ray.remote(num_cpus=0)
class EnvActor:
    """Steps CartPole with an epsilon-greedy numpy policy and writes n-step transitions into its
    node's server through shared memory."""

    def __init__(self, actor_id: int, handle, cfg: RunConfig, coordinator):
        self.actor_id, self.cfg, self.coordinator = actor_id, cfg, coordinator
        self.client = handle.client()
        self.path = type(self.client).__name__   # 'Client': shared memory

    def client_kind(self) -> str:
        return self.path

    def run(self) -> int:
        import gymnasium as gym
        cfg, actor_id = self.cfg, self.actor_id
        rng = np.random.default_rng(cfg.seed * 1000 + actor_id + 1)
        env = gym.make(ENV_ID)
        network = NumpyQNetwork(OBS_DIM, NUM_ACTIONS, HIDDEN)
        writer = self.client.trajectory_writer(num_keep_alive_refs=cfg.n_step + 1)
        transitions = NStepTransitionWriter(writer, TABLE, cfg.n_step, cfg.gamma)
        version, steps, returns, episode_return = 0, 0, [], 0.0
        obs, _ = env.reset(seed=cfg.seed * 1000 + actor_id)
        try:
            while True:
                if steps % cfg.actor_refresh_steps == 0:
                    self.coordinator.report.remote(actor_id, steps, returns)
                    returns = []
                    version, flat, stop = ray.get(self.coordinator.fetch.remote(version),
                                                  timeout=60)
                    if stop:
                        return steps
                    if flat is not None:
                        network.load(flat)
                epsilon = linear_epsilon(steps * cfg.actors, 1.0, cfg.epsilon_end,
                                         cfg.epsilon_decay_steps)
                obs, reward, episode_over = act_and_write(env, network, transitions, rng, obs,
                                                          epsilon)
                steps += 1
                episode_return += reward
                if episode_over:
                    returns.append(episode_return)
                    episode_return = 0.0
        except (reverb.errors.TableClosedError, reverb.errors.DeadOwnerError):
            return steps   # the job stopped the servers
        finally:
            env.close()


def learn(cfg: RunConfig, handle, coordinator) -> tuple[list, int, float]:
    import torch
    from dqn import DQNLearner, LearnerConfig

    from reverb_shm.learner import importance_weights

    torch.set_num_threads(1)
    learner = DQNLearner(OBS_DIM, NUM_ACTIONS, LearnerConfig(
        hidden=HIDDEN, learning_rate=cfg.learning_rate,
        target_update_period=cfg.target_update_period), seed=cfg.seed)
    coordinator.publish.remote(learner.flat_parameters())
    cc = handle.global_client(seed=cfg.seed)
    returns: list = []
    start = next_report = time.monotonic()
    try:
        while True:
            elapsed = time.monotonic() - start
            if time.monotonic() >= next_report:
                total_steps, new = ray.get(coordinator.progress.remote(), timeout=60)
                returns = (returns + new)[-RETURN_WINDOW:]
                mean = float(np.mean(returns)) if returns else 0.0
                print(f"[{elapsed:6.1f}s] env steps {total_steps:7d} | updates "
                      f"{learner.num_updates:6d} | mean return (last {RETURN_WINDOW}) {mean:6.1f}"
                      f" | shards {cc.live_shards}", flush=True)
                next_report += cfg.report_seconds
                if (elapsed >= cfg.max_seconds or total_steps >= cfg.max_env_steps
                        or (len(returns) == RETURN_WINDOW and mean >= cfg.stop_return)):
                    return returns, learner.num_updates, elapsed
            try:
                sample = cc.sample_batch(TABLE, cfg.batch_size, rate_limiter_timeout_ms=500)
            except reverb.DeadlineExceededError:
                continue   # a node's table is still filling (or its actor lags)
            fraction = max(elapsed / cfg.max_seconds, 0.0)
            beta = cfg.beta_start + (1.0 - cfg.beta_start) * min(1.0, fraction)
            info = sample.info
            priorities = learner.update(
                sample.data, importance_weights(info.probability, info.table_size, beta))
            cc.mutate_priorities(TABLE, updates=dict(zip(info.key.tolist(), priorities)))
            if learner.num_updates % cfg.publish_period == 0:
                coordinator.publish.remote(learner.flat_parameters())
    finally:
        cc.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", help="Ray cluster address (default: start a local one)")
    p.add_argument("--nodes", type=int, default=3, help="nodes to use (one server + actor each)")
    p.add_argument("--max-seconds", type=float, default=240.0)
    p.add_argument("--max-env-steps", type=int, default=80_000)
    p.add_argument("--min-return", type=float, default=100.0)
    p.add_argument("--checkpoint-root", help="shared directory for the servers' checkpoints")
    args = p.parse_args(argv)
    cfg = dataclasses.replace(RunConfig(), actors=args.nodes, max_seconds=args.max_seconds,
                              max_env_steps=args.max_env_steps, min_return=args.min_return,
                              min_replay_size=max(64, RunConfig().min_replay_size // args.nodes))
    local = None
    if args.address is None:
        local = LocalRayCluster(num_cpus=1, object_store_mb=80).start()
        for i in range(args.nodes - 1):
            local.add_node(f"node{i}")
        address = local.address
    else:
        address = args.address
    handle = None
    try:
        ray.init(address=address, log_to_driver=False)
        if local is not None:
            local.wait_for_nodes()
        handle = ReplayCluster.start([make_table(cfg)], nodes=args.nodes,
                                     checkpoint_root=args.checkpoint_root)
        coordinator = Coordinator.remote()
        actors = [EnvActor.options(scheduling_strategy=ray.util.scheduling_strategies
                                   .NodeAffinitySchedulingStrategy(e.node_id, soft=False))
                  .remote(i, handle, cfg, coordinator) for i, e in enumerate(handle.entries)]
        paths = ray.get([a.client_kind.remote() for a in actors], timeout=300)
        print(f"{ENV_ID}: {len(actors)} nodes, one server and one actor each; actors write "
              f"through {paths}", flush=True)
        runs = [a.run.remote() for a in actors]
        returns, updates, seconds = learn(cfg, handle, coordinator)
        ray.get(coordinator.finish.remote(), timeout=60)
        handle.stop()   # wakes actors blocked on their node's rate limiter (TableClosedError)
        try:
            steps = sum(ray.get(runs, timeout=120))
        except ray.exceptions.RayError as e:
            print(f"error: an actor failed: {e}", file=sys.stderr)
            return 2
        mean = float(np.mean(returns)) if returns else 0.0
        learnt = len(returns) == RETURN_WINDOW and mean >= cfg.min_return
        print(f"\nsummary: {seconds:.1f}s, {steps} env steps, {updates} learner updates, "
              f"mean return over the last {RETURN_WINDOW} episodes {mean:.1f} -> "
              f"{'LEARNT' if learnt else 'NOT LEARNT'}", flush=True)
        return 0 if learnt else 1
    finally:
        if handle is not None:
            handle.stop()
        if ray.is_initialized():
            ray.shutdown()
        if local is not None:
            local.shutdown()


if __name__ == "__main__":
    sys.exit(main())
