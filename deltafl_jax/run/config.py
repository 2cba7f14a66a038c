"""The frozen configuration of one experiment, validated once, with one-line error messages.

The command line (``experiments/cli.py``) builds an :class:`ExperimentConfig` from its flags;
the library never reads flags. Every check names the flag at fault, so a command can print the
message as it is and exit with code 2. The algorithm-specific checks live in each algorithm's
spec (:mod:`deltafl_jax.algorithms`), which this module calls through the registry.

Settings are read through their groups (``config.training.learning_rate``,
``config.privacy.clip``); the flat flag names (``config.learning_rate``,
``ExperimentConfig(data, num_rounds=5)``) remain a shorthand of the public API, and a flat read
warns with :class:`DeprecationWarning` (:class:`ExperimentConfig`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from deltafl_jax.algorithms import registry
from deltafl_jax.datasets import DataConfig
from deltafl_jax.declared import (check_choice, check_finite, default_of, flag_of, flat_values,
                                  group, ints, one_or_floats, setting)
from deltafl_jax.errors import ConfigError
from deltafl_jax.evaluation.metrics import DEFAULT_TARGET_ACCURACY
from deltafl_jax.models import LINEAR_MODELS
from deltafl_jax.models.augment import AUGMENTS
from deltafl_jax.models.llm import LLMSettings, check_run
from deltafl_jax.models.precision import Precision
from deltafl_jax.models.model import RNN_IMPLS
from deltafl_jax.optimizers.client import ClientOptimizer
from deltafl_jax.optimizers.server import ServerOptimizer
from deltafl_jax.privacy.dp import Privacy, check_private_version
from deltafl_jax.replicas.labels import aligned
from deltafl_jax.asynchronous.scheduler import AsyncSettings
from deltafl_jax.sampling.availability import AvailabilitySettings
from deltafl_jax.sampling.samplers import Sampling
from deltafl_jax.sampling.speeds import TimingSettings

PERCENTILES = (10, 20, 50, 60, 80, 90, 95)


def _tensorboard(name: str, value: str) -> Optional[bool]:
    del name
    return {"yes": True, "no": False}.get(value)


@dataclasses.dataclass(frozen=True)
class Training:
    """What is trained and how: the model, the seeds, the rounds and the clients' local
    steps."""

    model: str = setting("linear", "linear | cnn | mlp | mean | gru | lstm | sent140_linear | "
                         "lstm_nwp | fedavg_cnn | pfl_cnn | resnet18_gn | llama (a pretrained "
                         "--base_model, with --dataset=text:PATH), or a model of your own "
                         "registered by --model_module")
    use_bias: Optional[bool] = setting(
        None, "linear and sent140_linear: add a bias b (L2 then applies to it too); unset: no "
        "bias on femnist and sent140 (the papers' w in R^{62x784}, w in R^50), a bias on every "
        "other dataset", kind="bool")
    seeds: Tuple[int, ...] = setting((1,), "seeds; each seeds sampling, shuffling and "
                                     "initialisation", parse=ints)
    num_rounds: int = setting(100, "communication rounds")
    clients_per_round: int = setting(10, "m, clients sampled per round (poisson: expected)")
    local_epochs: int = setting(1, "local epochs of minibatch SGD per kept client")
    local_steps: Optional[int] = setting(None, "local SGD steps instead of epochs",
                                         kind="integer")
    batch_size: int = setting(10, "local minibatch size")
    learning_rate: float = setting(0.1, "client learning rate gamma_0")
    lr_decay: float = setting(1.0, "divide the learning rate by this every lr_decay_every "
                              "rounds (>= 1)")
    lr_decay_every: int = setting(0, "rounds between learning-rate decays (0: constant)")
    # One lambda for every swept value, or one per swept value, in order.
    l2_reg: Union[float, Tuple[float, ...]] = setting(
        0.0, "lambda: local steps w <- (1 - lr lambda) w - lr grad, and F_k includes "
        "(lambda/2)||w||^2; one value, or one per swept value (e.g. per theta of --thetas)",
        kind="list", parse=one_or_floats,
        restore=lambda v: tuple(v) if isinstance(v, list) else v)
    stop_on_divergence: bool = setting(
        False, "stop a replica whose mean training loss is NaN or above 3x its value at w_0 (the "
        "reference code's rule); the others go on")
    # Data augmentation of the local steps (deltafl_jax.models.augment).
    augment: str = setting(
        "none", "random transformation of each local step's minibatch, keyed by (seed, round, "
        "client, step): none | crop_flip (images: 4-pixel zero-padded random crop and "
        "horizontal flip)", choices=AUGMENTS)

    def __post_init__(self):
        l2 = self.l2_reg
        object.__setattr__(self, "l2_reg", tuple(l2) if isinstance(l2, (tuple, list)) else l2)
        object.__setattr__(self, "seeds", tuple(self.seeds))


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """When and on whom the global model is evaluated."""

    eval_every: int = setting(10, "evaluate on all train and test clients every N rounds")
    eval_clients: Optional[int] = setting(
        None, "evaluate K train and K test clients drawn per evaluation, with 95% confidence "
        "intervals (0: every client); unset: every client up to 100000 clients in all, 1000 "
        "beyond", kind="integer")
    # test_share_below_target (deltafl_jax.evaluation.metrics; classifiers only; it changes no training).
    target_accuracy: float = setting(
        DEFAULT_TARGET_ACCURACY, "test_share_below_target: the share of test clients whose "
        "accuracy is below this (classifiers; in (0, 1])")


@dataclasses.dataclass(frozen=True)
class Personalisation:
    """Personalised evaluation (deltafl_jax.evaluation.holdout, deltafl_jax.run.personal)."""

    client_holdout: float = setting(
        0.0, "personalised evaluation: every client keeps this fraction of its examples (at "
        "least one) as its own held-out data; seen clients (their personal or the global model) "
        "and unseen devices (after --finetune_steps on the rest) are evaluated on it; 0: none")
    finetune_steps: Tuple[int, ...] = setting(
        (0,), "with --client_holdout: adaptation steps of each evaluated client on its own data "
        "before its held-out evaluation (the algorithm's adaptation: plain fine-tuning, or "
        "Ditto's proximal steps); several values: one evaluation each (metrics "
        "unseen_ft<k>_*)", parse=ints)
    finetune_lr: Optional[float] = setting(
        None, "learning rate of the adaptation steps; unset: each replica's client learning "
        "rate of the last round", kind="float")

    def __post_init__(self):
        v = self.finetune_steps
        object.__setattr__(self, "finetune_steps",
                           tuple(v) if isinstance(v, (tuple, list)) else (v,))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where and how the rounds' work is laid out: devices, client lanes, evaluation chunks,
    the loop body and the convolutions (None: chosen by model and backend,
    deltafl_jax.run.placement). None of them changes a result on the CPU."""

    devices: Optional[int] = setting(
        None, "devices that share each round's client work (one mesh axis); unset: every local "
        "device (and every process's, with --distributed); 1: one device, no collectives",
        kind="integer")
    clients_per_step: Optional[int] = setting(
        None, "client lanes trained at once (1: one client at a time; m: all sampled clients "
        "vmapped); unset: by model and backend", kind="integer")
    eval_chunk: Optional[int] = setting(None, "examples per evaluation work item; unset: by "
                                        "model and backend", kind="integer")
    placement_backend: Optional[str] = setting(
        None, "cpu | gpu | tpu: choose the lanes, lane mode, evaluation chunk and lanes, loop "
        "body and convolutions as on this backend (gpu on a CPU runs the accelerator's "
        "program); unset: the backend running", kind="string")
    branchless: Optional[bool] = setting(
        None, "local SGD: a lane's restart and a job's bookkeeping as masked selects on every "
        "step instead of behind a lax.cond; unset: by backend", kind="bool")
    client_data: str = setting(
        "auto", "device | host | auto: keep the clients' examples on every device, or on the "
        "host and ship each round's sampled clients; auto: device while both splits fit in a "
        "quarter of a device's memory")
    conv_impl: Optional[str] = setting(
        None, "convolutions (the built-in networks' and every nn.Conv): im2col_wgrad (CPU, "
        "GPU) | winograd (3x3 at stride 1 by Winograd's F(4x4, 3x3), the rest as im2col_wgrad "
        "and a built-in network's first layer as one im2col product; pfl_cnn's and "
        "resnet18_gn's on CPU) | im2col | xla (TPU; the module as written); unset: by backend "
        "and model",
        kind="string")
    rnn_impl: Optional[str] = setting(
        None, "the recurrent layers (gru, lstm, lstm_nwp): scan (XLA's scan over the time "
        "steps, the reference) | pallas (one Pallas kernel over the time steps for the "
        "forward pass and one for the backward pass; GPU only, not yet measured on one) | "
        "pallas_interpret (the same kernels interpreted, for tests on CPU); unset: scan on "
        "every backend until pallas is measured on a GPU", kind="string")


