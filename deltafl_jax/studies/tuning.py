r"""The papers' tuning protocol (App. C.2.2 of the long paper; Sec. 5, "Hyperparameters").

1. **Learning rate.** FedAvg (theta = 1) is trained for every (gamma_0, c) of the grid on all
   training clients; the winner has the smallest terminal alpha-weighted mean training loss
   (mean over seeds). The decay is the divisor c >= 1 of ``--lr_decay`` (the paper's factor
   1/c in {1, 1/2, 1/4, 1/8}, applied every ``--lr_decay_every`` rounds; with
   ``--lr_decay_every=0``, the paper's constant rate for linear models, only c = 1 is tried).
   The same rate then serves every theta, as in the paper.
2. **L2 regularisation** (linear models by default): half the training clients are held out as
   validation clients (they form the test split of a new federated dataset); every
   lambda of the grid is trained, with the chosen rate, on the other half, separately for
   each theta of ``--thetas`` (FedAvg = theta 1); the winner has the smallest 90th percentile
   of the misclassification error over the validation clients (unweighted lower quantile,
   mean over seeds). App. C.2.2 says "smallest 10th percentile" where Sec. 5 says the 90th;
   this follows Sec. 5 (the tail is what Delta-FL is about).
3. **A baseline's swept parameter** (``--tune_param``; q of q-FFL, mu of FedProx, t of
   Tilted-ERM, gamma_lambda of AFL, FedAvg-Sub's client counts): the whole sweep x seeds is
   trained, with the chosen rate, on the same training half, and the value with the smallest
   90th percentile of the misclassification error on the validation clients wins (mean over
   seeds), as lambda above; the papers pick it by the test p90 instead, which
   ``python -m experiments.report --best`` shows.
4. The winners are written as ONE flagfile that ``python -m experiments.run`` accepts,
   ``DIR/tuned.flags``, with ``--l2_reg`` listing the chosen lambda of each theta in the order
   of ``--thetas`` (every theta still trains in one program); ``DIR/tuning.json`` and
   ``DIR/tuning.md`` hold every grid value's score.

Each grid is ONE compiled program: the grid points x seeds are replicas
(:class:`deltafl_jax.replicas.labels.Replicas`) with per-replica learning-rate schedules and per-replica
``l2``. ``DIR/lr_grid`` and ``DIR/l2_grid`` are ordinary run directories
(``python -m experiments.report DIR/lr_grid --out=...`` plots them). Ties go to the first value
in grid order. A grid value whose training loss is not finite for some seed is out.

These functions take configurations, never flags; ``python -m experiments.tune`` is their
command-line front end.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.algorithms import registry
from deltafl_jax.declared import finite_in
from deltafl_jax.errors import TuningError
from deltafl_jax.models import LINEAR_MODELS  # the tuner tunes lambda for these
from deltafl_jax.replicas.labels import GridPoint, ReplicaGrid, grid_for

LR_ALGORITHM = "fedavg"      # step 1 trains FedAvg
L2_ALGORITHM = "deltafl"     # step 2 trains Delta-FL at each theta (FedAvg: theta = 1)
PAPER_DECAYS = (1.0, 2.0, 4.0, 8.0)        # divisors c: the paper's factors 1, 1/2, 1/4, 1/8
PAPER_L2 = (1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8)
LR_MULTIPLIERS = (0.25, 0.5, 1.0, 2.0, 4.0)   # default gamma_0 grid around --learning_rate


# --------------------------------------------------------------------------------------------
# Grids as replicas of one program


def _key_value(v: float) -> str:
    return f"{v:.6g}"


def _check_grid(name: str, values: Sequence[float], low: float, low_ok: bool) -> Tuple[float, ...]:
    values = tuple(float(v) for v in values)
    if not values:
        raise TuningError(f"--{name} is empty")
    for v in values:
        if not finite_in(v, low, low_open=not low_ok):
            bound = f">= {low:g}" if low_ok else f"> {low:g}"
            raise TuningError(f"--{name} values must be finite and {bound}, got {v:g}")
    keys = [_key_value(v) for v in values]
    if len(set(keys)) != len(keys):
        raise TuningError(f"--{name} lists a value twice: {', '.join(keys)}")
    return values


def _point(spec, value, extra, **schedule) -> GridPoint:
    """The grid point of `spec` at its swept `value`, with further label coordinates."""
    label = dataclasses.replace(spec.label(value), extra=tuple(extra))
    return GridPoint(label=label, hyper=spec.hyper_for(value), **schedule)


def lr_grid_replicas(config, learning_rates: Sequence[float], decays: Sequence[float]):
    """FedAvg replicas (LR_ALGORITHM) for every (gamma_0, c) x seed: per-replica schedules
    gamma_0 c^-(t // --lr_decay_every), theta = 1, lambda = config.l2_reg, the config's server
    step (one --server_lr)."""
    spec = registry.get(LR_ALGORITHM)
    l2 = config.l2_for(1)[0]
    points = tuple(
        _point(spec, 1.0, (("learning_rate", float(lr)), ("lr_decay", float(c))), l2=l2,
               learning_rate=float(lr), lr_decay=float(c),
               lr_decay_every=config.training.lr_decay_every,
               server_lr=config.server.learning_rates[0])
        for lr in learning_rates for c in decays)
    return ReplicaGrid(points=points, seeds=tuple(config.training.seeds)).build()


def l2_grid_replicas(config, thetas: Sequence[float], l2s: Sequence[float]):
    """Delta-FL replicas (L2_ALGORITHM) for every (theta, lambda) x seed with the config's
    learning rate."""
    spec = registry.get(L2_ALGORITHM)
    points = tuple(
        _point(spec, float(theta), (("l2_reg", float(lam)),), l2=float(lam),
               learning_rate=config.training.learning_rate, lr_decay=config.training.lr_decay,
               lr_decay_every=config.training.lr_decay_every,
               server_lr=config.server.learning_rates[0])
        for theta in thetas for lam in l2s)
    return ReplicaGrid(points=points, seeds=tuple(config.training.seeds)).build()


def validation_split(data, seed: int):
    """The training clients split in halves: a dataset whose train split is one half and whose
    test split is the other (the validation clients, App. C.2.2)."""
    from deltafl_jax import FederatedDataset
    from deltafl_jax.data import split_clients

    train, val = split_clients(data.train, seed=seed, train_fraction=0.5)
    return FederatedDataset(name=data.name, train=train, test=val, num_classes=data.num_classes,
                            x_scale=data.x_scale,
                            metadata={**dict(data.metadata), "validation_seed": int(seed)})


@dataclasses.dataclass
class Score:
    """One grid value: its label fields, the criterion per seed, their mean and std."""

    point: Dict[str, float]
    seeds: List[int]
    values: List[float]

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def std(self) -> float:
        return float(np.std(self.values))


def scores(replicas, final: Dict[str, Dict[str, float]], metric: str) -> List[Score]:
    """Group the replicas' final `metric` by grid point (all seeds of a point together)."""
    out: Dict[Tuple, Score] = {}
    for lab in replicas.labels:
        point = {k: v for k, v in lab.to_json().items() if k not in ("seed", "algorithm")}
        s = out.setdefault(lab.method_key(), Score(point=point, seeds=[], values=[]))
        s.seeds.append(int(lab.seed))
        s.values.append(float(final[lab.key()][metric]))
    return list(out.values())


def best(candidates: Sequence[Score]) -> Optional[Score]:
    """The smallest mean among the finite scores; ties go to the first in grid order."""
    ok = [s for s in candidates if s.finite]
    if not ok:
        return None
    low = min(s.mean for s in ok)
    return next(s for s in ok if s.mean == low)


def run_grid(config, data, replicas, log: Optional[Callable[[str], None]] = None,
             name: str = "grid"):
    """Train the replicas in one program (:func:`deltafl_jax.run_experiment`); returns its
    summary (``final`` metrics per replica key, ``state``)."""
    from deltafl_jax import run_experiment

    def quiet(line):
        if log is not None:
            log(f"[{name}] " + line.split(" | ")[0])

    return run_experiment(config, data, log=quiet, replicas=replicas)


@dataclasses.dataclass(frozen=True)
class TuningPlan:
    """What the protocol tunes, over which grids (module docstring)."""

    lr_grid: Sequence[float] = ()       # step 1: the client learning rates
    decay_grid: Sequence[float] = ()    # step 1: the learning-rate decays
    l2_grid: Sequence[float] = ()       # step 2: the lambdas
    tune_lr: bool = True                # run step 1 (else the configuration's rate and decay)
    tune_l2: bool = True                # run step 2
    per_theta: bool = True              # step 2: one lambda per theta (else theta = 1's for all)
    validation_seed: int = 0            # the seed of the validation split of steps 2 and 3
    tune_param: bool = False            # run step 3 (a baseline's swept parameter)


@dataclasses.dataclass
class TuningResult:
    learning_rate: float
    lr_decay: float
    lr_scores: List[Score]
    l2: Dict[float, float]             # theta -> lambda
    l2_scores: List[Score]
    notes: List[str]
    param_flag: Optional[str] = None   # a baseline's swept flag (qffl_q, fedprox_mu, ...)
    param_value: Optional[float] = None
    param_l2: Optional[float] = None   # the lambda that went with the chosen value
    param_scores: List[Score] = dataclasses.field(default_factory=list)


def default_lr_grid(config) -> Tuple[float, ...]:
    return tuple(config.training.learning_rate * m for m in LR_MULTIPLIERS)


def tunes_l2(config) -> bool:
    """The lambda step applies to the run's algorithm (``Grid.tunes_l2`` of its spec: Delta-FL
    and FedAvg, Delta-FL at the thetas of its sweep)."""
    return registry.get(config.algorithm).grid.tunes_l2


def l2_thetas(config, per_theta: bool) -> Tuple[float, ...]:
    """The thetas whose lambda is tuned: every theta of the run (FedAvg = 1), or only 1."""
    if not (per_theta and tunes_l2(config)):
        return (1.0,)
    return registry.get(config.algorithm).sweep_values(config)


def param_sweep(config):
    """(spec, sweep, values) of the baseline parameter that step 3 tunes (q, mu, t,
    gamma_lambda, FedAvg-Sub's clients), or None for a sweep that is not tuned
    (``Sweep.tuned``: Delta-FL's theta is the user's choice) and for a single value."""
    spec = registry.get(config.algorithm)
    sweep = spec.active_sweep(config)
    if not sweep.tuned:
        return None
    values = spec.sweep_values(config)
    return (spec, sweep, values) if len(values) > 1 else None


def check(config, data, lr_grid, decay_grid, l2_grid, tune_lr: bool, tune_l2: bool,
          tune_param: bool = False) -> None:
    """Everything that can be wrong before training, as one-line TuningErrors."""
    if config.privacy.enabled:
        raise TuningError("the tuner trains without client-level DP: tune without --dp_clip, "
                          "then add the --dp_* flags to tuned.flags")
    if len(config.server.learning_rates) > 1:
        raise TuningError(f"--server_lr lists {len(config.server.learning_rates)} values; the "
                          f"tuner trains every grid with one server step: give one --server_lr")
    if tune_lr:
        _check_grid("lr_grid", lr_grid, 0.0, False)
        _check_grid("lr_decay_grid", decay_grid, 1.0, True)
    if tune_l2:
        _check_grid("l2_grid", l2_grid, 0.0, True)
        if not tunes_l2(config):
            able = ", ".join(n for n in registry.names() if registry.get(n).grid.tunes_l2)
            raise TuningError(f"--tune_l2 tunes the runs of {able}; --algorithm="
                              f"{config.algorithm} would need its own grid (pass --tune_l2=no)")
    if tune_param and param_sweep(config) is None:
        raise TuningError(f"--tune_param tunes a baseline's swept parameter over at least two "
                          f"values; --algorithm={config.algorithm} has none to tune")
    if tune_l2 or tune_param:
        half = data.train.num_clients // 2
        if config.training.clients_per_round > half:
            raise TuningError(
                f"--clients_per_round={config.training.clients_per_round} exceeds the {half} "
                f"clients of the half of the training clients that trains while tuning on "
                f"validation clients")


def _grid_output(config, out_dir, name):
    """The output settings of one tuning grid: its folder `name` under `out_dir` (none without
    one), and no saved models."""
    return dataclasses.replace(config.output, save_models=False,
                               output_dir=os.path.join(out_dir, name) if out_dir else None)


def tune_lr_step(config, data, lr_grid, decay_grid, out_dir, log, notes):
    """Step 1: (learning rate, decay, scores) of FedAvg's smallest terminal train loss."""
    decays = tuple(decay_grid)
    if config.training.lr_decay_every <= 0:
        decays = (1.0,)
        notes.append("--lr_decay_every=0: constant learning rate (the paper's choice for "
                     "linear models), only c = 1 tried")
    grid_config = dataclasses.replace(
        config, algorithm=LR_ALGORITHM, thetas=(),
        training=dataclasses.replace(config.training, l2_reg=config.l2_for(1)[0]),
        output=_grid_output(config, out_dir, "lr_grid"))
    replicas = lr_grid_replicas(grid_config, lr_grid, decays)
    log(f"learning-rate grid: {len(lr_grid)} x {len(decays)} values x "
        f"{len(config.training.seeds)} seed(s) = {replicas.size} FedAvg replicas in one program")
    summary = run_grid(grid_config, data, replicas, log, "lr grid")
    lr_scores = scores(replicas, summary.final, "train_loss_mean")
    win = best(lr_scores)
    if win is None:
        raise TuningError("every learning rate of the grid diverged (non-finite training "
                          "loss); try smaller --lr_grid values")
    lr, decay = win.point["learning_rate"], win.point["lr_decay"]
    log(f"chosen: --learning_rate={lr:g} --lr_decay={decay:g} (terminal train loss "
        f"{win.mean:.4f})")
    return lr, decay, lr_scores


def tune_l2_step(config, data, lr, decay, plan: TuningPlan, out_dir, log):
    """Step 2: ({theta: lambda}, scores) of the smallest validation p90 per theta, over
    ``plan.l2_grid``."""
    l2_grid, per_theta = plan.l2_grid, plan.per_theta
    thetas = l2_thetas(config, per_theta)
    val_data = validation_split(data, plan.validation_seed)
    grid_config = dataclasses.replace(
        config, algorithm=L2_ALGORITHM, thetas=thetas,
        training=dataclasses.replace(config.training, learning_rate=lr, lr_decay=decay,
                                     l2_reg=0.0),
        output=_grid_output(config, out_dir, "l2_grid"))
    replicas = l2_grid_replicas(grid_config, thetas, l2_grid)
    log(f"lambda grid: {len(thetas)} theta(s) x {len(l2_grid)} values x "
        f"{len(config.training.seeds)} seed(s) = {replicas.size} replicas in one program, on "
        f"{val_data.train.num_clients} training / {val_data.test.num_clients} validation "
        f"clients")
    summary = run_grid(grid_config, val_data, replicas, log, "l2 grid")
    l2_scores = scores(replicas, summary.final, "test_error_p90")
    l2: Dict[float, float] = {}
    for theta in thetas:
        win = best([s for s in l2_scores if s.point["theta"] == theta])
        if win is None:
            raise TuningError(f"every lambda diverged at theta={theta:g}")
        l2[float(theta)] = float(win.point["l2_reg"])
        log(f"chosen at theta={theta:g}: --l2_reg={win.point['l2_reg']:g} (validation p90 "
            f"error {100 * win.mean:.2f}%)")
    if not per_theta:
        for theta in l2_thetas(config, True):
            l2[float(theta)] = l2[1.0]
    return l2, l2_scores


def swept_scores(replicas, final: Dict[str, Dict[str, float]], metric: str) -> List[Score]:
    """Like :func:`scores`, with the point named by the swept flag: {flag: value}."""
    out: Dict[Tuple, Score] = {}
    for lab in replicas.labels:
        name, value = lab.swept()
        s = out.setdefault(lab.method_key(), Score(point={name: value}, seeds=[], values=[]))
        s.seeds.append(int(lab.seed))
        s.values.append(float(final[lab.key()][metric]))
    return list(out.values())


def tune_param_step(config, data, lr, decay, validation_seed, out_dir, log):
    """Step 3 (baselines): (flag, value, its lambda, scores): the swept value (q, mu, t,
    gamma_lambda, clients) with the smallest 90th percentile of the misclassification error
    on the validation clients, mean over seeds; the whole sweep x seeds in one program."""
    spec, sweep, values = param_sweep(config)
    val_data = validation_split(data, validation_seed)
    grid_config = dataclasses.replace(
        config, training=dataclasses.replace(config.training, learning_rate=lr, lr_decay=decay),
        output=_grid_output(config, out_dir, "param_grid"))
    replicas = grid_for(spec, grid_config).build()
    log(f"{sweep.flag} grid: {len(values)} values x {len(config.training.seeds)} seed(s) = "
        f"{replicas.size} {config.algorithm} replicas in one program, on "
        f"{val_data.train.num_clients} training / {val_data.test.num_clients} validation "
        f"clients")
    summary = run_grid(grid_config, val_data, replicas, log, f"{sweep.flag} grid")
    found = swept_scores(replicas, summary.final, "test_error_p90")
    win = best(found)
    if win is None:
        raise TuningError(f"every value of --{sweep.flag} diverged")
    value = float(next(iter(win.point.values())))
    lam = config.l2_for(len(values))[list(values).index(value)]
    log(f"chosen: --{sweep.flag}={value:g} (validation p90 error {100 * win.mean:.2f}%)")
    return sweep.flag, value, lam, found


def tune(config, data, plan: TuningPlan, out_dir: Optional[str] = None,
         log: Optional[Callable[[str], None]] = None) -> TuningResult:
    """Run the protocol (module docstring) as `plan` asks. `config` is the experiment's
    configuration."""
    log = log or (lambda s: None)
    check(config, data, plan.lr_grid, plan.decay_grid, plan.l2_grid, plan.tune_lr, plan.tune_l2,
          plan.tune_param)
    notes: List[str] = []
    lr, decay, lr_scores = config.training.learning_rate, config.training.lr_decay, []
    if plan.tune_lr:
        lr, decay, lr_scores = tune_lr_step(config, data, plan.lr_grid, plan.decay_grid, out_dir,
                                            log, notes)
    l2: Dict[float, float] = {}
    l2_scores: List[Score] = []
    if plan.tune_l2:
        l2, l2_scores = tune_l2_step(config, data, lr, decay, plan, out_dir, log)
    result = TuningResult(learning_rate=float(lr), lr_decay=float(decay), lr_scores=lr_scores,
                          l2=l2, l2_scores=l2_scores, notes=notes)
    if plan.tune_param:
        (result.param_flag, result.param_value, result.param_l2,
         result.param_scores) = tune_param_step(config, data, lr, decay, plan.validation_seed,
                                                out_dir, log)
    return result


def l2_per_theta(result: TuningResult, thetas: Sequence[float], default_l2: float
                 ) -> Tuple[float, ...]:
    """The chosen lambda of each theta, in the order of `thetas` (for one --l2_reg list)."""
    return tuple(result.l2.get(float(t), default_l2) for t in thetas)


def scores_markdown(title: str, rows: Sequence[Score], chosen: Sequence[Score], metric: str,
                    percent: bool) -> List[str]:
    if not rows:
        return []
    names = list(rows[0].point)
    out = [f"## {title}", "", "| " + " | ".join(names) + f" | {metric} (mean ± std over seeds) "
           "| |", "|" + "---|" * (len(names) + 2)]
    for s in rows:
        scale = 100.0 if percent else 1.0
        value = (f"{scale * s.mean:.4g} ± {scale * s.std:.2g}" if s.finite
                 else "diverged")
        mark = "**chosen**" if any(s is c for c in chosen) else ""
        out.append("| " + " | ".join(f"{s.point[n]:g}" for n in names) + f" | {value} | {mark} |")
    return out + [""]


# --------------------------------------------------------------------------------------------
# The command line
