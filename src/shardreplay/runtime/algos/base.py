"""The algorithm interface: what ``shardreplay train`` needs of an algorithm (its action
space and Spec, an :class:`Agent` per learner rank, an :class:`ActorPolicy` built from the
published weights, ``greedy`` for evaluation; docs/train.md, "Algorithms")."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from shardreplay.errors import ConfigError, ShardReplayError
from shardreplay.policy.broadcast import FINISHED
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.envs import EnvInfo, transition_spec
from shardreplay.runtime.settings import ALGOS, TrainSettings
from shardreplay.spec import Field, Spec

if TYPE_CHECKING:  # torch only types these: an actor that acts without torch never imports it
    import torch
    from torch import nn

    from shardreplay.buffer.batch import Batch
    from shardreplay.runtime.devices import Placement

__all__ = ["ACTIONS", "ActorPolicy", "Agent", "Algorithm", "ApexExploration", "apex_epsilons", "check_fits",
           "explore", "known_algo", "mlp_hidden", "network_weights", "published_hidden", "spec_of", "warmup"]


# --algo name -> the action space it takes (describe_env's ``actions``)
ACTIONS = {"dqn": "discrete", "sac": "box", "r2d2": "discrete"}


def known_algo(name: str) -> None:
    """Refuse an ``--algo`` name that is not one of ours.

    Raises:
        ConfigError: an unknown name.
    """
    if name not in ACTIONS:
        raise ConfigError(f"--algo must be one of {', '.join(ALGOS)}, got {name!r}")


def spec_of(name: str, env: EnvInfo, hidden: tuple[int, ...] = ()) -> Spec:
    """The transition Spec actors of ``--algo name`` write for ``env``, built without torch
    (the launcher sizes the local rings with it): obs, action and reward; r2d2's adds the
    actor's LSTM state ``h``, ``c`` (float32, ``--hidden``'s last size), written at each
    step and kept by the buffer at the sequence starts only (``at_starts``:
    docs/semantics.md, "Start-state fields").

    Raises:
        ConfigError: an unknown name; for r2d2, no ``hidden`` size or images (the LSTM
            takes flat vectors).
    """
    known_algo(name)
    if name != "r2d2":
        return transition_spec(env)
    if not hidden:
        raise ConfigError("--algo r2d2 needs --hidden (its last size is the LSTM's)")
    if len(env.obs_shape) != 1:
        raise ConfigError(f"--algo r2d2 takes flat vector observations, got shape {list(env.obs_shape)}")
    state = Field((int(hidden[-1]),), np.float32, at_starts=True)
    return Spec({**transition_spec(env).fields, "h": state, "c": state})


class Agent(Protocol):
    """One learner rank's learning state (all ranks hold the same, kept in step)."""

    updates: int

    @property
    def module(self) -> nn.Module:
        """The network actors act with (published) and evaluation runs, without DDP."""
        ...

    def learn(self, batch: Batch) -> tuple[torch.Tensor, float]:
        """One update on ``batch`` (a collective when ranks > 1); returns the new
        priorities ``[B]`` and the loss."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (networks, targets, optimizers, counts)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        ...


class ActorPolicy(Protocol):
    """What an actor acts with: the published network and its exploration (the recurrent
    state's methods default to a feed-forward policy's: no state, nothing stored)."""

    def load(self, weights: Mapping[str, Any]) -> None:
        """Take newly published weights."""
        ...

    def initial_state(self, num_envs: int) -> Any:
        """The recurrent state at the start (None: a feed-forward policy)."""
        return None

    def act(self, obs: np.ndarray, state: Any, run_steps: int) -> tuple[np.ndarray, Any]:
        """Actions for observations ``[num_envs, ...]`` and the next state;
        ``run_steps``: the run's environment steps so far (for warm-up schedules)."""
        ...

    def end_episodes(self, state: Any, starting: np.ndarray) -> Any:
        """``state`` with the rows of envs whose next observation starts an episode
        (bool ``[num_envs]``) reset."""
        return None

    def stored(self, state: Any) -> dict[str, np.ndarray]:
        """The spec fields (``[num_envs, ...]``, copies) written with the steps acted
        from ``state``: ``{}`` for a policy that stores no recurrent state."""
        return {}


