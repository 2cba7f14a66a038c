r"""The tail leaderboard: every method that applies to a dataset, tuned by the papers' protocol,
3 seeds, one Markdown table and one figure per dataset (:mod:`deltafl_jax.studies.leaderboard`).

    python -m experiments.leaderboard [--set=cpu|download|paper|image] [--out=runs/leaderboard]
    python -m experiments.leaderboard --set=paper --estimate
    python -m experiments.leaderboard --settings=leaderboard_synthetic_1_1 --methods=fedavg,gifair

Each dataset (a *setting*) is a flagfile of experiments/ (``--set=cpu``: the three below,
offline; ``download``: sent140_linear and emnist_cpu; ``paper``: emnist, shakespeare and
sent140_lstm at the papers' sizes; ``image``: cifar10_dirichlet and fmnist_shards, CIFAR-10
Dir(0.1) and Fashion-MNIST shards over 100 clients); a dataset that is not prepared is refused
in one line unless ``--download`` is given, which fetches and prepares it first, and
``--estimate`` measures a missing dataset on its known shape
(:mod:`deltafl_jax.datasets.known_shapes`); experiment flags given here override the flagfile's (e.g.
``--num_rounds=20`` for a quick try). Methods: every spec of the registry whose leaderboard
Board applies (or ``--methods``), each with its board's grid (``--grid=quick`` on the CPU set,
``full`` elsewhere), a swept flag given here (``--gifair_coeff=0.1,1``) replacing its method's
grid. Seeds: 1, 2, 3 (or ``--seeds``) for the final runs; the tuning runs use
``--tune_seeds`` (default: the final seeds on the cpu set, 1 elsewhere); a grid point any of
whose validation seeds diverged is passed over. Bad input (an unknown setting, a method that
is not a leaderboard method or does not apply, a value out of range, results already in
``--out``) prints one line and exits 2 before anything is trained.

Writes ``OUT/<setting>/`` (the programs' run directories: ``lr_grid``, ``<method>/validation``,
``<method>/final``; ``leaderboard.json``, ``leaderboard.md``, ``frontier.png``) and
``OUT/leaderboard.md``; ``--readme`` writes the tables into the documentation page that holds
their markers (docs/results/leaderboard.md; :mod:`experiments.pages`). A program whose
directory already holds a finished run of the same configuration is read back, not retrained
(an interrupted leaderboard picks up where it stopped).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from absl import app, flags, logging

from deltafl_jax.studies import tuning
from experiments import cli
from experiments import run as _run   # noqa: F401  (its --estimate, --estimate_rounds)

FLAGS = flags.FLAGS
cli.define_experiment_flags()


def _define(kind, name, default, help, **kw):
    if name not in FLAGS:
        kind(name=name, default=default, help=help, **kw)


_define(flags.DEFINE_enum, "set", "cpu", "which datasets: cpu (offline, 2-core CPU) | download "
        "(Sent140 linear, FEMNIST CPU) | paper (the papers' sizes, an accelerator) | image "
        "(CIFAR-10 Dir(0.1), Fashion-MNIST shards)",
        enum_values=["cpu", "download", "paper", "image"])
_define(flags.DEFINE_bool, "download", False, "fetch and prepare a setting's dataset that is "
        "not prepared yet (as python -m data_prep.prepare --download does) before planning")
_define(flags.DEFINE_list, "settings", [], "run only these settings (flagfile names) of the set")
_define(flags.DEFINE_list, "methods", [], "run only these methods (default: every method whose "
        "leaderboard Board applies)")
OUT_DEFAULT = "runs/leaderboard"
_define(flags.DEFINE_string, "out", OUT_DEFAULT, "where the programs, tables and figures go")
_define(flags.DEFINE_list, "tune_seeds", [], "seeds of the tuning runs (the learning-rate "
        "grid and the validation grids; default: the final runs' seeds, 1, 2, 3 or --seeds, on "
        "the cpu set, 1 elsewhere)")
_define(flags.DEFINE_list, "lr_multipliers", ["0.5", "1", "2"], "the learning-rate grid: the "
        "setting's --learning_rate times these (FedAvg, smallest terminal train loss); empty: "
        "no tuning")
_define(flags.DEFINE_enum, "grid", "auto", "the methods' grids: quick (the CPU set's) | full | "
        "auto (quick on the cpu set)", enum_values=["auto", "quick", "full"])
_define(flags.DEFINE_bool, "readme", False, "write the tables into the documentation page that "
        "holds their markers (docs/results/leaderboard.md)")
_define(flags.DEFINE_bool, "estimate_exact", False, "with --estimate: build, compile and time "
        "every program (about as long as the run's own compiling), instead of two per setting "
        "and the rest projected from their cost per local step")
_define(flags.DEFINE_string, "readme_path", None, "the Markdown page to write (default: the "
        "repository's page, README.md or docs/, that holds the markers)")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETS = {
    "cpu": ("leaderboard_synthetic_1_1", "leaderboard_synthetic_05_05",
            "leaderboard_shakespeare_cpu"),
    "download": ("sent140_linear", "emnist_cpu"),
    "paper": ("emnist", "shakespeare", "sent140_lstm"),
    "image": ("cifar10_dirichlet", "fmnist_shards"),
}
TITLES = {
    "leaderboard_synthetic_1_1": "Synthetic(1, 1)",
    "leaderboard_synthetic_05_05": "Synthetic(0.5, 0.5)",
    "leaderboard_shakespeare_cpu": "Shakespeare (CPU configuration)",
    "sent140_linear": "Sent140, linear", "emnist_cpu": "FEMNIST (CPU configuration)",
    "emnist": "FEMNIST, ConvNet", "shakespeare": "Shakespeare, GRU",
    "sent140_lstm": "Sent140, LSTM",
    "cifar10_dirichlet": "CIFAR-10, Dir(0.1), CNN",
    "fmnist_shards": "Fashion-MNIST, shards, ConvNet",
}
DEFAULT_SEEDS = (1, 2, 3)
# Rough cost of one replica-round relative to softmax regression, for the ETA of programs
# whose setting has not started yet (measured on the 2-core CPU).
MODEL_COST = {"gru": 40.0, "lstm": 40.0, "cnn": 30.0}


@dataclasses.dataclass
class Stage:
    """One program: the learning-rate grid, a method's validation grid or its final runs."""

    setting: "Setting"
    kind: str                 # lr | validation | final
    host: str                 # the registry name of the program's algorithm
    replicas: int
    rounds: int
    seconds: float = 0.0

    @property
    def units(self) -> float:
        return self.replicas * self.rounds * MODEL_COST.get(self.setting.base.training.model, 1.0)

    @property
    def out(self) -> str:
        sub = "lr_grid" if self.kind == "lr" else os.path.join(self.host, self.kind)
        return os.path.join(self.setting.out, sub)