@dataclasses.dataclass(frozen=True)
class Output:
    """What a run writes, where, and when it checkpoints."""

    output_dir: Optional[str] = setting(
        None, "where metrics.jsonl, summary.json and models/ go", kind="string")
    overwrite: bool = setting(
        False, "replace the run already in --output_dir (a folder that is not a run of "
        "deltafl_jax is refused, with or without it)")
    save_models: bool = setting(True, "save the final model of every replica")
    checkpoint_every: int = setting(
        0, "save a checkpoint every N rounds under <output_dir>/checkpoints/ (0: by time only)")
    checkpoint_every_s: float = setting(
        120.0, "save a checkpoint when this many seconds have passed since the last one (0: by "
        "rounds only); a paper run loses at most this plus one round when killed")
    tensorboard: Optional[bool] = setting(
        None, "write TensorBoard event files under <output_dir>/tb/ (auto: when tensorboardX "
        "is installed)", choices=("auto", "yes", "no"), flag_default="auto", parse=_tensorboard)
    verbose: bool = True    # progress lines on stdout (no flag: the commands print them)


# The groups of settings, each a field of ExperimentConfig.
GROUPS = (("training", Training), ("evaluation", Evaluation), ("server", ServerOptimizer),
          ("client", ClientOptimizer), ("sampling", Sampling),
          ("online", AvailabilitySettings), ("timing", TimingSettings),
          ("asynchronous", AsyncSettings), ("privacy", Privacy),
          ("personal", Personalisation), ("placement", Placement), ("output", Output),
          ("llm", LLMSettings), ("precision", Precision))