class Algorithm(Protocol):
    """An algorithm of ``shardreplay train``."""

    name: str
    actions: str  # "discrete" or "box": the action space it takes (EnvInfo)
    policy_key: str  # the learner state's entry holding the published module's weights

    def policy_network(self, env: EnvInfo, network: str, hidden: tuple[int, ...]) -> nn.Module:
        """The published module (what :attr:`Agent.module` is), untrained, for ``env``
        with ``--network`` and ``--hidden``: what a policy file's weights are loaded into.

        Raises:
            ConfigError: a network this algorithm cannot build for ``env``.
        """
        ...

    def transition_spec(self, env: EnvInfo, hidden: tuple[int, ...] = ()) -> Spec:
        """The Spec actors write and the shards store (``hidden``: the run's
        ``--hidden``, which sizes a recurrent state): :func:`~.spec_of`.

        Raises:
            ConfigError: a Spec the algorithm refuses for ``env``.
        """
        return spec_of(self.name, env, hidden)

    def make_agent(self, env: EnvInfo, settings: TrainSettings, world: int,
                   placement: Placement | None = None) -> Agent:
        """The learner state of one rank of ``world`` (a collective when ``world`` > 1:
        every rank starts from rank 0's weights), on the placement's device, its gradients
        all-reduced over the placement's group (None: the CPU and the default group).

        Raises:
            ConfigError: settings or an environment the algorithm cannot take.
        """
        ...

    def make_policy(self, weights: Mapping[str, Any], env: EnvInfo, s: ActorSettings) -> ActorPolicy:
        """The policy of actor ``s``, holding the published ``weights``, on ``s.device``.

        Raises:
            ConfigError: the weights are not this algorithm's network for ``env``.
        """
        ...

    def greedy(self, module: nn.Module) -> Any:
        """A function from observations ``[B, ...]`` (a tensor) to the evaluation's
        deterministic actions (numpy) of the published ``module``."""
        ...


def warmup(eps: np.ndarray, run_steps: int, warmup_steps: int) -> np.ndarray:
    """Exploration during warm-up: from 1 down to ``eps`` over ``warmup_steps``."""
    if warmup_steps <= 0 or run_steps >= warmup_steps:
        return eps
    return np.maximum(eps, 1.0 - run_steps / warmup_steps)


def apex_epsilons(num_streams: int, first: int, total: int, base: float = 0.4,
                  exponent: float = 7.0) -> np.ndarray:
    """Ape-X exploration rates ``base^(1 + exponent * i / (total - 1))`` for global
    streams ``first .. first + num_streams - 1`` of ``total`` (one stream: ``base``)."""
    i = np.arange(first, first + num_streams, dtype=np.float64)
    frac = i / (total - 1) if total > 1 else np.zeros_like(i)
    return base ** (1.0 + exponent * frac)


def explore(greedy: np.ndarray, num_actions: int, epsilons: np.ndarray,
            rng: np.random.Generator) -> np.ndarray:
    """``greedy`` actions (int ``[B]``, replaced in place and returned), each replaced by a
    uniform random one of ``num_actions`` with probability ``epsilons[i]``: one
    ``rng.random(B)``, then one ``rng.integers`` for the replaced ones."""
    chosen = rng.random(greedy.shape[0]) < epsilons
    greedy[chosen] = rng.integers(0, num_actions, size=int(chosen.sum()))
    return greedy