@dataclasses.dataclass
class Setting:
    """One dataset of the leaderboard: its base configuration, data, methods and grids."""

    name: str
    base: Any                       # ExperimentConfig from the flagfile and the command line
    data: Any
    methods: List[str]
    grids: Dict[str, Dict[str, Tuple[float, ...]]]
    hosts: Dict[str, List[str]]     # program -> the methods that join it
    quick: bool
    out: str
    learning_rate: float = 0.0
    lr_scores: Dict[str, float] = dataclasses.field(default_factory=dict)
    results: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def title(self) -> str:
        return TITLES.get(self.name, self.name)


# --------------------------------------------------------------------------------------------
# Planning (everything that can be wrong is found here, before any training)


def _setting_config(path: str, argv: List[str]):
    """The flagfile's configuration with the command line's experiment flags on top."""
    FLAGS.unparse_flags()
    FLAGS([argv[0], f"--flagfile={path}", *argv[1:]])
    config = cli.config_from_flags(algorithm=tuning.L2_ALGORITHM, server_optimizer=None)
    seeds = config.training.seeds if "seeds" in cli.COMMAND_LINE else DEFAULT_SEEDS
    return dataclasses.replace(config, seeds=tuple(seeds), verbose=True, tensorboard=False,
                               overwrite=FLAGS.overwrite, save_models=False)


def _grids(methods, quick: bool) -> Dict[str, Dict[str, Tuple[float, ...]]]:
    """Each method's grid: its board's, a swept flag given on the command line replacing it."""
    from deltafl_jax.studies import leaderboard as lb
    from deltafl_jax.algorithms import registry
    out = {}
    for name in methods:
        spec = registry.get(name)
        grid = spec.reporting.leaderboard.grid_for(quick)
        for sweep in spec.sweeps():
            if sweep.flag in cli.COMMAND_LINE:
                values = (cli.ints if sweep.integer else cli.floats)(sweep.flag,
                                                                     FLAGS[sweep.flag].value)
                grid[sweep.flag] = values
        out[name] = lb.check_grid(name, grid)
    return out


def _settings_of_set() -> List[str]:
    names = list(SETS[FLAGS.set])
    if FLAGS.settings:
        known = [n for names_ in SETS.values() for n in names_]
        bad = [n for n in FLAGS.settings if n not in known]
        if bad:
            raise cli.UsageError(f"--settings: unknown setting(s) {', '.join(bad)}; choose "
                                 f"from {', '.join(known)}")
        names = list(FLAGS.settings)
    return names


