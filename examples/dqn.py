"""Double DQN learner with prioritized replay (torch, CPU).

The learner side of ``actor_learner.py``: a small MLP Q-network, a target network, n-step
double-DQN targets and the importance-sampling correction of prioritized replay (Schaul et
al. 2016, "Prioritized Experience Replay"). Actors never import this module (they run the
network in numpy, see ``policy.py``), so only the learner process loads torch.

A batch of n-step transitions is a dict of tensors (or numpy arrays) with leading dimension B,
as ``reverb_shm.torch.TorchIterator`` delivers them:
``obs`` float32[B, obs_dim], ``action`` int64[B], ``reward`` float32[B, n],
``discount`` float32[B, n] and ``next_obs`` float32[B, obs_dim]. ``discount[:, k]`` is the
factor applied after step k: the discount factor while the episode goes on, 0 when it
terminated, 1 on padding steps after a truncation (so that the bootstrap factor is exactly
gamma ** steps_taken).

Not thread-safe: one learner per thread.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """Hyperparameters of the learner.

    Attributes:
        hidden: Sizes of the hidden layers of the Q-network.
        learning_rate: Adam step size.
        target_update_period: Learner updates between hard copies of the online network
            into the target network.
        max_grad_norm: Gradient norm clip.
        priority_epsilon: Added to |TD error| so that no transition gets priority 0.
    """

    hidden: tuple[int, ...] = (128, 128)
    learning_rate: float = 5e-4
    target_update_period: int = 250
    max_grad_norm: float = 10.0
    priority_epsilon: float = 1e-3


def build_q_network(obs_dim: int, num_actions: int, hidden: Sequence[int]) -> nn.Sequential:
    """Returns an MLP mapping float32[B, obs_dim] to Q-values float32[B, num_actions].

    Layers alternate ``nn.Linear`` and ``nn.ReLU``; ``policy.NumpyQNetwork`` mirrors this
    layout from the flat parameter vector.
    """
    layers: list[nn.Module] = []
    size = obs_dim
    for width in hidden:
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    layers.append(nn.Linear(size, num_actions))
    return nn.Sequential(*layers)


def n_step_return(reward: torch.Tensor,
                  discount: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted n-step reward sum and bootstrap factor.

    Args:
        reward: float32[B, n], rewards r_0 .. r_{n-1}.
        discount: float32[B, n], the factor applied after each step (see module doc).

    Returns:
        (returns float32[B], bootstrap float32[B]) where
        returns = sum_k (prod_{j<k} discount_j) * reward_k and bootstrap = prod_j discount_j.
    """
    cumulative = torch.cumprod(discount, dim=1)
    before = torch.cat([torch.ones_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)
    return (before * reward).sum(dim=1), cumulative[:, -1]


class DQNLearner:
    """Double DQN with a target network, n-step targets and prioritized-replay weights.

    Args:
        obs_dim: Size of an observation vector.
        num_actions: Number of discrete actions.
        config: Hyperparameters.
        seed: Seed of the network initialisation.
    """

    def __init__(self, obs_dim: int, num_actions: int, config: LearnerConfig = LearnerConfig(),
                 seed: int = 0):
        torch.manual_seed(seed)
        self.config = config
        self.online = build_q_network(obs_dim, num_actions, config.hidden)
        self.target = build_q_network(obs_dim, num_actions, config.hidden)
        self.target.load_state_dict(self.online.state_dict())
        self.target.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=config.learning_rate)
        self.num_updates = 0

    def flat_parameters(self) -> np.ndarray:
        """Online network parameters as one float32 vector (layer by layer: weight, bias)."""
        with torch.no_grad():
            return torch.nn.utils.parameters_to_vector(self.online.parameters()).numpy()

    def update(self, batch: Mapping[str, torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
        """One gradient step on a batch of n-step transitions.

        Args:
            batch: n-step transitions with leading dimension B (see module doc), tensors or
                numpy arrays.
            weights: float32[B] importance-sampling weights (Schaul et al. 2016), e.g.
                ``Batch.weights`` of the iterator.

        Returns:
            float32[B] new priorities: |TD error| + priority_epsilon.
        """
        obs = torch.as_tensor(batch["obs"], dtype=torch.float32)
        next_obs = torch.as_tensor(batch["next_obs"], dtype=torch.float32)
        action = torch.as_tensor(batch["action"], dtype=torch.int64)
        reward = torch.as_tensor(batch["reward"], dtype=torch.float32)
        discount = torch.as_tensor(batch["discount"], dtype=torch.float32)

        returns, bootstrap = n_step_return(reward, discount)
        with torch.no_grad():
            best_next = self.online(next_obs).argmax(dim=1, keepdim=True)
            next_value = self.target(next_obs).gather(1, best_next).squeeze(1)
            target = returns + bootstrap * next_value
        q = self.online(obs).gather(1, action.unsqueeze(1)).squeeze(1)
        td_error = target - q
        loss = (torch.as_tensor(weights, dtype=torch.float32)
                * nn.functional.smooth_l1_loss(q, target, reduction="none")).mean()

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.online.parameters(), self.config.max_grad_norm)
        self.optimizer.step()

        self.num_updates += 1
        if self.num_updates % self.config.target_update_period == 0:
            self.target.load_state_dict(self.online.state_dict())
        return td_error.detach().abs() + self.config.priority_epsilon
