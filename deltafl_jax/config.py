"""The frozen configuration of one experiment, validated once, with one-line error messages.

The command line (``experiments/cli.py``) builds an :class:`ExperimentConfig` from its flags;
the library never reads flags. Every check names the flag at fault, so a command can print the
message as it is and exit with code 2. The algorithm-specific checks live in each algorithm's
spec (:mod:`deltafl_jax.algorithms`), which this module calls through the registry.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple, Union

from deltafl_jax.algorithms import registry
from deltafl_jax.algorithms.deltafl import check_thetas
from deltafl_jax.client_optimizer import ClientOptimizer
from deltafl_jax.datasets import DataConfig
from deltafl_jax.errors import ConfigError
from deltafl_jax.metrics import DEFAULT_TARGET_ACCURACY
from deltafl_jax.models import LINEAR_MODELS
from deltafl_jax.replicas import aligned
from deltafl_jax.privacy import ADAPTIVE, SAMPLERS, Privacy
from deltafl_jax.server_optimizer import ServerOptimizer

PERCENTILES = (10, 20, 50, 60, 80, 90, 95)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """One experiment: a dataset, a model, an algorithm and the replicas to train.

    Replicas are every (sweep value, seed) pair. Delta-FL sweeps theta (``thetas``); a baseline
    sweeps the flag of its spec, whose values are in ``sweeps`` (flag name -> values; missing
    or empty = the spec's default grid). ``l2_reg`` is one lambda for every swept value, or
    one per swept value, in order. ``options`` holds the algorithms' scalar options (flag name
    -> value, e.g. ``{"filter": "reference"}``; missing = the option's default); the spec
    builds and checks its typed options from it, and ignores those of other algorithms.
    """

    data: DataConfig
    model: str = "linear"
    algorithm: str = "deltafl"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
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
    l2_reg: Union[float, Tuple[float, ...]] = 0.0
    eval_every: int = 10
    clients_per_step: Optional[int] = None  # None = the model's preference on this backend
    eval_chunk: Optional[int] = None        # None = the model's preference on this backend
    output_dir: Optional[str] = None
    overwrite: bool = False
    sweeps: Mapping[str, Tuple[float, ...]] = dataclasses.field(default_factory=dict)
    conv_impl: Optional[str] = None
    # Lanes, lane mode, evaluation chunk and lanes, loop shape and convolutions chosen as on
    # this backend (None: the one running); "gpu" runs an accelerator's program on the CPU.
    placement_backend: Optional[str] = None
    branchless: Optional[bool] = None       # the local-SGD loop body; None: engine.loop_shape
    client_data: str = "auto"               # device | host | auto (deltafl_jax.run.placement)
    eval_clients: Optional[int] = None      # K per split per evaluation; 0: all; None: by N
    save_models: bool = True
    # test_share_below_target: the share of test clients whose accuracy is below this
    # (deltafl_jax.metrics; classifiers only; it changes no training).
    target_accuracy: float = DEFAULT_TARGET_ACCURACY
    verbose: bool = True
    tensorboard: Optional[bool] = None      # None = when tensorboardX is installed
    checkpoint_every: int = 0               # rounds between checkpoints (0: by time only)
    checkpoint_every_s: float = 120.0       # seconds between checkpoints (0: by rounds only)
    devices: Optional[int] = None           # devices sharing a round (None: all local ones)
    stop_on_divergence: bool = False        # stop a replica whose train loss is NaN or > 3x w_0's
    use_bias: Optional[bool] = None         # linear models; None: none on femnist / sent140
    # The server step (deltafl_jax.server_optimizer; Reddi et al. 2021, Algorithm 2).
    server_optimizer: str = "sgd"           # sgd | momentum | adam | yogi | adagrad
    server_lr: Tuple[float, ...] = (1.0,)   # eta; several values train as replicas
    server_momentum: float = 0.9            # beta of momentum (FedAvgM)
    server_beta1: float = 0.9               # adaptive: beta1
    server_beta2: float = 0.99              # adaptive: beta2
    server_eps: float = 1e-3                # adaptive: tau
    # The client's local step (deltafl_jax.client_optimizer).
    client_optimizer: str = "sgd"           # sgd | momentum | adam | adagrad
    client_momentum: float = 0.9            # beta of momentum
    client_beta1: float = 0.9               # adam: beta1
    client_beta2: float = 0.999             # adam: beta2
    client_eps: float = 1e-8                # adam / adagrad: eps
    # Personalised evaluation (deltafl_jax.holdout, deltafl_jax.run.personal).
    client_holdout: float = 0.0             # f: each client's held-out fraction (0: none)
    finetune_steps: Tuple[int, ...] = (0,)  # adaptation steps before each personal evaluation
    finetune_lr: Optional[float] = None     # their learning rate (None: the client's)
    # Client-level differential privacy (deltafl_jax.privacy): off while dp_clip is None.
    dp_clip: Optional[Union[float, str]] = None   # C, the L2 clip of each update; "adaptive"
    dp_noise_multiplier: Tuple[float, ...] = (0.0,)   # z; several values train as replicas
    dp_target_epsilon: Tuple[float, ...] = ()         # epsilon instead of z, calibrated per value
    dp_delta: Optional[float] = None        # None: 1 / N^1.1
    dp_quantile_noise_ratio: float = 1.0    # private Delta-FL: z of its secure sums / z
    dp_loss_bound: float = 10.0             # private Delta-FL: losses clipped to [0, B]
    dp_mm_floor: float = 0.1                # private Delta-FL: beta_k = 1 / max(|F_k - mu|, xi)
    # Client sampling (deltafl_jax.plan): fixed m of N, Poisson with q = m / N, or cyclic
    # groups of m.
    client_sampling: str = "fixed"
    dp_accountant: Optional[str] = None     # pld | rdp; None: rdp (fixed), pld (poisson)
    # --dp_clip=adaptive (Andrew et al. 2021): the clip starts at dp_clip_init and moves
    # toward the dp_clip_quantile of the update norms at rate dp_clip_lr.
    dp_clip_init: float = 0.1
    dp_clip_quantile: float = 0.5
    dp_clip_lr: float = 0.2
    dp_clip_count_noise: float = 5.0        # the clipped count's noise std / z
    dp_kept_weight: str = "noised"          # private Delta-FL: noised | expected (theta m)
    dp_mechanism: str = "gaussian"          # gaussian | bandmf (DP-FTRL, cyclic sampling)
    dp_bands: Optional[int] = None          # bandmf: bands b; None: min(G, rounds)

    def __post_init__(self):
        l2 = self.l2_reg
        object.__setattr__(self, "l2_reg", tuple(l2) if isinstance(l2, (tuple, list)) else l2)
        object.__setattr__(self, "sweeps", {k: tuple(v) for k, v in dict(self.sweeps).items()})
        object.__setattr__(self, "options", dict(self.options))
        for name in ("server_lr", "dp_noise_multiplier", "dp_target_epsilon",
                     "finetune_steps"):
            v = getattr(self, name)
            object.__setattr__(self, name, tuple(v) if isinstance(v, (tuple, list)) else (v,))
        _check(self)

    def sweep(self, flag: str) -> Tuple[float, ...]:
        """The values given for a swept flag (() = none given)."""
        if flag == "thetas":
            return tuple(self.thetas)
        return tuple(self.sweeps.get(flag, ()))

    @property
    def server(self) -> ServerOptimizer:
        """The server optimizer (the ``server_*`` fields)."""
        return ServerOptimizer(name=self.server_optimizer, learning_rates=self.server_lr,
                               momentum=self.server_momentum, beta1=self.server_beta1,
                               beta2=self.server_beta2, eps=self.server_eps)

    @property
    def client(self) -> ClientOptimizer:
        """The client optimizer (the ``client_*`` fields)."""
        return ClientOptimizer(name=self.client_optimizer, momentum=self.client_momentum,
                               beta1=self.client_beta1, beta2=self.client_beta2,
                               eps=self.client_eps)

    @property
    def privacy(self) -> Privacy:
        """The DP settings (the ``dp_*`` fields and the sampler); with --dp_clip=adaptive the
        clip is the initial one, --dp_clip_init."""
        adaptive = self.dp_clip == ADAPTIVE
        return Privacy(clip=self.dp_clip_init if adaptive else self.dp_clip,
                       noise_multipliers=self.dp_noise_multiplier,
                       target_epsilons=self.dp_target_epsilon, delta=self.dp_delta,
                       quantile_noise_ratio=self.dp_quantile_noise_ratio,
                       loss_bound=self.dp_loss_bound, mm_floor=self.dp_mm_floor,
                       sampler=self.client_sampling, accountant=self.dp_accountant,
                       adaptive=adaptive, clip_quantile=self.dp_clip_quantile,
                       clip_lr=self.dp_clip_lr, clip_count_noise=self.dp_clip_count_noise,
                       kept_weight=self.dp_kept_weight, mechanism=self.dp_mechanism,
                       bands=self.dp_bands)

    @property
    def method(self) -> str:
        """The algorithm, with its server optimizer when that is not the plain step
        (``fedavg+adam``; the --algorithm entry that names it)."""
        return self.algorithm if self.server.is_default else \
            f"{self.algorithm}+{self.server_optimizer}"

    def l2_for(self, count: int) -> Tuple[float, ...]:
        """lambda for each of `count` swept values."""
        values = self.l2_reg if isinstance(self.l2_reg, tuple) else (self.l2_reg,)
        try:
            return aligned(values, count, "l2_reg")
        except ValueError as e:
            raise ConfigError(f"{e}; give one value, or one per swept value") from None


def _finite(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"--{name} must be a finite number, got {value!r}")


_POSITIVE_INTS = (
    ("batch_size", "a positive integer"), ("num_rounds", "at least 1"),
    ("clients_per_round", "at least 1"), ("eval_every", "at least 1"))
_OPTIONAL_POSITIVE_INTS = ("local_steps", "clients_per_step", "eval_chunk")
PLACEMENT_BACKENDS = ("cpu", "gpu", "tpu")
CLIENT_DATA = ("auto", "device", "host")


def _check_numbers(c: ExperimentConfig):
    for name in ("learning_rate", "lr_decay"):
        _finite(name, getattr(c, name))
    for lam in (c.l2_reg if isinstance(c.l2_reg, tuple) else (c.l2_reg,)):
        _finite("l2_reg", lam)
        if lam < 0:
            raise ConfigError(f"--l2_reg must be >= 0, got {lam}")
    if c.learning_rate <= 0:
        raise ConfigError(f"--learning_rate must be positive, got {c.learning_rate}")
    for name, what in _POSITIVE_INTS:
        if getattr(c, name) < 1:
            raise ConfigError(f"--{name} must be {what}, got {getattr(c, name)}")
    for name in _OPTIONAL_POSITIVE_INTS:
        if getattr(c, name) is not None and getattr(c, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(c, name)}")
    if c.local_steps is None and c.local_epochs < 1:
        raise ConfigError(f"--local_epochs must be at least 1, got {c.local_epochs}")
    if c.lr_decay < 1:
        raise ConfigError(
            f"--lr_decay is the divisor c >= 1 of lr_t = lr * c^-(t // lr_decay_every), got "
            f"{c.lr_decay} (to halve the rate pass 2)")
    if c.devices is not None and c.devices < 1:
        raise ConfigError(f"--devices must be at least 1, got {c.devices}")
    if c.checkpoint_every < 0 or not c.checkpoint_every_s >= 0:
        raise ConfigError(f"--checkpoint_every and --checkpoint_every_s must be >= 0, got "
                          f"{c.checkpoint_every} and {c.checkpoint_every_s}")
    if c.lr_decay_every < 0:
        raise ConfigError(f"--lr_decay_every must be >= 0 (0: constant), got {c.lr_decay_every}")
    if c.client_data not in CLIENT_DATA:
        raise ConfigError(f"--client_data must be one of {', '.join(CLIENT_DATA)}, got "
                          f"{c.client_data!r}")
    if c.eval_clients is not None and (isinstance(c.eval_clients, bool) or c.eval_clients < 0):
        raise ConfigError(f"--eval_clients must be >= 0 (0: every client), got "
                          f"{c.eval_clients!r}")
    _finite("target_accuracy", c.target_accuracy)
    if not 0.0 < c.target_accuracy <= 1.0:
        raise ConfigError(f"--target_accuracy must be in (0, 1] (a share of correct "
                          f"predictions), got {c.target_accuracy}")
    if c.placement_backend is not None and c.placement_backend not in PLACEMENT_BACKENDS:
        raise ConfigError(f"--placement_backend must be one of {', '.join(PLACEMENT_BACKENDS)} "
                          f"(unset: the backend running), got {c.placement_backend!r}")


def _check_personal(c: ExperimentConfig):
    """--client_holdout, --finetune_steps, --finetune_lr."""
    f = c.client_holdout
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
        raise ConfigError(f"--client_holdout must be a fraction in [0, 1), got {f!r}")
    steps = c.finetune_steps
    if not steps or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in steps):
        raise ConfigError(f"--finetune_steps must list integers >= 0, got {list(steps)}")
    if len(set(steps)) != len(steps):
        raise ConfigError(f"--finetune_steps lists a value twice: {list(steps)}")
    if any(steps) and not f:
        raise ConfigError("--finetune_steps needs --client_holdout > 0: the adapted model is "
                          "evaluated on each client's held-out examples")
    if c.finetune_lr is not None:
        _finite("finetune_lr", c.finetune_lr)
        if c.finetune_lr <= 0:
            raise ConfigError(f"--finetune_lr must be positive, got {c.finetune_lr}")


def _check_seeds(c: ExperimentConfig):
    if not c.seeds:
        raise ConfigError("--seeds must list at least one seed")
    if len(set(c.seeds)) != len(c.seeds):
        raise ConfigError(f"--seeds lists a seed twice: {list(c.seeds)}")
    for s in c.seeds:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0 or s >= 2 ** 31:
            raise ConfigError(f"--seeds must be integers in [0, 2^31), got {s!r}")


def _check_options(c: ExperimentConfig):
    """Every option is some algorithm's, and a value with choices is one of them (the chosen
    spec checks the rest of its own options in ``spec.check``)."""
    known = dict(registry.options())
    unknown = sorted(set(c.options) - set(known))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; the algorithms' options are "
                          f"{', '.join(known)}")
    for flag, value in c.options.items():
        known[flag].check(flag, value)


def _check_sampling(c: ExperimentConfig):
    """--client_sampling and the form of --dp_clip (a number or 'adaptive')."""
    if c.client_sampling not in SAMPLERS:
        raise ConfigError(f"--client_sampling must be one of {', '.join(SAMPLERS)}, got "
                          f"{c.client_sampling!r}")
    if isinstance(c.dp_clip, str) and c.dp_clip != ADAPTIVE:
        raise ConfigError(f"--dp_clip must be a number C > 0 or 'adaptive', got {c.dp_clip!r}")
    if c.dp_clip != ADAPTIVE and c.dp_clip_init != ExperimentConfig.dp_clip_init:
        raise ConfigError("--dp_clip_init needs --dp_clip=adaptive")


def _check(c: ExperimentConfig):
    _check_numbers(c)
    _check_seeds(c)
    _check_personal(c)
    known = {s.flag for s in registry.sweeps()}
    unknown = sorted(set(c.sweeps) - known)
    if unknown:
        raise ConfigError(f"unknown swept flag(s) {', '.join(unknown)}")
    for sweep in registry.sweeps():
        sweep.check(c.sweep(sweep.flag))
    check_thetas(c)
    spec = registry.get(c.algorithm)
    _check_options(c)
    c.server.check()
    c.client.check()
    _check_sampling(c)
    c.privacy.check()
    spec.check(c)
    c.l2_for(len(spec.sweep_values(c)))
    if c.use_bias is not None and c.model not in LINEAR_MODELS:
        raise ConfigError(f"--use_bias applies to the linear models ({', '.join(LINEAR_MODELS)}),"
                          f" not --model={c.model}")
    if not c.output_dir and c.save_models:
        raise ConfigError("--output_dir is required")