def _setting_data(name: str, base):
    """The setting's data: loaded; not prepared yet, fetched and prepared first with
    --download, measured on its known shape with --estimate, else DataError (one line)."""
    from deltafl_jax import DataError, load_dataset
    from deltafl_jax.datasets import DOWNLOADABLE, centralised_key, prepare_dataset
    from deltafl_jax.datasets.known_shapes import load_or_stand_in
    if FLAGS.estimate and not FLAGS.download:
        data, note = load_or_stand_in(base.data)
        if note:
            print(f"{name}: measured on {note}", flush=True)
        return data
    try:
        return load_dataset(base.data)
    except DataError as e:
        if not FLAGS.download:
            fetchable = (base.data.dataset in DOWNLOADABLE
                         or centralised_key(base.data.dataset) is not None)
            hint = " (or pass --download to this command)" if fetchable else ""
            raise DataError(f"{name}: {str(e).splitlines()[0]}{hint}") from None
    print(f"{name}: fetching and preparing {base.data.dataset} (--download)", flush=True)
    prepare_dataset(base.data, download=True)
    return load_dataset(base.data)


def plan(argv: List[str]) -> List[Setting]:
    """Every setting with its data, methods and grids, each checked (ConfigError, one line)."""
    from deltafl_jax.studies import leaderboard as lb
    from deltafl_jax.algorithms.leaderboard import BoardSetting
    settings = []
    for name in _settings_of_set():
        base = _setting_config(os.path.join(REPO, "experiments", f"{name}.flags"), argv)
        data = _setting_data(name, base)
        facts = BoardSetting(dataset=data.name, model=base.training.model,
                             train_clients=data.train.num_clients,
                             clients_per_round=base.training.clients_per_round)
        methods = lb.board_methods(facts, FLAGS.methods or None)
        for host in [lb.host_of(m)[0] for m in methods]:
            if host not in methods:
                methods.append(host)          # FedAvg alone still runs in Delta-FL's program
        quick = FLAGS.grid == "quick" or (FLAGS.grid == "auto" and FLAGS.set == "cpu")
        grids = _grids(methods, quick)
        hosts: Dict[str, List[str]] = {}
        for m in methods:
            hosts.setdefault(lb.host_of(m)[0], []).append(m)
        setting = Setting(name=name, base=base, data=data, methods=methods, grids=grids,
                          hosts=hosts, quick=quick, out=os.path.join(FLAGS.out, name))
        for host in hosts:   # the spec checks every value before anything is trained
            _check_config(setting, host)
        half = data.train.num_clients // 2
        if base.training.clients_per_round > half and any(_tuned(setting, h) for h in hosts):
            raise cli.UsageError(
                f"{name}: --clients_per_round={base.training.clients_per_round} exceeds the {half} "
                f"clients of the half of the training clients that trains while tuning on "
                f"validation clients")
        settings.append(setting)
    return settings


def _joined_values(setting: Setting, host: str) -> Tuple[float, ...]:
    from deltafl_jax.studies import leaderboard as lb
    return tuple(lb.host_of(m)[1] for m in setting.hosts[host] if m != host)


def _config(setting: Setting, host: str, kind: str, seeds):
    from deltafl_jax.studies import leaderboard as lb
    base = dataclasses.replace(setting.base, learning_rate=setting.learning_rate
                               or setting.base.training.learning_rate)
    extra = _joined_values(setting, host) if kind == "final" else ()
    grid = setting.grids[host]
    return lb.grid_config(base, host, grid, seeds, os.path.join(setting.out, host, kind), extra)


def _check_config(setting: Setting, host: str) -> None:
    from deltafl_jax.algorithms import registry
    config = _config(setting, host, "final", setting.base.training.seeds)
    registry.get(host).check(config)


def _grid_points(grid) -> int:
    return int(math.prod(len(v) for v in grid.values())) if grid else 1


def stages(setting: Setting, tune_seeds, lr_grid) -> List[Stage]:
    """The programs of a setting, in order, with their sizes (for the ETA)."""
    rounds = setting.base.training.num_rounds
    out = []
    if len(lr_grid) > 1:
        out.append(Stage(setting, "lr", tuning.LR_ALGORITHM, len(lr_grid) * len(tune_seeds),
                         rounds))
    for host in setting.hosts:
        points = _grid_points(setting.grids[host])
        if points > 1 and host in setting.methods and _tuned(setting, host):
            out.append(Stage(setting, "validation", host, points * len(tune_seeds), rounds))
        extra = len(_joined_values(setting, host))
        seeds = len(setting.base.training.seeds)
        out.append(Stage(setting, "final", host, (points + extra) * seeds, rounds))
    return out