@dataclasses.dataclass(frozen=True, init=False)
class ExperimentConfig:
    """One experiment: a dataset, an algorithm and its settings, in groups.

    Replicas are every (sweep value, seed) pair. Each algorithm sweeps the flag of its spec
    (Delta-FL: ``thetas``), whose values are in ``sweeps`` (flag name -> values; missing or
    empty = the spec's default grid; ``thetas=`` is accepted as ``sweeps["thetas"]`` and read
    back as :attr:`thetas`). ``options`` holds the algorithms' scalar options (flag
    name -> value, e.g. ``{"filter": "reference"}``; missing = the option's default); the spec
    builds and checks its typed options from it, and ignores those of other algorithms. The
    other settings are in the groups (:data:`GROUPS`), each field declared once with its flag
    (:mod:`deltafl_jax.declared`).

    Reading a setting: through its group, ``config.<group>.<field>``
    (``config.training.learning_rate``, ``config.sampling.sampler``,
    ``config.privacy.clip``); :data:`FLAT` maps each flag to its (group, field), and many
    fields are named otherwise than their flags (``--server_lr`` is ``config.server.learning_rates``,
    ``--client_sampling`` is ``config.sampling.sampler``, ``--dp_clip`` is
    ``config.privacy.clip``, ``--availability_p`` is ``config.online.p``). The package reads
    every setting this way (``tests/test_config_access.py``).

    Flat names, the shorthand of the public API: the constructor and ``dataclasses.replace``
    take settings by flag name as well as whole groups (``ExperimentConfig(data, num_rounds=5,
    server_optimizer="adam")`` sets ``training.num_rounds`` and ``server.name``), and
    ``config.server_lr`` still reads ``config.server.learning_rates``, with a
    :class:`DeprecationWarning` naming the nested path. :meth:`flat` is the flag -> value view
    that outputs and resumes store.
    """

    data: DataConfig
    algorithm: str = "deltafl"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sweeps: Mapping[str, Tuple[float, ...]] = dataclasses.field(default_factory=dict)
    training: Training = group(Training)
    evaluation: Evaluation = group(Evaluation)
    server: ServerOptimizer = group(ServerOptimizer)
    client: ClientOptimizer = group(ClientOptimizer)
    sampling: Sampling = group(Sampling)
    online: AvailabilitySettings = group(AvailabilitySettings)   # --availability and its flags
    timing: TimingSettings = group(TimingSettings)   # --client_speed, --round_deadline, ...
    asynchronous: AsyncSettings = group(AsyncSettings)   # --concurrency, --buffer_size, ...
    privacy: Privacy = group(Privacy)
    personal: Personalisation = group(Personalisation)
    placement: Placement = group(Placement)
    output: Output = group(Output)
    llm: LLMSettings = group(LLMSettings)   # --model=llama: --finetune, --lora_rank, ...
    precision: Precision = group(Precision)   # --compute_dtype

    def __init__(self, data: DataConfig, **settings):
        thetas = settings.pop("thetas", None)   # Delta-FL's sweep, given as before
        own = {}
        for f in dataclasses.fields(self):
            if f.name == "data":
                continue
            own[f.name] = settings.pop(f.name) if f.name in settings else default_of(f)
        changes: Dict[str, Dict[str, Any]] = {}
        for name, value in settings.items():
            if name not in FLAT:
                raise TypeError(f"ExperimentConfig got an unknown setting {name!r}")
            where, field = FLAT[name]
            changes.setdefault(where, {})[field] = value
        for where, fields in changes.items():
            own[where] = dataclasses.replace(own[where], **fields)
        object.__setattr__(self, "data", data)
        for name, value in own.items():
            object.__setattr__(self, name, value)
        sweeps = {k: tuple(v) for k, v in dict(self.sweeps).items()}
        if thetas is not None:
            sweeps["thetas"] = tuple(thetas)
        object.__setattr__(self, "sweeps", sweeps)
        object.__setattr__(self, "options", dict(self.options))
        _check(self)

    @property
    def thetas(self) -> Tuple[float, ...]:
        """Delta-FL's swept levels (--thetas; () = the algorithm's default): the values of
        its sweep in ``sweeps``, as any algorithm's."""
        return self.sweep("thetas")

    def __getattr__(self, name):
        """Deprecated: a setting by its flag's name (``config.dp_clip`` is
        ``config.privacy.clip``), with a :class:`DeprecationWarning` that names the nested
        path."""
        where = FLAT.get(name)
        if where is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(f"config.{name} is config.{where[0]}.{where[1]}: read the setting through "
                      f"its group (the flat names are deprecated)", DeprecationWarning,
                      stacklevel=2)
        return getattr(object.__getattribute__(self, where[0]), where[1])

    def flat(self) -> Dict[str, Any]:
        """Every setting by flag name, with the data's settings under ``data`` and the options
        and sweeps as given (what summary.json's ``config`` and a resume's fingerprint hold)."""
        out = {"data": flat_values(self.data), "algorithm": self.algorithm,
               "options": dict(self.options), "thetas": self.thetas,
               "sweeps": {k: v for k, v in self.sweeps.items() if k != "thetas"}}
        for name, _ in GROUPS:
            out.update(flat_values(getattr(self, name)))
        out["verbose"] = self.output.verbose
        return out

    def sweep(self, flag: str) -> Tuple[float, ...]:
        """The values given for a swept flag (() = none given)."""
        return tuple(self.sweeps.get(flag, ()))

    @property
    def method(self) -> str:
        """The algorithm, with its server optimizer when that is not the plain step
        (``fedavg+adam``; the --algorithm entry that names it)."""
        return self.algorithm if self.server.is_default else \
            f"{self.algorithm}+{self.server.name}"

    def l2_for(self, count: int) -> Tuple[float, ...]:
        """lambda for each of `count` swept values."""
        l2 = self.training.l2_reg
        values = l2 if isinstance(l2, tuple) else (l2,)
        try:
            return aligned(values, count, "l2_reg")
        except ValueError as e:
            raise ConfigError(f"{e}; give one value, or one per swept value") from None