class ApexExploration:
    """The epsilon-greedy exploration of the streams of actor ``s`` (resolved settings):
    stream ``i`` of ``N`` acts greedily except with probability ``base^(1 + exponent
    i/(N-1))`` (from 1 during the warm-up), drawn from a generator seeded by the actor's seed.

    Raises:
        ShardReplayError: settings not resolved (no ``envs_per_actor`` or ``num_actors``).
    """

    def __init__(self, s: ActorSettings) -> None:
        if s.envs_per_actor is None or s.num_actors is None:
            raise ShardReplayError(f"actor {s.actor_id}: envs_per_actor and num_actors must be resolved "
                              "before a policy is made (a bug in the caller)")
        self.rng = np.random.default_rng(s.seed)
        self.eps = apex_epsilons(s.envs_per_actor, s.actor_id * s.envs_per_actor,
                                 s.num_actors * s.envs_per_actor, s.epsilon_base or 0.4,
                                 s.epsilon_exponent if s.epsilon_exponent is not None else 7.0)
        self.warmup_steps = s.epsilon_warmup_steps or 0

    def actions(self, greedy: np.ndarray, num_actions: int, run_steps: int) -> np.ndarray:
        """``greedy`` (replaced in place) explored with each stream's epsilon at ``run_steps``
        (the run's environment steps so far)."""
        return explore(greedy, num_actions, warmup(self.eps, run_steps, self.warmup_steps), self.rng)


RECURRENT_KEY = "lstm.weight_hh_l0"  # a recurrent policy's LSTM weights [4H, H] (R2D2)


def published_hidden(weights: Mapping[str, Any], default: tuple[int, ...]) -> tuple[int, ...]:
    """The ``--hidden`` an actor sizes the spec by: a published recurrent policy's LSTM
    size ``(H,)`` (a remote actor does not know the learners' ``--hidden``), else
    ``default``."""
    w = weights.get(RECURRENT_KEY)
    return (int(w.shape[1]),) if w is not None and len(w.shape) == 2 else tuple(default)


def network_weights(weights: Mapping[str, Any]) -> dict[str, Any]:
    """A published policy's tensors, without the run's ``FINISHED`` flag beside them."""
    return {k: v for k, v in weights.items() if k != FINISHED}


def check_fits(net: nn.Module, weights: Mapping[str, Any], s: ActorSettings, env: EnvInfo, what: str,
               hint: str, ok: bool = True) -> None:
    """Refuse published ``weights`` without exactly ``net``'s tensor names and shapes (or
    ``ok`` False).

    Raises:
        ConfigError: naming the policy URL, ``what`` the network is and the learners' flags
            to check (``hint``).
    """
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    if not ok or shapes != {k: tuple(v.shape) for k, v in network_weights(weights).items()}:
        actions = f"actions {list(env.action_shape)}" if env.continuous else f"{env.num_actions} actions"
        raise ConfigError(f"the policy at {s.policy_url} is not {what} for {s.env_id} (observations "
                          f"{list(env.obs_shape)}, {actions}): do the learners train the same --env-id "
                          f"{hint}?")


def mlp_hidden(weights: Mapping[str, Any], obs_size: int, num_actions: int,
               s: ActorSettings) -> tuple[int, ...]:
    """The hidden sizes of a published MLP Q-network (its Linear weights ``net.<i>.weight``).

    Raises:
        ConfigError: the weights are not a Q-network for this environment.
    """
    layers = sorted((int(k.split(".")[1]), tuple(v.shape)) for k, v in weights.items()
                    if k.startswith("net.") and k.endswith(".weight") and len(v.shape) == 2)
    shapes = [shape for _i, shape in layers]
    if not shapes or shapes[0][1] != obs_size or shapes[-1][0] != num_actions:
        raise ConfigError(f"the policy at {s.policy_url} (layers {shapes}) is not a Q-network for "
                          f"{s.env_id} ({obs_size} observations, {num_actions} actions): do the learners "
                          "train the same --env-id?")
    hidden = tuple(int(out) for out, _in in shapes[:-1])
    if hidden != tuple(s.hidden):
        logging.getLogger("shardreplay.actor").info("actor %d: hidden sizes %s from the published policy",
                                                    s.actor_id, hidden)
    return hidden