def _tuned(setting: Setting, host: str) -> bool:
    return _grid_points(setting.grids[host]) > 1


# --------------------------------------------------------------------------------------------
# Running


class Clock:
    """Progress and ETA over all the programs. A program costs a + b x its replica-rounds
    (weighted by MODEL_COST): a (building and compiling) and b are fitted by least squares to
    the programs done so far (b alone after the first), and the ETA is their sum over the
    programs left."""

    def __init__(self, all_stages: List[Stage]):
        self.stages = all_stages
        self.t0 = time.perf_counter()
        self.done: List[Stage] = []

    def eta(self) -> Optional[float]:
        import numpy as np
        if not self.done:
            return None
        units = np.array([s.units for s in self.done])
        secs = np.array([s.seconds for s in self.done])
        a, b = 0.0, secs.sum() / max(units.sum(), 1e-9)
        if len(self.done) > 2 and np.ptp(units) > 0:
            b, a = np.polyfit(units, secs, 1)
            if a < 0 or b < 0:
                a, b = 0.0, secs.sum() / max(units.sum(), 1e-9)
        left = self.stages[len(self.done):]
        return float(sum(a + b * s.units for s in left))

    def line(self, stage: Stage) -> str:
        i = len(self.done) + 1
        elapsed = time.perf_counter() - self.t0
        left = self.eta()
        eta = f"ETA {_minutes(left)}" if left is not None else "ETA after the first program"
        return (f"[leaderboard {i}/{len(self.stages)}, {_minutes(elapsed)} elapsed, {eta}] "
                f"{stage.setting.name}: {stage.host} {stage.kind}, {stage.replicas} replicas x "
                f"{stage.rounds} rounds")

    def finish(self, stage: Stage, seconds: float) -> None:
        stage.seconds = seconds
        self.done.append(stage)


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def _same_config(out: str, config) -> Optional[Dict[str, Any]]:
    """The summary of a finished run in `out` of exactly this configuration, or None."""
    from deltafl_jax.outputs.directory import RunReader
    path = os.path.join(out, "summary.json")
    if not os.path.exists(path):
        return None
    summary = RunReader(out).summary()
    want = json.loads(json.dumps(config.flat(), default=str))
    have = json.loads(json.dumps(summary.get("config", {}), default=str))
    drop = ("overwrite", "verbose", "tensorboard")
    return summary if ({k: v for k, v in want.items() if k not in drop}
                       == {k: v for k, v in have.items() if k not in drop}) else None


def _run(config, data, log) -> Tuple[List[Any], Dict[str, Dict[str, float]]]:
    """(labels, final metrics) of a program: read back when its directory holds a finished run
    of this configuration, else trained."""
    from deltafl_jax import run_experiment
    from deltafl_jax.replicas.labels import ReplicaLabel
    done = None if config.output.overwrite else _same_config(config.output.output_dir, config)
    if done is not None:
        log("[round -] read back: a finished run of this configuration")
        return [ReplicaLabel.from_json(d) for d in done["replicas"]], done["final"]
    result = run_experiment(config, data, log=log)
    return [ReplicaLabel.from_json(d) for d in result.summary["replicas"]], result.final


def run_lr(setting: Setting, stage: Stage, tune_seeds, lr_grid, log) -> None:
    """Step 1: FedAvg's learning rate (smallest terminal train loss, mean over seeds)."""
    from deltafl_jax import run_experiment
    from deltafl_jax.studies import tuning
    config = dataclasses.replace(setting.base, algorithm=tuning.LR_ALGORITHM, thetas=(),
                                 seeds=tune_seeds,
                                 output_dir=stage.out, l2_reg=setting.base.l2_for(1)[0])
    reps = tuning.lr_grid_replicas(config, lr_grid, (config.training.lr_decay,))
    done = None if config.output.overwrite else _same_config(stage.out, config)
    if done is not None:
        log("[round -] read back: a finished run of this configuration")
    final = done["final"] if done is not None else run_experiment(
        config, setting.data, log=log, replicas=reps).final
    scores = tuning.scores(reps, final, "train_loss_mean")
    win = tuning.best(scores)
    if win is None:
        raise cli.UsageError(f"{setting.name}: every learning rate diverged")
    setting.learning_rate = float(win.point["learning_rate"])
    setting.lr_scores = {f"{s.point['learning_rate']:g}": s.mean for s in scores}