def _flat_names() -> Dict[str, Tuple[str, str]]:
    """setting name (its flag's, or the field's without a flag) -> (group, field)."""
    out = {}
    for where, cls in GROUPS:
        for f in dataclasses.fields(cls):
            flag = flag_of(f)
            out[flag.name if flag is not None else f.name] = (where, f.name)
    return out


FLAT = _flat_names()


def _value(c: ExperimentConfig, flag: str):
    """The setting of `flag` read through its group (``learning_rate``:
    ``c.training.learning_rate``)."""
    where, field = FLAT[flag]
    return getattr(getattr(c, where), field)


def _finite(name, value):
    check_finite(name, value)


_POSITIVE_INTS = (
    ("batch_size", "a positive integer"), ("num_rounds", "at least 1"),
    ("clients_per_round", "at least 1"), ("eval_every", "at least 1"))
_OPTIONAL_POSITIVE_INTS = ("local_steps", "clients_per_step", "eval_chunk")
PLACEMENT_BACKENDS = ("cpu", "gpu", "tpu")
CLIENT_DATA = ("auto", "device", "host")


def _check_numbers(c: ExperimentConfig):
    t, ev, place, out = c.training, c.evaluation, c.placement, c.output
    for name in ("learning_rate", "lr_decay"):
        _finite(name, _value(c, name))
    for lam in (t.l2_reg if isinstance(t.l2_reg, tuple) else (t.l2_reg,)):
        _finite("l2_reg", lam)
        if lam < 0:
            raise ConfigError(f"--l2_reg must be >= 0, got {lam}")
    if t.learning_rate <= 0:
        raise ConfigError(f"--learning_rate must be positive, got {t.learning_rate}")
    for name, what in _POSITIVE_INTS:
        if _value(c, name) < 1:
            raise ConfigError(f"--{name} must be {what}, got {_value(c, name)}")
    for name in _OPTIONAL_POSITIVE_INTS:
        value = _value(c, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name} must be at least 1, got {value}")
    if t.local_steps is None and t.local_epochs < 1:
        raise ConfigError(f"--local_epochs must be at least 1, got {t.local_epochs}")
    if t.lr_decay < 1:
        raise ConfigError(
            f"--lr_decay is the divisor c >= 1 of lr_t = lr * c^-(t // lr_decay_every), got "
            f"{t.lr_decay} (to halve the rate pass 2)")
    if place.devices is not None and place.devices < 1:
        raise ConfigError(f"--devices must be at least 1, got {place.devices}")
    if out.checkpoint_every < 0 or not out.checkpoint_every_s >= 0:
        raise ConfigError(f"--checkpoint_every and --checkpoint_every_s must be >= 0, got "
                          f"{out.checkpoint_every} and {out.checkpoint_every_s}")
    if t.lr_decay_every < 0:
        raise ConfigError(f"--lr_decay_every must be >= 0 (0: constant), got {t.lr_decay_every}")
    if place.client_data not in CLIENT_DATA:
        raise ConfigError(f"--client_data must be one of {', '.join(CLIENT_DATA)}, got "
                          f"{place.client_data!r}")
    if ev.eval_clients is not None and (isinstance(ev.eval_clients, bool) or ev.eval_clients < 0):
        raise ConfigError(f"--eval_clients must be >= 0 (0: every client), got "
                          f"{ev.eval_clients!r}")
    _finite("target_accuracy", ev.target_accuracy)
    if not 0.0 < ev.target_accuracy <= 1.0:
        raise ConfigError(f"--target_accuracy must be in (0, 1] (a share of correct "
                          f"predictions), got {ev.target_accuracy}")
    if place.placement_backend is not None and place.placement_backend not in PLACEMENT_BACKENDS:
        raise ConfigError(f"--placement_backend must be one of {', '.join(PLACEMENT_BACKENDS)} "
                          f"(unset: the backend running), got {place.placement_backend!r}")


