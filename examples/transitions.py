"""n-step transitions written through a Reverb trajectory writer.

Every environment step is appended once as ``{'obs', 'action', 'reward', 'discount'}``;
items reference the writer's history, so the data of a step is stored once however many
transitions use it. The item created after appending step t covers the transition that
starts at step s = t - n:

    obs      = history['obs'][s]                (squeezed: float32[obs_dim])
    action   = history['action'][s]             (squeezed: int64)
    reward   = history['reward'][s:s+n]         (float32[n])
    discount = history['discount'][s:s+n]       (float32[n])
    next_obs = history['obs'][s+n]              (squeezed: float32[obs_dim])

``discount`` is the factor applied after a step: gamma while the episode goes on and 0
after the terminal step. At the end of an episode n padding steps holding the last
observation are appended (reward 0; discount 1 after a truncation, 0 after a termination),
so the last n transitions have the same shapes, with an exact bootstrap factor of
gamma ** (steps left) for truncated episodes (see ``dqn.n_step_return``).

Initial priorities are the n-step TD errors under the actor's own network (Ape-X style).
"""
from __future__ import annotations

import collections

import numpy as np


def transition_signature(obs_dim: int, n: int) -> dict:
    """The table signature of the items written by ``NStepTransitionWriter``."""
    import reverb_shm as reverb  # imported here so the module works without the package

    return {
        "obs": reverb.TensorSpec([obs_dim], np.float32),
        "action": reverb.TensorSpec([], np.int64),
        "reward": reverb.TensorSpec([n], np.float32),
        "discount": reverb.TensorSpec([n], np.float32),
        "next_obs": reverb.TensorSpec([obs_dim], np.float32),
    }


class NStepTransitionWriter:
    """Turns environment steps into n-step transition items with TD-error priorities.

    Args:
        writer: A trajectory writer with ``num_keep_alive_refs >= n + 1``.
        table: Name of the table the items go to.
        n: Number of steps in a transition.
        gamma: Discount factor.
        priority_epsilon: Added to |TD error| so that no item gets priority 0.

    Not thread-safe.
    """

    def __init__(self, writer, table: str, n: int, gamma: float, priority_epsilon: float = 1e-3):
        self._writer = writer
        self._table = table
        self._n = n
        self._gamma = gamma
        self._epsilon = priority_epsilon
        # Per buffered step: (reward, discount, Q(obs, action), max_a Q(obs, a)).
        self._steps: collections.deque = collections.deque(maxlen=n + 1)
        self._episode_steps = 0
        self.items_created = 0

    def append(self, obs: np.ndarray, action: int, reward: float, terminated: bool,
               q_values: np.ndarray) -> None:
        """Records one step: ``action`` taken in ``obs`` gave ``reward``.

        Args:
            obs: float32[obs_dim], the observation the action was chosen in.
            action: The action taken.
            reward: The reward it produced.
            terminated: Whether the episode terminated on this step (no bootstrap).
            q_values: float32[num_actions], the actor's Q-values of ``obs``.
        """
        discount = 0.0 if terminated else self._gamma
        self._append(obs, action, reward, discount, float(q_values[action]),
                     float(q_values.max()))

    def end_episode(self, final_obs: np.ndarray, terminated: bool,
                    final_q_values: np.ndarray) -> None:
        """Pads the episode with its last observation, creates its last items, ends it."""
        pad_discount = 0.0 if terminated else 1.0
        value = float(final_q_values.max())
        for _ in range(self._n):
            self._append(final_obs, 0, 0.0, pad_discount, value, value)
        self._writer.end_episode()
        self._steps.clear()
        self._episode_steps = 0

    def _append(self, obs, action, reward, discount, q_taken, q_max) -> None:
        self._writer.append({
            "obs": np.asarray(obs, dtype=np.float32),
            "action": np.int64(action),
            "reward": np.float32(reward),
            "discount": np.float32(discount),
        })
        self._steps.append((reward, discount, q_taken, q_max))
        self._episode_steps += 1
        if self._episode_steps > self._n:
            self._create_item()

    def _create_item(self) -> None:
        n, history = self._n, self._writer.history
        window = list(self._steps)  # n + 1 steps: s .. s+n
        ret, factor = 0.0, 1.0
        for reward, discount, _, _ in window[:-1]:
            ret += factor * reward
            factor *= discount
        td_error = ret + factor * window[-1][3] - window[0][2]
        self._writer.create_item(
            table=self._table,
            priority=abs(td_error) + self._epsilon,
            trajectory={
                "obs": history["obs"][-n - 1],
                "action": history["action"][-n - 1],
                "reward": history["reward"][-n - 1:-1],
                "discount": history["discount"][-n - 1:-1],
                "next_obs": history["obs"][-1],
            },
        )
        self.items_created += 1
