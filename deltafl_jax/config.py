"""The frozen configuration of one experiment, validated once, with one-line error messages.

The runner (experiments/run.py) builds an :class:`ExperimentConfig` from its flags; the library
never reads flags. Every check names the flag at fault, so the runner can print the message as
it is and exit with code 2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

from deltafl_jax.datasets import DataConfig

PAPER_THETAS = (1.0, 0.8, 0.5, 0.1)
PERCENTILES = (10, 20, 50, 60, 80, 90, 95)


class ConfigError(ValueError):
    """A bad setting; the message is one line naming the flag."""


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """One experiment: a dataset, a model, an algorithm and the replicas to train.

    Replicas are every (sweep value, seed) pair. For Delta-FL the swept value is theta
    (``thetas``); for the baselines it is their own hyper-parameter (``fedprox_mu``,
    ``qffl_q``, ``afl_lambda_lr``, ``term_t``, ``fedavg_sub_clients``; () = the defaults of
    :mod:`deltafl_jax.algorithms.registry`). Each list is read only by its algorithm.
    """

    data: DataConfig
    model: str = "linear"
    algorithm: str = "deltafl"
    filter: str = "exact"
    thetas: Tuple[float, ...] = ()  # () = the algorithm's default
    seeds: Tuple[int, ...] = (1,)
    num_rounds: int = 100
    clients_per_round: int = 10
    local_epochs: int = 1
    local_steps: Optional[int] = None
    batch_size: int = 10
    learning_rate: float = 0.1
    lr_decay: float = 1.0
    lr_decay_every: int = 0
    l2_reg: float = 0.0
    eval_every: int = 10
    clients_per_step: Optional[int] = None  # None = the backend's default
    eval_chunk: Optional[int] = None        # None = chosen from the model
    output_dir: Optional[str] = None
    overwrite: bool = False
    # Baselines (issue 4): the values each one sweeps (() = its default grid).
    fedavg_sub_clients: Tuple[int, ...] = ()
    fedprox_mu: Tuple[float, ...] = ()
    qffl_q: Tuple[float, ...] = ()
    afl_lambda_lr: Tuple[float, ...] = ()
    term_t: Tuple[float, ...] = ()
    conv_impl: Optional[str] = None
    save_models: bool = True
    verbose: bool = True

    def __post_init__(self):
        _check(self)


def _finite(name, value):
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"--{name} must be a finite number, got {value!r}")


def _check(c: ExperimentConfig):
    for name in ("learning_rate", "lr_decay", "l2_reg"):
        _finite(name, getattr(c, name))
    if c.learning_rate <= 0:
        raise ConfigError(f"--learning_rate must be positive, got {c.learning_rate}")
    if c.batch_size < 1:
        raise ConfigError(f"--batch_size must be a positive integer, got {c.batch_size}")
    if c.num_rounds < 1:
        raise ConfigError(f"--num_rounds must be at least 1, got {c.num_rounds}")
    if c.clients_per_round < 1:
        raise ConfigError(f"--clients_per_round must be at least 1, got {c.clients_per_round}")
    if c.local_steps is None and c.local_epochs < 1:
        raise ConfigError(f"--local_epochs must be at least 1, got {c.local_epochs}")
    if c.local_steps is not None and c.local_steps < 1:
        raise ConfigError(f"--local_steps must be at least 1, got {c.local_steps}")
    if c.lr_decay < 1:
        raise ConfigError(
            f"--lr_decay is the divisor c >= 1 of lr_t = lr * c^-(t // lr_decay_every), got "
            f"{c.lr_decay} (to halve the rate pass 2)")
    if c.lr_decay_every < 0:
        raise ConfigError(f"--lr_decay_every must be >= 0 (0: constant), got {c.lr_decay_every}")
    if c.l2_reg < 0:
        raise ConfigError(f"--l2_reg must be >= 0, got {c.l2_reg}")
    if c.eval_every < 1:
        raise ConfigError(f"--eval_every must be at least 1, got {c.eval_every}")
    if c.clients_per_step is not None and c.clients_per_step < 1:
        raise ConfigError(f"--clients_per_step must be at least 1, got {c.clients_per_step}")
    if c.eval_chunk is not None and c.eval_chunk < 1:
        raise ConfigError(f"--eval_chunk must be at least 1, got {c.eval_chunk}")
    if not c.seeds:
        raise ConfigError("--seeds must list at least one seed")
    if len(set(c.seeds)) != len(c.seeds):
        raise ConfigError(f"--seeds lists a seed twice: {list(c.seeds)}")
    for s in c.seeds:
        if not isinstance(s, int) or s < 0 or s >= 2 ** 31:
            raise ConfigError(f"--seeds must be integers in [0, 2^31), got {s!r}")
    for t in c.thetas:
        if not isinstance(t, (int, float)) or not (0.0 < t <= 1.0):
            raise ConfigError(f"--thetas must lie in (0, 1], got {t!r}")
    if len(set(c.thetas)) != len(c.thetas):
        raise ConfigError(f"--thetas lists a value twice: {list(c.thetas)}")
    _check_sweep("fedprox_mu", c.fedprox_mu, lambda v: v >= 0, "must be >= 0")
    _check_sweep("qffl_q", c.qffl_q, lambda v: v >= 0, "must be >= 0")
    _check_sweep("afl_lambda_lr", c.afl_lambda_lr, lambda v: v >= 0, "must be >= 0")
    _check_sweep("term_t", c.term_t, lambda v: True, "")
    for k in c.fedavg_sub_clients:
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= c.clients_per_round:
            raise ConfigError(f"--fedavg_sub_clients must be integers in [1, "
                              f"--clients_per_round={c.clients_per_round}], got {k!r}")
    if len(set(c.fedavg_sub_clients)) != len(c.fedavg_sub_clients):
        raise ConfigError(f"--fedavg_sub_clients lists a value twice: "
                          f"{list(c.fedavg_sub_clients)}")
    from deltafl_jax.algorithms import registry
    registry.check(c)
    if not c.output_dir and c.save_models:
        raise ConfigError("--output_dir is required")


def _check_sweep(name, values, ok, requirement):
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"--{name} must be finite numbers, got {v!r}")
        if not ok(v):
            raise ConfigError(f"--{name} {requirement}, got {v!r}")
    if len(set(values)) != len(values):
        raise ConfigError(f"--{name} lists a value twice: {list(values)}")


def learning_rate_schedule(lr: float, decay: float, every: int):
    """gamma_t = gamma_0 * c^-(t // t0) (paper, App. C.2.2, with c the divisor), built from
    optax schedules; constant when c = 1 or t0 = 0."""
    import optax

    if decay == 1.0 or every <= 0:
        return optax.constant_schedule(lr)
    return optax.exponential_decay(init_value=lr, transition_steps=every,
                                   decay_rate=1.0 / decay, staircase=True)