def _check_personal(c: ExperimentConfig):
    """--client_holdout, --finetune_steps, --finetune_lr."""
    f = c.personal.client_holdout
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
        raise ConfigError(f"--client_holdout must be a fraction in [0, 1), got {f!r}")
    steps = c.personal.finetune_steps
    if not steps or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in steps):
        raise ConfigError(f"--finetune_steps must list integers >= 0, got {list(steps)}")
    if len(set(steps)) != len(steps):
        raise ConfigError(f"--finetune_steps lists a value twice: {list(steps)}")
    if any(steps) and not f:
        raise ConfigError("--finetune_steps needs --client_holdout > 0: the adapted model is "
                          "evaluated on each client's held-out examples")
    if c.personal.finetune_lr is not None:
        _finite("finetune_lr", c.personal.finetune_lr)
        if c.personal.finetune_lr <= 0:
            raise ConfigError(f"--finetune_lr must be positive, got {c.personal.finetune_lr}")


def _check_seeds(c: ExperimentConfig):
    if not c.training.seeds:
        raise ConfigError("--seeds must list at least one seed")
    if len(set(c.training.seeds)) != len(c.training.seeds):
        raise ConfigError(f"--seeds lists a seed twice: {list(c.training.seeds)}")
    for s in c.training.seeds:
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
        check_choice(known[flag], value)


