"""Actor-side policy: the Q-network in numpy, epsilon-greedy actions, shared weights.

Actors evaluate one observation at a time, where numpy beats torch's per-call overhead, so
actor processes never load torch. The learner publishes its parameters into a
``SharedWeights`` buffer; actors copy them out when the version changes.
"""
from __future__ import annotations

import multiprocessing as mp
from typing import Sequence

import numpy as np


class NumpyQNetwork:
    """The MLP of ``dqn.build_q_network`` evaluated in numpy.

    Args:
        obs_dim: Size of an observation vector.
        num_actions: Number of discrete actions.
        hidden: Hidden layer sizes (same as the learner's).

    Not thread-safe.
    """

    def __init__(self, obs_dim: int, num_actions: int, hidden: Sequence[int]):
        sizes = [obs_dim, *hidden, num_actions]
        self._shapes = [(n_out, n_in) for n_in, n_out in zip(sizes[:-1], sizes[1:])]
        self.num_parameters = sum(n_out * n_in + n_out for n_out, n_in in self._shapes)
        self._layers: list[tuple[np.ndarray, np.ndarray]] = []
        self.load(np.zeros(self.num_parameters, np.float32))

    def load(self, flat: np.ndarray) -> None:
        """Sets the parameters from a float32[num_parameters] vector laid out like
        ``torch.nn.utils.parameters_to_vector`` (per layer: weight (out, in), then bias).

        Raises:
            ValueError: if the vector has the wrong size.
        """
        if flat.shape != (self.num_parameters,):
            raise ValueError(f"expected {self.num_parameters} parameters, got shape {flat.shape}")
        layers, pos = [], 0
        for n_out, n_in in self._shapes:
            weight = flat[pos:pos + n_out * n_in].reshape(n_out, n_in).T.copy()
            pos += n_out * n_in
            bias = flat[pos:pos + n_out].copy()
            pos += n_out
            layers.append((weight, bias))
        self._layers = layers

    def q_values(self, obs: np.ndarray) -> np.ndarray:
        """Returns float32[num_actions] Q-values of one observation float32[obs_dim]."""
        x = np.asarray(obs, dtype=np.float32)
        for weight, bias in self._layers[:-1]:
            x = np.maximum(x @ weight + bias, 0.0)
        weight, bias = self._layers[-1]
        return x @ weight + bias


def linear_epsilon(step: int, start: float, end: float, decay_steps: int) -> float:
    """Epsilon decayed linearly from ``start`` to ``end`` over ``decay_steps`` steps."""
    fraction = min(1.0, step / max(1, decay_steps))
    return start + fraction * (end - start)


class SharedWeights:
    """A float32 parameter vector in shared memory with a version counter.

    The buffer is a ``multiprocessing.Array`` (an anonymous mapping, nothing to clean up
    in /dev/shm); pass the object to child processes as a ``Process`` argument. Readers and
    the writer synchronise on the array's lock, so a reader never sees a half-written vector.

    Args:
        size: Number of parameters.
        ctx: The multiprocessing context the child processes are started with.
    """

    def __init__(self, size: int, ctx: mp.context.BaseContext):
        self._array = ctx.Array("f", size)
        self._version = ctx.Value("q", 0, lock=False)

    def publish(self, flat: np.ndarray) -> None:
        """Writes a new parameter vector (float32[size]) and bumps the version."""
        with self._array.get_lock():
            np.frombuffer(self._array.get_obj(), dtype=np.float32)[:] = flat
            self._version.value += 1

    def fetch(self, known_version: int) -> tuple[int, np.ndarray | None]:
        """Returns (version, copy of the vector), or (known_version, None) if unchanged."""
        with self._array.get_lock():
            version = self._version.value
            if version == known_version:
                return known_version, None
            return version, np.frombuffer(self._array.get_obj(), dtype=np.float32).copy()