def run_method(setting: Setting, stage: Stage, tune_seeds, log) -> None:
    """A host's validation grid (on the validation split) or its final runs."""
    from deltafl_jax.studies import leaderboard as lb
    from deltafl_jax.studies import tuning
    seeds = tune_seeds if stage.kind == "validation" else setting.base.training.seeds
    config = _config(setting, stage.host, stage.kind, seeds)
    data = (tuning.validation_split(setting.data, 0) if stage.kind == "validation"
            else setting.data)
    labels, final = _run(config, data, log)
    points = lb.per_point(labels, final, stage.host)
    entry = setting.results.setdefault(stage.host, {})
    entry[stage.kind] = points


def _quiet(prefix: str):
    """A program's log reduced to its evaluation lines (their first part) and warnings."""
    def log(line: str) -> None:
        first = (line.splitlines() or [""])[0]
        if first.startswith(("[round", "warning", "resuming")):
            print(prefix + first.split(" | ")[0], flush=True)
    return log


def run_all(settings: List[Setting], tune_seeds, multipliers) -> None:
    all_stages = []
    grids = {}
    for s in settings:
        lr_grid = tuple(s.base.training.learning_rate * m for m in multipliers)
        grids[s.name] = lr_grid
        all_stages += stages(s, tune_seeds, lr_grid)
    clock = Clock(all_stages)
    for stage in all_stages:
        print(clock.line(stage), flush=True)
        log = _quiet(f"  {stage.host} {stage.kind}: ")
        t0 = time.perf_counter()
        if stage.kind == "lr":
            run_lr(stage.setting, stage, tune_seeds, grids[stage.setting.name], log)
            print(f"  learning rate {stage.setting.learning_rate:g} (FedAvg's smallest terminal "
                  f"train loss)", flush=True)
        else:
            run_method(stage.setting, stage, tune_seeds, log)
        clock.finish(stage, time.perf_counter() - t0)
    print(f"[leaderboard] done in {_minutes(time.perf_counter() - clock.t0)}", flush=True)


# --------------------------------------------------------------------------------------------
# The record, the tables, the figures


def _chosen_text(name: str, point: Dict[str, float]) -> str:
    from deltafl_jax.algorithms import registry
    from deltafl_jax.algorithms.naming import PLATFORM_SYMBOLS
    spec = registry.get(name)
    symbols = {s.flag: s.symbol or s.flag for s in spec.sweeps()}
    symbols["thetas"] = "θ"
    return ", ".join(f"{symbols.get(k, PLATFORM_SYMBOLS.get(k, k))} = {v:g}"
                     for k, v in point.items())


KEEP = ("test_error_mean", "test_error_p90", "test_error_worst10", "test_error_std",
        "test_share_below_target", "train_loss_mean")