def _check_timing(c: ExperimentConfig, spec) -> None:
    """The clock's settings (their own checks) and what they cannot run with: a deadline or
    over-selection changes who is aggregated, so it needs an algorithm that takes a cohort of
    fewer than m clients, a sampler of m distinct clients (over-selection draws ceil(r m) of
    them), and no client-level DP (its accountant assumes the sampler's cohorts)."""
    t = c.timing
    t.check()
    sync_offline = t.mean_online_seconds is not None and spec.asynchronous is None
    if not t.active or (t.round_deadline is None and t.over_select == 1.0
                        and not sync_offline):
        return
    what = ("--round_deadline" if t.round_deadline is not None else "--over_select"
            if t.over_select != 1.0 else "--mean_online_seconds")
    if spec.clients.fixed_cohort:
        raise ConfigError(f"{what}: --algorithm={spec.name} needs a fixed cohort of m clients a "
                          f"round (it runs with --client_speed and no deadline or "
                          f"over-selection)")
    if c.privacy.enabled:
        raise ConfigError(f"{what} with --dp_clip: the DP accountant assumes the sampler's "
                          f"cohorts; client-level DP runs without a deadline or over-selection")
    if t.over_select != 1.0 and c.sampling.sampler != "fixed":
        raise ConfigError(f"--over_select with --client_sampling={c.sampling.sampler}: "
                          f"over-selection draws ceil(r m) distinct clients "
                          f"(--client_sampling=fixed)")


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
    spec = registry.get(c.algorithm)
    _check_options(c)
    c.server.check()
    c.client.check()
    c.sampling.check()
    c.privacy.check(c.sampling.sampler)
    c.llm.check()
    c.precision.check()
    if c.placement.rnn_impl not in (None,) + RNN_IMPLS:
        raise ConfigError(f"--rnn_impl must be one of {', '.join(RNN_IMPLS)}, got "
                          f"{c.placement.rnn_impl!r}")
    if c.training.model == "llama" or c.data.dataset.startswith("text:"):
        check_run(c.training.model, c.data.dataset, c.data.text, c.llm)
    if c.privacy.enabled and not c.online.chosen.everyone:
        raise ConfigError(f"--dp_clip with --availability={c.online.model}: the DP "
                          f"accountant assumes every client can be sampled in every round; "
                          f"client-level DP runs with --availability=always")
    _check_timing(c, spec)
    check_private_version(c.privacy, c.sampling.sampler, spec)
    spec.check(c)
    c.l2_for(len(spec.sweep_values(c)))
    if c.training.use_bias is not None and c.training.model not in LINEAR_MODELS:
        raise ConfigError(f"--use_bias applies to the linear models ({', '.join(LINEAR_MODELS)}),"
                          f" not --model={c.training.model}")
    if c.training.augment not in AUGMENTS:
        raise ConfigError(f"--augment must be one of {', '.join(AUGMENTS)}, got "
                          f"{c.training.augment!r}")
    if not c.output.output_dir and c.output.save_models:
        raise ConfigError("--output_dir is required")
