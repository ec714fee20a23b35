"""Distributed DQN on CartPole-v1 with reverb_shm: N actor processes and one learner.

    python examples/actor_learner.py [--actors 2] [--max-seconds 200] [--max-env-steps 80000]

The main process starts a reverb_shm Server holding one Prioritized table (exponent 0.6,
Fifo remover, SampleToInsertRatio limiter) and spawns the actors. Each actor opens
``reverb.Client(f'localhost:{port}')``, steps gymnasium's CartPole-v1 with an epsilon-greedy
policy whose Q-network weights it refreshes from the learner, and writes 3-step transitions
through ``client.trajectory_writer`` (see transitions.py). The learner (this process) takes
fixed-shape prioritized batches as torch tensors from ``reverb_shm.torch.TorchIterator``
(a background thread samples the next batches while the learner trains), trains a double DQN
with the importance-sampling weights the iterator offers (dqn.py) and hands |TD error|
priorities back to the iterator, which applies them asynchronously.

The run ends on the first of: the environment-step budget, the wall-clock cap, or the mean
return of the last 20 episodes reaching --stop-return. It prints a summary and exits 0 if
that mean return is at least --min-return (a random policy gets about 20), 1 otherwise,
and 2 if an actor failed.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import multiprocessing as mp
import queue
import signal
import sys
import time
import warnings

import numpy as np

import reverb_shm as reverb
from policy import NumpyQNetwork, SharedWeights, linear_epsilon
from transitions import NStepTransitionWriter, transition_signature

TABLE = "priority_table"
ENV_ID = "CartPole-v1"
OBS_DIM, NUM_ACTIONS = 4, 2
HIDDEN = (128, 128)
RETURN_WINDOW = 20


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run depends on (see ``parse_args`` for the meaning of each field)."""

    actors: int = 2
    max_seconds: float = 200.0
    max_env_steps: int = 80_000
    stop_return: float = 475.0
    min_return: float = 100.0
    n_step: int = 3
    gamma: float = 0.99
    batch_size: int = 64
    samples_per_insert: float = 32.0
    min_replay_size: int = 1_000
    max_replay_size: int = 100_000
    priority_exponent: float = 0.6
    beta_start: float = 0.4
    epsilon_decay_steps: int = 10_000
    epsilon_end: float = 0.02
    learning_rate: float = 5e-4
    target_update_period: int = 250
    publish_period: int = 50
    actor_refresh_steps: int = 100
    report_seconds: float = 5.0
    seed: int = 0


def parse_args(argv=None) -> RunConfig:
    defaults = RunConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--actors", type=int, default=defaults.actors, help="actor processes")
    p.add_argument("--max-seconds", type=float, default=defaults.max_seconds,
                   help="wall-clock cap of the training phase")
    p.add_argument("--max-env-steps", type=int, default=defaults.max_env_steps,
                   help="environment steps over all actors")
    p.add_argument("--stop-return", type=float, default=defaults.stop_return,
                   help="stop early once the mean return of the last 20 episodes reaches this")
    p.add_argument("--min-return", type=float, default=defaults.min_return,
                   help="mean return (last 20 episodes) needed to exit 0")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--samples-per-insert", type=float, default=defaults.samples_per_insert,
                   help="rate limiter: times each transition is sampled on average")
    p.add_argument("--seed", type=int, default=defaults.seed)
    args = p.parse_args(argv)
    if args.actors < 1:
        p.error("--actors must be >= 1")
    return dataclasses.replace(defaults, **{
        "actors": args.actors, "max_seconds": args.max_seconds,
        "max_env_steps": args.max_env_steps, "stop_return": args.stop_return,
        "min_return": args.min_return, "batch_size": args.batch_size,
        "samples_per_insert": args.samples_per_insert, "seed": args.seed})


# ---------------------------------------------------------------------------------------
# Actor process


def act_and_write(env, network: NumpyQNetwork, transitions: NStepTransitionWriter,
                  rng: np.random.Generator, obs: np.ndarray, epsilon: float):
    """One epsilon-greedy step of ``env`` from ``obs``, recorded as n-step transitions.

    Returns:
        (the observation to act on next, the step's reward, whether the episode ended; the
        environment was then reset and the observation is the new episode's first).
    """
    q_values = network.q_values(obs)
    if rng.random() < epsilon:
        action = int(rng.integers(NUM_ACTIONS))
    else:
        action = int(q_values.argmax())
    next_obs, reward, terminated, truncated, _ = env.step(action)
    transitions.append(obs, action, reward, terminated, q_values)
    if terminated or truncated:
        transitions.end_episode(next_obs, terminated, network.q_values(next_obs))
        next_obs, _ = env.reset()
        return next_obs, reward, True
    return next_obs, reward, False