def _slim(points: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    return {k: {m: v[m] for m in ("point", "seeds") + KEEP if m in v} for k, v in points.items()}


def method_record(setting: Setting, name: str) -> Dict[str, Any]:
    """One method's part of the setting's record (its chosen point and every final point)."""
    from deltafl_jax.studies import leaderboard as lb
    from deltafl_jax.algorithms import registry
    host, value = lb.host_of(name)
    got = setting.results[host]
    spec = registry.get(host)
    final = _slim(got["final"])
    if value is not None:        # a method that joins the host's program: its one point
        key = lb.point_key({spec.sweep.flag: value})
        return {"name": name, "display": registry.get(name).display_name, "grid": {},
                "chosen": key, "chosen_text": "", "validation_p90": None,
                "final": {key: final[key]}}
    own = {k: v for k, v in final.items()
           if v["point"].get(spec.sweep.flag) not in _joined_values(setting, host)}
    validation = got.get("validation")
    chosen = (lb.choose(validation, loss_limit=lb.loss_limit_of(setting.data.num_classes))
              if validation else next(iter(own)))
    if chosen is None:
        chosen = next(iter(own))
    tuned = validation is not None
    for entry in own.values():
        entry["text"] = _chosen_text(host, entry["point"]) if setting.grids[host] else ""
    return {"name": name, "display": spec.display_name,
            "grid": {k: list(v) for k, v in setting.grids[host].items()},
            "chosen": chosen,
            "chosen_text": _chosen_text(host, own[chosen]["point"]) if tuned else "",
            "validation_p90": (float(sum(validation[chosen][lb.CHOICE_METRIC])
                                     / len(validation[chosen][lb.CHOICE_METRIC]))
                               if tuned else None),
            "validation": _slim(validation) if tuned else {},
            "final": own}


def record(setting: Setting, tune_seeds) -> Dict[str, Any]:
    base, data = setting.base, setting.data
    return {
        "name": setting.name, "title": setting.title, "flagfile": f"experiments/{setting.name}"
        ".flags", "dataset": data.name, "model": base.training.model,
        "train_clients": data.train.num_clients, "test_clients": data.test.num_clients,
        "clients_per_round": base.training.clients_per_round,
        "num_rounds": base.training.num_rounds,
        "seeds": list(base.training.seeds), "tune_seeds": list(tune_seeds),
        "grid": "quick" if setting.quick else "full",
        "learning_rate": setting.learning_rate or base.training.learning_rate,
        "lr_scores": setting.lr_scores,
        "methods": [method_record(setting, m) for m in setting.methods],
    }


def setting_markdown(rec: Dict[str, Any]) -> str:
    from deltafl_jax.studies import leaderboard as lb
    grids = "; ".join(f"{m['display']}: " + ", ".join(
        f"{k} ∈ {{{', '.join(f'{v:g}' for v in vals)}}}" for k, vals in m["grid"].items())
        for m in rec["methods"] if m["grid"])
    return "\n".join([
        f"## {rec['title']}", "",
        f"`{rec['flagfile']}`: {rec['dataset']} / {rec['model']}, {rec['train_clients']} train "
        f"/ {rec['test_clients']} test clients, m = {rec['clients_per_round']}, "
        f"{rec['num_rounds']} rounds, learning rate {rec['learning_rate']:g} (FedAvg's), seeds "
        f"{', '.join(map(str, rec['seeds']))}. Test error in %, mean over seeds ± the "
        f"half-width of the 95% t-interval over seeds; each method at the grid point with the "
        f"smallest validation p90 ({rec['grid']} grids: {grids}).", "",
        lb.table_markdown(rec), "",
        "Pareto frontier of every method and grid point (test error mean, p90 in %): "
        + "; ".join(f"{p['method']}{' ' + p['text'] if p['text'] else ''} "
                    f"({p['mean']:.2f}, {p['p90']:.2f})"
                    for p in lb.pareto(lb.frontier_points(rec))) + ".", "",
        "![trade-off](frontier.png)", ""])


def write(settings: List[Setting], tune_seeds) -> List[Dict[str, Any]]:
    from deltafl_jax.studies import leaderboard as lb
    records = []
    for s in settings:
        rec = record(s, tune_seeds)
        os.makedirs(s.out, exist_ok=True)
        with open(os.path.join(s.out, "leaderboard.json"), "w") as f:
            json.dump(rec, f, indent=1)
        with open(os.path.join(s.out, "leaderboard.md"), "w") as f:
            f.write(setting_markdown(rec))
        lb.frontier_figure(rec, os.path.join(s.out, "frontier.png"))
        records.append(rec)
    with open(os.path.join(FLAGS.out, "leaderboard.md"), "w") as f:
        f.write("# Tail leaderboard\n\n" + "\n".join(
            setting_markdown(r).replace("](frontier.png)", f"]({r['name']}/frontier.png)")
            for r in records))
    return records


def write_readme(records: List[Dict[str, Any]]) -> str:
    """The tables between their markers in the repository's page that holds them
    (docs/results/leaderboard.md; or --readme_path), and the records they are made from into
    experiments/leaderboard_results/ (next to --readme_path's experiments/ for another page),
    which tests/test_leaderboard.py renders and compares with the page. Returns the pages
    written."""
    from deltafl_jax.studies import leaderboard as lb
    from experiments import pages
    if FLAGS.readme_path:
        paths, root = [FLAGS.readme_path], os.path.dirname(os.path.abspath(FLAGS.readme_path))
    else:
        paths, root = [], REPO
        for rec in records:
            marker = f"<!-- leaderboard: {rec['name']} -->"
            held = pages.pages_holding(marker)
            if not held:
                raise cli.UsageError(f"--readme: no page of README.md or docs/ holds '{marker}'")
            paths += [p for p in held if p not in paths]
    results = os.path.join(root, "experiments", "leaderboard_results")
    os.makedirs(results, exist_ok=True)
    for rec in records:
        with open(os.path.join(results, f"{rec['name']}.json"), "w") as f:
            json.dump(rec, f, indent=1)
    for path in paths:
        with open(path) as f:
            text = f.read()
        for rec in records:
            if FLAGS.readme_path or f"<!-- leaderboard: {rec['name']} -->" in text:
                try:
                    text = lb.replace_block(text, rec)
                except ValueError as e:
                    raise cli.UsageError(f"--readme: {path}: {e}") from None
        with open(path, "w") as f:
            f.write(text)
    return ", ".join(os.path.relpath(p, REPO) if not FLAGS.readme_path else p for p in paths)


# --------------------------------------------------------------------------------------------


# The leaderboard's mark on its --out folder (written before its first program runs).
MARKER = "deltafl_leaderboard.json"


def _board_before_markers(path: str, names: List[str]) -> bool:
    """A leaderboard written before :data:`MARKER` existed: only ``leaderboard.md`` and
    folders named after settings, at least one of which holds a setting's files."""
    known = {n for names_ in SETS.values() for n in names_}
    folders = [n for n in names if n in known and os.path.isdir(os.path.join(path, n))]
    return bool(folders) and all(n == "leaderboard.md" or n in folders for n in names)


def _check_out(settings: List[Setting]) -> None:
    """A setting whose leaderboard is already written in --out is refused without
    --overwrite (one line, before anything runs). The programs of an interrupted one are read
    back when their configuration is the same (a different one is refused when reached).
    --out must be absent, empty or a leaderboard's (:data:`MARKER`), and not in use by another
    process (:mod:`deltafl_jax.run.lock`)."""
    from deltafl_jax.outputs.directory import command_dir_state
    from deltafl_jax.run.lock import check_free
    if os.path.exists(FLAGS.out) and not os.path.isdir(FLAGS.out):
        raise cli.UsageError(f"--out={FLAGS.out} exists and is not a directory")
    for s in settings:
        done = os.path.join(s.out, "leaderboard.json")
        if os.path.exists(done) and not FLAGS.overwrite:
            raise cli.UsageError(f"--out={FLAGS.out} already holds the leaderboard of {s.name} "
                                 f"({done}); pass --overwrite or choose another --out")
    state = command_dir_state(FLAGS.out, MARKER, _board_before_markers)
    if state.kind == "other":
        shown = ", ".join(state.foreign[:4]) + (
            f" and {len(state.foreign) - 4} more" if len(state.foreign) > 4 else "")
        raise cli.UsageError(f"--out={FLAGS.out} is not a folder of experiments.leaderboard "
                             f"(it holds {shown} and no {MARKER}); choose a new or empty "
                             f"folder, so that no file of yours is replaced (--overwrite "
                             f"replaces a leaderboard, never other files)")
    check_free(FLAGS.out, "--out")


def run_and_write(settings: List[Setting], tune_seeds, multipliers) -> List[Dict[str, Any]]:
    """The leaderboard's programs and files, with --out locked and marked as the
    leaderboard's for the whole time."""
    from deltafl_jax.outputs.directory import mark_command_dir
    from deltafl_jax.run.lock import locked
    with locked(FLAGS.out, "--out", log=lambda line: print(line, flush=True)):
        _check_out(settings)   # as it is now that it is ours
        mark_command_dir(FLAGS.out, MARKER, "experiments.leaderboard")
        run_all(settings, tune_seeds, multipliers)
        return write(settings, tune_seeds)


ESTIMATE_ROUNDS = 2   # --estimate_exact's timed rounds per program unless --estimate_rounds
CALIBRATION_ROUNDS = 3   # --estimate's timed rounds per measured program (and at least:)
CALIBRATION_SECONDS = 1.0


def _program(setting: Setting, stage: Stage, tune_seeds, lr_grid):
    """(config, data, replicas) of a program as the run builds it (no output directory)."""
    from deltafl_jax.studies import tuning
    if stage.kind == "lr":
        config = dataclasses.replace(setting.base, algorithm=tuning.LR_ALGORITHM, thetas=(),
                                     seeds=tune_seeds, output_dir=None,
                                     l2_reg=setting.base.l2_for(1)[0])
        return config, setting.data, tuning.lr_grid_replicas(config, lr_grid,
                                                             (config.training.lr_decay,))
    seeds = tune_seeds if stage.kind == "validation" else setting.base.training.seeds
    config = dataclasses.replace(_config(setting, stage.host, stage.kind, seeds),
                                 output_dir=None)
    data = (tuning.validation_split(setting.data, 0) if stage.kind == "validation"
            else setting.data)
    return config, data, None


def estimate(settings: List[Setting], tune_seeds, multipliers) -> None:
    """Per setting, two programs built, compiled and timed (:func:`deltafl_jax.run.estimate.
    calibration_programs`), every other one projected from their costs per local step, per
    loss-evaluated and per evaluated example and its own work counts, counted on the host
    (:func:`~deltafl_jax.run.estimate.program_work`, :func:`~deltafl_jax.run.estimate.project`).
    With --estimate_exact every program is built, compiled and timed for a round or two and
    one evaluation (a program the same as one already measured is not compiled again). Their
    sum."""
    from deltafl_jax.run.estimate import total_lines
    estimates, cache = [], {}
    for s in settings:
        lr_grid = tuple(s.base.training.learning_rate * m for m in multipliers)
        programs = [(stage, *_program(s, stage, tune_seeds, lr_grid))
                    for stage in stages(s, tune_seeds, lr_grid)]
        for est in (_exact(s, programs, cache) if FLAGS.estimate_exact
                    else _projected(s, programs)):
            print("\n".join(est.lines()), flush=True)
            estimates.append(est)
    print("\n".join(total_lines(estimates)), flush=True)


def _exact(setting: Setting, programs, cache):
    """Every program measured (:func:`deltafl_jax.run.estimate.estimate_run`; `cache`: its
    programs already measured)."""
    from deltafl_jax.run.estimate import estimate_run
    rounds = (FLAGS.estimate_rounds if "estimate_rounds" in cli.COMMAND_LINE
              else ESTIMATE_ROUNDS)
    for stage, config, data, replicas in programs:
        est = estimate_run(config, data, replicas=replicas, timed_rounds=rounds,
                           min_seconds=0.0, cache=cache)
        yield dataclasses.replace(est, name=f"{setting.name} {stage.host} {stage.kind}")


def _projected(setting: Setting, programs):
    """The setting's calibration programs measured, the others projected from them."""
    from deltafl_jax.run.estimate import (calibration_programs, estimate_run, program_work,
                                          project)
    rounds = (FLAGS.estimate_rounds if "estimate_rounds" in cli.COMMAND_LINE
              else CALIBRATION_ROUNDS)
    works = [program_work(config, data, replicas) for _, config, data, replicas in programs]
    chosen = calibration_programs([p[0].host for p in programs], works)
    measured = {}
    for i in chosen:
        stage, config, data, replicas = programs[i]
        est = estimate_run(config, data, replicas=replicas, timed_rounds=rounds,
                           min_seconds=CALIBRATION_SECONDS)
        measured[i] = dataclasses.replace(est, name=f"{setting.name} {stage.host} {stage.kind}")
    calibrations = [(measured[i], works[i]) for i in chosen]
    for i, (stage, *_) in enumerate(programs):
        yield (dataclasses.replace(measured[i], name=measured[i].name + " (measured)")
               if i in measured else project(f"{setting.name} {stage.host} {stage.kind}",
                                             works[i], calibrations))


def default_tune_seeds(settings: List[Setting]) -> Tuple[int, ...]:
    """The tuning seeds without --tune_seeds: the final runs' seeds on the cpu set (a grid
    point one of whose seeds diverges is then seen and passed over), seed 1 elsewhere."""
    return tuple(settings[0].base.training.seeds) if FLAGS.set == "cpu" else (1,)


def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {' '.join(argv[1:])!r} (flags look like --name=value)")
    from deltafl_jax import ConfigError, DataError
    args = list(ARGS)
    try:
        cli.start_backend()
        multipliers = cli.floats("lr_multipliers", FLAGS.lr_multipliers) or (1.0,)
        if any(not math.isfinite(m) or m <= 0 for m in multipliers):
            raise cli.UsageError(f"--lr_multipliers must be finite and > 0, got "
                                 f"{','.join(FLAGS.lr_multipliers)}")
        settings = plan(args)
        tune_seeds = cli.ints("tune_seeds", FLAGS.tune_seeds) or default_tune_seeds(settings)
        if FLAGS.estimate:
            estimate(settings, tune_seeds, multipliers)
            return
        _check_out(settings)
        records = run_and_write(settings, tune_seeds, multipliers)
        print(f"wrote {os.path.join(FLAGS.out, 'leaderboard.md')} and, per setting, "
              f"leaderboard.json, leaderboard.md, frontier.png", flush=True)
        if FLAGS.readme:
            print(f"wrote the tables into {write_readme(records)}", flush=True)
    except (cli.UsageError, ConfigError, DataError) as e:
        cli.fail(str(e))


ARGS: List[str] = []   # the command line, re-read after each setting's flagfile


def parse_flags_or_fail(argv):
    """cli's parsing, keeping the command line for :func:`plan`; --out's default is this
    command's own, whichever command defined the flag (experiments.report defines it too)."""
    ARGS[:] = list(argv)
    FLAGS.set_default("out", OUT_DEFAULT)
    return cli.parse_flags_or_fail(argv)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags_or_fail)
