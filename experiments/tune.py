r"""The papers' tuning protocol (App. C.2.2 of the long paper; Sec. 5, "Hyperparameters").

    python -m experiments.tune --flagfile=experiments/synthetic.flags --output_dir=DIR \
        [--lr_grid=0.05,0.1,0.2] [--lr_decay_grid=1,2,4,8] [--l2_grid=1e-3,...,1e-8] \
        [--tune_l2=auto|yes|no] [--l2_per_theta] [--validation_seed=0]

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
   this follows Sec. 5 and issue 5 (the tail is what Delta-FL is about).
3. The winners are written as flagfiles that ``python -m experiments.run`` accepts:
   ``DIR/tuned.flags``, or one ``DIR/tuned_l2=<lambda>.flags`` per distinct lambda when the
   thetas chose different values (the runner takes one ``--l2_reg``); ``DIR/tuning.json``
   and ``DIR/tuning.md`` hold every grid value's score.

Each grid is ONE compiled program: the grid points x seeds are replicas
(:class:`deltafl_jax.rounds.Replicas`) with per-replica learning-rate schedules and per-replica
``l2``. ``DIR/lr_grid`` and ``DIR/l2_grid`` are ordinary run directories
(``python -m experiments.report DIR/lr_grid --out=...`` plots them). Ties go to the first value
in grid order. A grid value whose training loss is not finite for some seed is out.

The functions above ``main`` take configurations, not flags; only ``main`` reads flags. Bad
input prints one line and exits with code 2 before anything is trained.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from absl import app, flags, logging

from experiments import run as runner

FLAGS = flags.FLAGS

PAPER_DECAYS = (1.0, 2.0, 4.0, 8.0)        # divisors c: the paper's factors 1, 1/2, 1/4, 1/8
PAPER_L2 = (1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8)
LR_MULTIPLIERS = (0.25, 0.5, 1.0, 2.0, 4.0)   # default gamma_0 grid around --learning_rate
LINEAR_MODELS = ("linear", "sent140_linear")

flags.DEFINE_list("lr_grid", [], "gamma_0 values (default: --learning_rate x 1/4, 1/2, 1, 2, 4)")
flags.DEFINE_list("lr_decay_grid", [str(c) for c in PAPER_DECAYS],
                  "divisors c >= 1 of the rate every --lr_decay_every rounds (the paper's "
                  "factors 1/c = 1, 1/2, 1/4, 1/8); ignored when --lr_decay_every=0")
flags.DEFINE_bool("tune_lr", True, "grid-search the learning rate for FedAvg")
flags.DEFINE_list("l2_grid", [f"{v:g}" for v in PAPER_L2], "lambda values")
flags.DEFINE_enum("tune_l2", "auto", ["auto", "yes", "no"],
                  "tune lambda on held-out training clients (auto: linear models only)")
flags.DEFINE_bool("l2_per_theta", True, "choose lambda separately for each theta (paper); "
                  "else FedAvg's lambda for all")
flags.DEFINE_integer("validation_seed", 0, "seed of the split of the training clients into "
                     "training and validation halves")


class TuningError(ValueError):
    """Bad tuning input; the message is one line."""


# --------------------------------------------------------------------------------------------
# Grids as replicas of one program


def _key_value(v: float) -> str:
    return f"{v:.6g}"


def _check_grid(name: str, values: Sequence[float], low: float, low_ok: bool) -> Tuple[float, ...]:
    values = tuple(float(v) for v in values)
    if not values:
        raise TuningError(f"--{name} is empty")
    for v in values:
        if not math.isfinite(v) or v < low or (v == low and not low_ok):
            bound = f">= {low:g}" if low_ok else f"> {low:g}"
            raise TuningError(f"--{name} values must be finite and {bound}, got {v:g}")
    keys = [_key_value(v) for v in values]
    if len(set(keys)) != len(keys):
        raise TuningError(f"--{name} lists a value twice: {', '.join(keys)}")
    return values


def lr_grid_replicas(config, learning_rates: Sequence[float], decays: Sequence[float]):
    """FedAvg replicas for every (gamma_0, c) x seed: per-replica schedules
    gamma_0 c^-(t // --lr_decay_every), theta = 1, lambda = config.l2_reg."""
    from deltafl_jax import rounds
    from deltafl_jax.config import learning_rate_schedule

    groups, labels, schedules = [], [], []
    for lr in learning_rates:
        for c in decays:
            schedule = learning_rate_schedule(float(lr), float(c), config.lr_decay_every)
            for g, seed in enumerate(config.seeds):
                groups.append(g)
                schedules.append(schedule)
                labels.append({"algorithm": "fedavg", "theta": 1.0,
                               "learning_rate": float(lr), "lr_decay": float(c),
                               "seed": int(seed),
                               "key": f"lr={_key_value(lr)}_decay={_key_value(c)}_seed={seed}"})
    n = len(groups)
    return rounds.Replicas(
        group=np.asarray(groups, np.int32),
        hyper={"theta": np.ones(n, np.float32),
               "l2": np.full(n, config.l2_reg, np.float32)},
        schedules=tuple(schedules), labels=tuple(labels))


def l2_grid_replicas(config, thetas: Sequence[float], l2s: Sequence[float]):
    """Delta-FL replicas for every (theta, lambda) x seed with the config's learning rate."""
    from deltafl_jax import rounds
    from deltafl_jax.config import learning_rate_schedule

    schedule = learning_rate_schedule(config.learning_rate, config.lr_decay,
                                      config.lr_decay_every)
    groups, labels, theta_v, l2_v = [], [], [], []
    for theta in thetas:
        for lam in l2s:
            for g, seed in enumerate(config.seeds):
                groups.append(g)
                theta_v.append(theta)
                l2_v.append(lam)
                labels.append({"algorithm": "deltafl", "theta": float(theta),
                               "l2_reg": float(lam), "seed": int(seed),
                               "key": f"theta={_key_value(theta)}_l2={_key_value(lam)}_"
                                      f"seed={seed}"})
    return rounds.Replicas(
        group=np.asarray(groups, np.int32),
        hyper={"theta": np.asarray(theta_v, np.float32), "l2": np.asarray(l2_v, np.float32)},
        schedules=tuple(schedule for _ in groups), labels=tuple(labels))


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
    """Group the replicas' final `metric` by grid value (labels without seed and key)."""
    from deltafl_jax.outputs import replica_key

    out: Dict[Tuple, Score] = {}
    for lab in replicas.labels:
        point = {k: v for k, v in lab.items() if k not in ("seed", "key", "algorithm")}
        s = out.setdefault(tuple(point.items()), Score(point=point, seeds=[], values=[]))
        s.seeds.append(int(lab["seed"]))
        s.values.append(float(final[replica_key(lab)][metric]))
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


@dataclasses.dataclass
class TuningResult:
    learning_rate: float
    lr_decay: float
    lr_scores: List[Score]
    l2: Dict[float, float]             # theta -> lambda
    l2_scores: List[Score]
    notes: List[str]


def default_lr_grid(config) -> Tuple[float, ...]:
    return tuple(config.learning_rate * m for m in LR_MULTIPLIERS)


def l2_thetas(config, per_theta: bool) -> Tuple[float, ...]:
    """The thetas whose lambda is tuned: every theta of the run (FedAvg = 1), or only 1."""
    from deltafl_jax.config import PAPER_THETAS

    if config.algorithm != "deltafl" or not per_theta:
        return (1.0,)
    return tuple(config.thetas) or PAPER_THETAS


def check(config, data, lr_grid, decay_grid, l2_grid, tune_lr: bool, tune_l2: bool) -> None:
    """Everything that can be wrong before training, as one-line TuningErrors."""
    if tune_lr:
        _check_grid("lr_grid", lr_grid, 0.0, False)
        _check_grid("lr_decay_grid", decay_grid, 1.0, True)
    if tune_l2:
        _check_grid("l2_grid", l2_grid, 0.0, True)
        if config.algorithm not in ("deltafl", "fedavg"):
            raise TuningError(f"--tune_l2 tunes Delta-FL / FedAvg runs; --algorithm="
                              f"{config.algorithm} would need its own grid (pass --tune_l2=no)")
        half = data.train.num_clients // 2
        if config.clients_per_round > half:
            raise TuningError(
                f"--clients_per_round={config.clients_per_round} exceeds the {half} clients "
                f"of the half of the training clients that trains while lambda is tuned")


def tune(config, data, lr_grid: Sequence[float], decay_grid: Sequence[float],
         l2_grid: Sequence[float], tune_lr: bool = True, tune_l2: bool = True,
         per_theta: bool = True, validation_seed: int = 0, out_dir: Optional[str] = None,
         log: Optional[Callable[[str], None]] = None) -> TuningResult:
    """Run the protocol (module docstring). `config` is the experiment's configuration."""
    log = log or (lambda s: None)
    check(config, data, lr_grid, decay_grid, l2_grid, tune_lr, tune_l2)
    notes: List[str] = []
    lr, decay, lr_scores = config.learning_rate, config.lr_decay, []
    if tune_lr:
        decays = tuple(decay_grid)
        if config.lr_decay_every <= 0:
            decays = (1.0,)
            notes.append("--lr_decay_every=0: constant learning rate (the paper's choice for "
                         "linear models), only c = 1 tried")
        grid_config = dataclasses.replace(
            config, algorithm="fedavg", thetas=(), l2_reg=config.l2_reg,
            output_dir=os.path.join(out_dir, "lr_grid") if out_dir else None,
            save_models=False)
        replicas = lr_grid_replicas(grid_config, lr_grid, decays)
        log(f"learning-rate grid: {len(lr_grid)} x {len(decays)} values x "
            f"{len(config.seeds)} seed(s) = {replicas.size} FedAvg replicas in one program")
        summary = run_grid(grid_config, data, replicas, log, "lr grid")
        lr_scores = scores(replicas, summary["final"], "train_loss_mean")
        win = best(lr_scores)
        if win is None:
            raise TuningError("every learning rate of the grid diverged (non-finite training "
                              "loss); try smaller --lr_grid values")
        lr, decay = win.point["learning_rate"], win.point["lr_decay"]
        log(f"chosen: --learning_rate={lr:g} --lr_decay={decay:g} (terminal train loss "
            f"{win.mean:.4f})")
    l2: Dict[float, float] = {}
    l2_scores: List[Score] = []
    thetas = l2_thetas(config, per_theta)
    if tune_l2:
        val_data = validation_split(data, validation_seed)
        grid_config = dataclasses.replace(
            config, algorithm="deltafl", thetas=thetas, learning_rate=lr, lr_decay=decay,
            output_dir=os.path.join(out_dir, "l2_grid") if out_dir else None,
            save_models=False)
        replicas = l2_grid_replicas(grid_config, thetas, l2_grid)
        log(f"lambda grid: {len(thetas)} theta(s) x {len(l2_grid)} values x "
            f"{len(config.seeds)} seed(s) = {replicas.size} replicas in one program, on "
            f"{val_data.train.num_clients} training / {val_data.test.num_clients} validation "
            f"clients")
        summary = run_grid(grid_config, val_data, replicas, log, "l2 grid")
        l2_scores = scores(replicas, summary["final"], "test_error_p90")
        for theta in thetas:
            win = best([s for s in l2_scores if s.point["theta"] == theta])
            if win is None:
                raise TuningError(f"every lambda diverged at theta={theta:g}")
            l2[float(theta)] = float(win.point["l2_reg"])
            log(f"chosen at theta={theta:g}: --l2_reg={win.point['l2_reg']:g} (validation p90 "
                f"error {100 * win.mean:.2f}%)")
        if not per_theta or config.algorithm != "deltafl":
            for theta in l2_thetas(config, True):
                l2[float(theta)] = l2[1.0]
    return TuningResult(learning_rate=float(lr), lr_decay=float(decay), lr_scores=lr_scores,
                        l2=l2, l2_scores=l2_scores, notes=notes)


def l2_groups(result: TuningResult, thetas: Sequence[float], default_l2: float
              ) -> List[Tuple[float, Tuple[float, ...]]]:
    """(lambda, thetas) per distinct chosen lambda, in the order of `thetas`."""
    groups: Dict[float, List[float]] = {}
    for t in thetas:
        groups.setdefault(result.l2.get(float(t), default_l2), []).append(float(t))
    return [(lam, tuple(ts)) for lam, ts in groups.items()]


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


def _floats(name, values):
    try:
        return tuple(float(v) for v in values)
    except ValueError:
        raise TuningError(f"--{name} must be a comma-separated list of numbers, got "
                          f"{','.join(values)!r}") from None


def _flag_lines(overrides: Dict[str, str]) -> List[str]:
    """The runner's flags as given (flagfile or command line) with `overrides`."""
    lines = []
    for flag in FLAGS.get_flags_for_module(runner.__name__):
        if flag.name in overrides:
            lines.append(f"--{flag.name}={overrides[flag.name]}")
        elif flag.name in ("overwrite",):
            continue
        elif flag.present or flag.value != flag.default:
            text = flag.serialize()
            if text:
                lines.append(text)
    return lines


def _exists(path):
    return os.path.exists(path)


def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        runner.fail(f"unexpected arguments {' '.join(argv[1:])!r} (flags look like "
                    f"--name=value)")
    from deltafl_jax import ConfigError, DataError, load_dataset

    out_dir = FLAGS.output_dir
    try:
        if not out_dir:
            raise TuningError("--output_dir is required (where the grids and tuned.flags go)")
        config = dataclasses.replace(runner.config_from_flags(), output_dir=out_dir)
        lr_grid = _floats("lr_grid", FLAGS.lr_grid) if FLAGS.lr_grid else \
            default_lr_grid(config)
        decay_grid = _floats("lr_decay_grid", FLAGS.lr_decay_grid)
        l2_grid = _floats("l2_grid", FLAGS.l2_grid)
        tune_l2 = {"yes": True, "no": False}.get(FLAGS.tune_l2, config.model in LINEAR_MODELS)
        if not FLAGS.tune_lr and not tune_l2:
            raise TuningError("nothing to tune: --notune_lr and --tune_l2="
                              f"{FLAGS.tune_l2} (model {config.model})")
        taken = [p for p in ("lr_grid", "l2_grid", "tuned.flags", "tuning.json")
                 if _exists(os.path.join(out_dir, p))]
        if taken and not FLAGS.overwrite:
            raise TuningError(f"--output_dir={out_dir} already holds tuning results "
                              f"({', '.join(taken)}); pass --overwrite or choose another "
                              f"directory")
        data = load_dataset(config.data)
        check(config, data, lr_grid, decay_grid, l2_grid, FLAGS.tune_lr, tune_l2)
        if config.clients_per_round > data.train.num_clients:
            raise TuningError(f"--clients_per_round={config.clients_per_round} exceeds the "
                              f"{data.train.num_clients} training clients of {data.name}")
        os.makedirs(out_dir, exist_ok=True)
        log = lambda s: print(s, flush=True)  # noqa: E731
        result = tune(config, data, lr_grid, decay_grid, l2_grid, tune_lr=FLAGS.tune_lr,
                      tune_l2=tune_l2, per_theta=FLAGS.l2_per_theta,
                      validation_seed=FLAGS.validation_seed, out_dir=out_dir, log=log)
    except (TuningError, runner.UsageError, ConfigError, DataError) as e:
        runner.fail(str(e))
        return

    thetas = l2_thetas(config, True)     # the run's thetas (1.0 for FedAvg)
    groups = l2_groups(result, thetas, config.l2_reg)
    header = [
        "# Tuned by python -m experiments.tune (App. C.2.2): learning rate = smallest terminal",
        "# alpha-weighted train loss of FedAvg; lambda = smallest 90th percentile of the test",
        "# misclassification error on held-out training clients (the paper's text also says",
        "# '10th percentile' once; this follows Sec. 5 and issue 5). Scores: tuning.md.",
    ]
    flagfiles = []
    for lam, ts in groups:
        name = "tuned.flags" if len(groups) == 1 else f"tuned_l2={lam:g}.flags"
        run_dir = os.path.join(out_dir, "run" if len(groups) == 1 else f"run_l2={lam:g}")
        overrides = {"learning_rate": repr(result.learning_rate),
                     "lr_decay": repr(result.lr_decay), "l2_reg": repr(float(lam)),
                     "output_dir": run_dir}
        if config.algorithm == "deltafl":
            overrides["thetas"] = ",".join(repr(float(t)) for t in ts)
        lines = header + [f"# thetas {', '.join(f'{t:g}' for t in ts)}: lambda = {lam:g}"] + \
            _flag_lines(overrides)
        path = os.path.join(out_dir, name)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        flagfiles.append(path)

    chosen_lr = [best(result.lr_scores)] if result.lr_scores else []
    chosen_l2 = [best([s for s in result.l2_scores if s.point["theta"] == t])
                 for t in sorted({s.point["theta"] for s in result.l2_scores}, reverse=True)]
    md = ["# Tuning (App. C.2.2)", ""] + [f"- {n}" for n in result.notes] + [
        f"- learning rate: --learning_rate={result.learning_rate:g} "
        f"--lr_decay={result.lr_decay:g} --lr_decay_every={config.lr_decay_every}",
        "- lambda per theta: " + (", ".join(f"θ={t:g}: {l:g}" for t, l in result.l2.items())
                                  or "not tuned"),
        "- flagfiles: " + ", ".join(os.path.basename(p) for p in flagfiles), ""]
    md += scores_markdown("Learning rate (FedAvg, all training clients)", result.lr_scores,
                          chosen_lr, "terminal α-weighted train loss", False)
    md += scores_markdown("Lambda (validation clients)", result.l2_scores, chosen_l2,
                          "p90 test error on validation clients (%)", True)
    with open(os.path.join(out_dir, "tuning.md"), "w") as f:
        f.write("\n".join(md))
    record = {
        "learning_rate": result.learning_rate, "lr_decay": result.lr_decay,
        "lr_decay_every": config.lr_decay_every,
        "l2": {f"{t:g}": l for t, l in result.l2.items()},
        "lr_scores": [dataclasses.asdict(s) for s in result.lr_scores],
        "l2_scores": [dataclasses.asdict(s) for s in result.l2_scores],
        "validation_seed": FLAGS.validation_seed, "notes": result.notes,
        "flagfiles": flagfiles,
    }
    with open(os.path.join(out_dir, "tuning.json"), "w") as f:
        json.dump(record, f, indent=2)
    for p in flagfiles:
        print(f"wrote {p}: python -m experiments.run --flagfile={p}", flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=runner.parse_flags_or_fail)