def run_actor(actor_id: int, address: str, cfg: RunConfig, weights: SharedWeights,
              env_steps, returns: mp.Queue, stop: mp.Event) -> None:
    """Steps the environment and writes n-step transitions until ``stop`` is set.

    Args:
        actor_id: Index of this actor (seeds its environment and random numbers).
        address: The server address, 'localhost:PORT'.
        cfg: Run configuration.
        weights: The learner's published Q-network parameters.
        env_steps: Shared int64 array, one slot per actor, counting environment steps.
        returns: Queue receiving the return of every finished episode.
        stop: Set by the main process when the run is over.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
    import gymnasium as gym

    rng = np.random.default_rng(cfg.seed * 1000 + actor_id + 1)
    env = gym.make(ENV_ID)
    network = NumpyQNetwork(OBS_DIM, NUM_ACTIONS, HIDDEN)
    version = 0
    client = reverb.Client(address)
    writer = client.trajectory_writer(num_keep_alive_refs=cfg.n_step + 1)
    transitions = NStepTransitionWriter(writer, TABLE, cfg.n_step, cfg.gamma)
    steps = 0
    try:
        obs, _ = env.reset(seed=cfg.seed * 1000 + actor_id)
        episode_return = 0.0
        while not stop.is_set():
            if steps % cfg.actor_refresh_steps == 0:
                version, flat = weights.fetch(version)
                if flat is not None:
                    network.load(flat)
            epsilon = linear_epsilon(sum(env_steps), 1.0, cfg.epsilon_end,
                                     cfg.epsilon_decay_steps)
            obs, reward, episode_over = act_and_write(env, network, transitions, rng, obs,
                                                      epsilon)
            steps += 1
            env_steps[actor_id] = steps
            episode_return += reward
            if episode_over:
                returns.put(episode_return)
                episode_return = 0.0
    except Exception:
        if not stop.is_set():
            raise
        # The server stopped while this actor was blocked on the rate limiter: done.
    finally:
        with warnings.catch_warnings():
            # Items still waiting for the rate limiter when the server stopped are dropped.
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                writer.close()
            except Exception:  # the server is gone: nothing left to flush to
                pass
        env.close()


# ---------------------------------------------------------------------------------------
# Learner (main process)


class Progress:
    """Episode returns and throughput figures for the periodic report."""

    def __init__(self, client: reverb.Client):
        self._client = client
        self.returns: collections.deque = collections.deque(maxlen=RETURN_WINDOW)
        self.episodes = 0
        self.best_mean = float("-inf")
        self._last = (time.monotonic(), 0, 0)

    def drain(self, returns: mp.Queue) -> None:
        while True:
            try:
                self.returns.append(returns.get_nowait())
            except queue.Empty:
                return
            self.episodes += 1
            if len(self.returns) == RETURN_WINDOW:
                self.best_mean = max(self.best_mean, self.mean_return())

    def mean_return(self) -> float:
        return float(np.mean(self.returns)) if self.returns else 0.0

    def counters(self) -> tuple[int, int]:
        """(inserts, samples) completed on the table so far."""
        limiter = self._client.server_info()[TABLE].rate_limiter_info
        return limiter.insert_stats.completed, limiter.sample_stats.completed

    def report(self, elapsed: float, env_steps: int, updates: int) -> None:
        now = time.monotonic()
        inserts, samples = self.counters()
        then, last_inserts, last_samples = self._last
        dt = max(now - then, 1e-9)
        self._last = (now, inserts, samples)
        print(f"[{elapsed:6.1f}s] env steps {env_steps:7d} | episodes {self.episodes:5d} | "
              f"inserts/s {(inserts - last_inserts) / dt:7.0f} | "
              f"samples/s {(samples - last_samples) / dt:8.0f} | updates {updates:6d} | "
              f"mean return (last {RETURN_WINDOW}) {self.mean_return():6.1f}", flush=True)


def make_table(cfg: RunConfig) -> reverb.Table:
    limiter = reverb.rate_limiters.SampleToInsertRatio(
        samples_per_insert=cfg.samples_per_insert,
        min_size_to_sample=cfg.min_replay_size,
        error_buffer=cfg.samples_per_insert * cfg.batch_size * 4)
    return reverb.Table(
        name=TABLE,
        sampler=reverb.selectors.Prioritized(cfg.priority_exponent),
        remover=reverb.selectors.Fifo(),
        max_size=cfg.max_replay_size,
        rate_limiter=limiter,
        signature=transition_signature(OBS_DIM, cfg.n_step))


def train(cfg: RunConfig, client: reverb.Client, weights: SharedWeights, env_steps,
          returns: mp.Queue, actors: list) -> tuple[Progress, int, float]:
    """Runs the learner until a stopping condition; returns (progress, updates, seconds)."""
    import torch

    from dqn import DQNLearner, LearnerConfig
    from reverb_shm.torch import TorchIterator

    torch.set_num_threads(1)
    learner = DQNLearner(OBS_DIM, NUM_ACTIONS, LearnerConfig(
        hidden=HIDDEN, learning_rate=cfg.learning_rate,
        target_update_period=cfg.target_update_period), seed=cfg.seed)
    weights.publish(learner.flat_parameters())
    progress = Progress(client)
    start = time.monotonic()
    next_report = start + cfg.report_seconds
    # Batches of exactly batch_size transitions, sampled ahead by a background thread; a batch's
    # tensors view a ring buffer that is reused once the next batch is taken (keep=1).
    with TorchIterator(client, TABLE, cfg.batch_size, prefetch=2, timeout_ms=500,
                       importance_beta=cfg.beta_start, seed=cfg.seed) as batches:
        return _train_loop(cfg, learner, batches, weights, env_steps, returns, actors, progress,
                           start, next_report)


def _train_loop(cfg: RunConfig, learner, batches, weights: SharedWeights, env_steps,
                returns: mp.Queue, actors: list, progress: "Progress", start: float,
                next_report: float) -> tuple[Progress, int, float]:
    while True:
        elapsed = time.monotonic() - start
        total_steps = sum(env_steps)
        progress.drain(returns)
        if time.monotonic() >= next_report:
            progress.report(elapsed, total_steps, learner.num_updates)
            next_report += cfg.report_seconds
        if (elapsed >= cfg.max_seconds or total_steps >= cfg.max_env_steps
                or (len(progress.returns) == RETURN_WINDOW
                    and progress.mean_return() >= cfg.stop_return)):
            return progress, learner.num_updates, elapsed
        dead = [p for p in actors if not p.is_alive()]
        if dead:
            raise RuntimeError(f"actor process {dead[0].name} exited with code "
                               f"{dead[0].exitcode}")
        try:
            batch = next(batches)
        except reverb.DeadlineExceededError:
            continue  # not enough data yet (or actors lagging): re-check the loop conditions
        fraction = max(elapsed / cfg.max_seconds, total_steps / cfg.max_env_steps)
        # (batches gathered from now on get weights with the annealed beta)
        batches.importance_beta = cfg.beta_start + (1.0 - cfg.beta_start) * min(1.0, fraction)
        priorities = learner.update(batch.data, batch.weights)
        # Keys stay numpy uint64 (Reverb's are uint64; half of them do not fit an int64).
        batches.update_priorities(batch.info.key, priorities)
        if learner.num_updates % cfg.publish_period == 0:
            weights.publish(learner.flat_parameters())


def stop_actors(actors: list, returns: mp.Queue, timeout: float = 15.0) -> None:
    """Joins the actors, draining the return queue so their feeder threads can exit."""
    deadline = time.monotonic() + timeout
    for proc in actors:
        while proc.is_alive() and time.monotonic() < deadline:
            proc.join(0.1)
            while True:
                try:
                    returns.get_nowait()
                except queue.Empty:
                    break
        if proc.is_alive():
            print(f"actor {proc.name} did not stop in {timeout:.0f}s: terminating it",
                  file=sys.stderr)
            proc.terminate()
            proc.join(5.0)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    ctx = mp.get_context("spawn")
    weights = SharedWeights(NumpyQNetwork(OBS_DIM, NUM_ACTIONS, HIDDEN).num_parameters, ctx)
    env_steps = ctx.Array("q", cfg.actors, lock=False)
    returns = ctx.Queue()
    stop = ctx.Event()
    actors: list = []
    failed = interrupted = False
    print(f"{ENV_ID}: {cfg.actors} actors, batch {cfg.batch_size}, "
          f"{cfg.samples_per_insert:g} samples per insert, caps {cfg.max_seconds:g}s / "
          f"{cfg.max_env_steps} env steps", flush=True)
    with reverb.Server(tables=[make_table(cfg)]) as server:
        address = f"localhost:{server.port}"
        client = reverb.Client(address)
        try:
            for i in range(cfg.actors):
                proc = ctx.Process(target=run_actor, name=f"actor-{i}",
                                   args=(i, address, cfg, weights, env_steps, returns, stop))
                proc.start()
                actors.append(proc)
            progress, updates, seconds = train(cfg, client, weights, env_steps, returns, actors)
            inserts, samples = progress.counters()
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            interrupted = True
        finally:
            stop.set()
            server.stop()  # wakes actors blocked on the rate limiter
            stop_actors(actors, returns)
    if failed:
        return 2
    if interrupted:
        return 130
    total_steps = sum(env_steps)
    mean = progress.mean_return()
    learnt = len(progress.returns) == RETURN_WINDOW and mean >= cfg.min_return
    print(f"\nsummary: {seconds:.1f}s, {total_steps} env steps ({total_steps / seconds:.0f}/s), "
          f"{progress.episodes} episodes, {updates} learner updates\n"
          f"  table: {inserts} inserts ({inserts / seconds:.0f}/s), "
          f"{samples} samples ({samples / seconds:.0f}/s)\n"
          f"  mean return over the last {RETURN_WINDOW} episodes: {mean:.1f} "
          f"(best {progress.best_mean:.1f}; random policy ~20; needed {cfg.min_return:g}) -> "
          f"{'LEARNT' if learnt else 'NOT LEARNT'}", flush=True)
    return 0 if learnt else 1


if __name__ == "__main__":
    sys.exit(main())
