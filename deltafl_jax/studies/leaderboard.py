r"""The tail leaderboard: every method of the registry that applies to a dataset, tuned by the
papers' protocol, on the same clients, minibatches and seeds; one table and one figure per
dataset. ``python -m experiments.leaderboard`` is its command-line front end.

A method is on the leaderboard when its spec has a :class:`~deltafl_jax.algorithms.leaderboard.
Board` that applies to the dataset. For one dataset (a *setting*):

1. **Learning rate** (App. C.2.2, as :func:`deltafl_jax.studies.tuning.tune_lr_step`): FedAvg is
   trained at every rate of a grid on all the training clients; the smallest terminal
   alpha-weighted mean training loss wins, and every method uses that rate.
2. **Each method's own parameters** (its board's grid, crossed: q, mu, t, theta, c, eps, a
   server learning rate, ...): the whole grid x the tuning seeds is ONE program, trained on
   half of the training clients and evaluated on the other half (the validation clients,
   :func:`deltafl_jax.studies.tuning.validation_split`); the grid point with the smallest 90th
   percentile of the validation error (mean over seeds) is chosen. A method with at most one
   grid point skips this step.
3. **Final runs**: the whole grid x the seeds is ONE program on the training clients,
   evaluated on the held-out test clients. A method that joins another's program
   (``Board.joins``: FedAvg is Delta-FL at theta = 1) is a point of that program. The table
   shows each method at its chosen point; the figure shows every point (the trade-off
   between the mean and the tail).

Everything here is a pure function of configurations and results; the command decides the
settings, runs the programs (with progress and an ETA) and writes the files.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.algorithms import registry
from deltafl_jax.algorithms.leaderboard import BoardSetting
from deltafl_jax.declared import finite_in
from deltafl_jax.errors import ConfigError

if TYPE_CHECKING:
    from deltafl_jax.run.config import ExperimentConfig

SERVER_LR = "server_lr"
METRICS = (("test_error_mean", "mean"), ("test_error_p90", "p90"),
           ("test_error_worst10", "worst 10%"), ("test_error_std", "std"))
CHOICE_METRIC = "test_error_p90"


# --------------------------------------------------------------------------------------------
# Which methods, and their grids


def board_methods(setting: BoardSetting, names: Optional[Sequence[str]] = None) -> List[str]:
    """The registry names of the leaderboard's methods on `setting`, in registry order: every
    spec with a board that applies, or the given `names` (ConfigError, one line, for a name
    that is not a leaderboard method or does not apply). A method that joins another's
    program brings that one along."""
    if names is None:
        boards = {n: spec.reporting.leaderboard for n, spec in registry.SPECS.items()}
        return [n for n, board in boards.items()
                if board is not None and not board.why_not(setting)]
    out = []
    for name in names:
        spec = registry.get(name)
        if spec.reporting.leaderboard is None:
            raise ConfigError(f"--methods: {name} is not a leaderboard method (its spec has no "
                              f"leaderboard Board: a control or a variant of another method)")
        why = spec.reporting.leaderboard.why_not(setting)
        if why:
            raise ConfigError(f"--methods: {name} does not apply to {setting.dataset} / "
                              f"{setting.model}: {why}")
        out.append(name)
    return out


def host_of(name: str) -> Tuple[str, Optional[float]]:
    """(the program a method runs in, its swept value there, or None for its own grid)."""
    joins = registry.get(name).reporting.leaderboard.joins
    return (joins[0], float(joins[1])) if joins is not None else (name, None)


def check_grid(name: str, grid: Mapping[str, Sequence[float]]) -> Dict[str, Tuple[float, ...]]:
    """The grid of method `name` checked: each flag is its swept flag, a cross flag or
    server_lr, each value in range (the sweep's own check); ConfigError otherwise."""
    spec = registry.get(name)
    sweeps = {s.flag: s for s in spec.sweeps()}
    out = {}
    for flag, values in grid.items():
        if flag == SERVER_LR:
            if spec.own_server_step:
                raise ConfigError(f"{name}'s grid lists server_lr, but {spec.own_server_step}")
            vals = tuple(float(v) for v in values)
            if not vals or not all(finite_in(v, 0.0, low_open=True) for v in vals):
                raise ConfigError(f"{name}: --server_lr values must be finite and > 0, got "
                                  f"{list(values)}")
            out[flag] = vals
        elif flag in sweeps:
            out[flag] = sweeps[flag].check(values)
        else:
            raise ConfigError(f"{name}'s leaderboard grid names --{flag}, which is not one of "
                              f"its swept flags ({', '.join(sweeps)}) or server_lr")
    return out


def grid_config(base: ExperimentConfig, name: str, grid: Mapping[str, Sequence[float]], seeds: Sequence[int],
                output_dir: Optional[str], extra_values: Sequence[float] = ()):
    """The configuration that trains method `name` over `grid` (plus `extra_values` of its
    swept flag: the methods that join its program) x `seeds` in one program, from the
    setting's `base` configuration; checked by the spec (ConfigError for a bad value)."""
    spec = registry.get(name)
    sweeps = dict(base.sweeps)
    own = spec.sweep.flag
    values = tuple(grid.get(own, ())) + tuple(v for v in extra_values
                                              if v not in grid.get(own, ()))
    thetas = base.thetas
    for flag, vals in grid.items():
        if flag not in (SERVER_LR, own, "thetas"):
            sweeps[flag] = tuple(vals)
    if own == "thetas":
        thetas = values or (1.0,)
    else:
        sweeps[own] = values
        thetas = ()
    options = {f: base.options[f] for f in spec.option_flags() if f in base.options}
    l2 = base.training.l2_reg
    training = dataclasses.replace(base.training, seeds=tuple(seeds),
                                   l2_reg=base.l2_for(1)[0] if isinstance(l2, tuple) else l2)
    server = dataclasses.replace(
        base.server, learning_rates=tuple(grid.get(SERVER_LR, base.server.learning_rates)))
    output = dataclasses.replace(base.output, output_dir=output_dir, save_models=False)
    return dataclasses.replace(base, algorithm=name, thetas=thetas, sweeps=sweeps,
                               options=options, training=training, server=server, output=output)


# --------------------------------------------------------------------------------------------
# Points of a grid and their scores


def point_of(label, spec_name: str) -> Dict[str, float]:
    """The grid coordinates of a replica label: {flag: value} of its swept value (theta as
    ``thetas``) and its further coordinates (``server_lr``, cross flags)."""
    name, value = label.swept()
    flag = registry.get(spec_name).sweep.flag if name == "theta" else name
    return {flag: float(value), **{k: float(v) for k, v in label.extra}}


def point_key(point: Mapping[str, float]) -> str:
    """'fedmgda_epsilon=0.1,server_lr=1' (sorted flags; the key of a point in the JSON)."""
    return ",".join(f"{k}={v:g}" for k, v in sorted(point.items()))


def per_point(labels, final: Mapping[str, Mapping[str, float]], spec_name: str
              ) -> Dict[str, Dict[str, Any]]:
    """point key -> {"point", "seeds", metric -> [per seed]} from a program's final metrics."""
    out: Dict[str, Dict[str, Any]] = {}
    for lab in labels:
        point = point_of(lab, spec_name)
        entry = out.setdefault(point_key(point), {"point": point, "seeds": []})
        entry["seeds"].append(int(lab.seed))
        for metric, value in final[lab.key()].items():
            entry.setdefault(metric, []).append(float(value))
    return out


def diverged_seeds(entry: Mapping[str, Any], metric: str = CHOICE_METRIC,
                   loss_limit: Optional[float] = None) -> List[bool]:
    """Per seed of a point's entry (:func:`per_point`): whether that seed diverged, i.e. its
    `metric` is not finite, or its terminal mean training loss (``train_loss_mean``, where the
    entry has it) is not finite or exceeds `loss_limit` (None: no limit; the leaderboard passes
    log C, the cross-entropy of the uniform prediction over C classes: a model that ends
    worse on its own training clients than predicting uniformly has gone astray)."""
    losses = entry.get("train_loss_mean") or [0.0] * len(entry[metric])
    out = []
    for value, loss in zip(entry[metric], losses):
        astray = not math.isfinite(loss) or (loss_limit is not None and loss > loss_limit)
        out.append(not math.isfinite(value) or astray)
    return out


def choose(scores: Mapping[str, Mapping[str, Any]], metric: str = CHOICE_METRIC,
           loss_limit: Optional[float] = None) -> Optional[str]:
    """The point key with the smallest mean of `metric` over seeds among the points none of
    whose seeds diverged (:func:`diverged_seeds`); when every point has a diverged seed, the
    points with the fewest diverged seeds compete on the mean over their other seeds. Ties
    go to the first in grid order; None when every seed of every point diverged."""
    best, key = (math.inf, math.inf), None
    for k, entry in scores.items():
        bad = diverged_seeds(entry, metric, loss_limit)
        kept = [v for v, b in zip(entry[metric], bad) if not b]
        rank = (sum(bad), float(np.mean(kept)) if kept else math.inf)
        if kept and rank < best:
            best, key = rank, k
    return key


def loss_limit_of(num_classes: Optional[int]) -> Optional[float]:
    """log C, the loss of the uniform prediction over C >= 2 classes (None otherwise)."""
    return math.log(num_classes) if num_classes and num_classes >= 2 else None


# --------------------------------------------------------------------------------------------
# Tables and figures from the JSON record of a setting


def seed_interval(values: Sequence[float], confidence: float = 0.95) -> Tuple[float, float]:
    """(mean, half-width of the Student-t interval of the mean over seeds, ddof = 1); the
    half-width is NaN for one seed."""
    from scipy import stats

    v = np.asarray(values, np.float64)
    if v.size < 2:
        return float(v.mean()), math.nan
    half = stats.t.ppf(0.5 + confidence / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
    return float(v.mean()), float(half)


def method_rows(record: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """One row per method of a setting's record at its chosen point, sorted by the test p90
    (mean over seeds; a diverged method last)."""
    rows = []
    for m in record["methods"]:
        final = m["final"][m["chosen"]]
        rows.append({"method": m["display"], "chosen": m["chosen_text"], "final": final,
                     "validation": m.get("validation_p90")})
    key = [float(np.mean(r["final"][CHOICE_METRIC])) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: (not math.isfinite(key[i]), key[i]))
    return [rows[i] for i in order]


def _cell(values: Sequence[float], best: bool) -> str:
    mean, half = seed_interval([100.0 * v for v in values])
    if not math.isfinite(mean):
        return "diverged"
    text = f"**{mean:.2f}**" if best else f"{mean:.2f}"
    return text if not math.isfinite(half) else f"{text} ± {half:.2f}"


def table_markdown(record: Mapping[str, Any]) -> str:
    """The leaderboard table of one setting: a row per method at its chosen point (and what
    was chosen, with its validation p90), columns mean, p90, worst 10% and std of the test
    error in %, each the mean over seeds ± the half-width of its 95% t-interval; the lowest
    mean of a column in bold."""
    rows = method_rows(record)
    head = ["method", "chosen on validation (val. p90)"] + [name for _, name in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    best = {}
    for metric, _ in METRICS:
        means = [np.mean(r["final"][metric]) for r in rows]
        finite = [m for m in means if math.isfinite(m)]
        best[metric] = round(100.0 * min(finite), 2) if finite else None
    for r in rows:
        val = "" if r["validation"] is None else f" ({100.0 * r['validation']:.2f})"
        cells = [r["method"], (r["chosen"] or "—") + val]
        for metric, _ in METRICS:
            mean = 100.0 * float(np.mean(r["final"][metric]))
            cells.append(_cell(r["final"][metric],
                               math.isfinite(mean) and round(mean, 2) == best[metric]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def frontier_points(record: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Every (method, grid point) of the final runs: mean and p90 of the test error in %
    (means over seeds), whether it is the method's chosen point."""
    out = []
    for m in record["methods"]:
        for key, entry in m["final"].items():
            out.append({"method": m["display"], "point": key, "text": entry.get("text", ""),
                        "chosen": key == m["chosen"],
                        "mean": 100.0 * float(np.mean(entry["test_error_mean"])),
                        "p90": 100.0 * float(np.mean(entry[CHOICE_METRIC]))})
    return out


def pareto(points: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """The points no other point beats on both the mean and the p90 (lower is better), by
    increasing mean."""
    ok = [p for p in points if math.isfinite(p["mean"]) and math.isfinite(p["p90"])]
    front = [p for p in ok if not any(q["mean"] <= p["mean"] and q["p90"] <= p["p90"]
                                      and (q["mean"] < p["mean"] or q["p90"] < p["p90"])
                                      for q in ok)]
    return sorted(front, key=lambda p: p["mean"])


def frontier_order(record: Mapping[str, Any]) -> List[str]:
    """The methods' display names in the report's order: FedAvg first, then the registry's
    order (:func:`deltafl_jax.algorithms.naming.method_order`), whatever the record's order."""
    from deltafl_jax.algorithms.naming import method_order
    methods = sorted(record["methods"], key=lambda m: method_order(m.get("name", "")))
    return list(dict.fromkeys(m["display"] for m in methods))


def frontier_figure(record: Mapping[str, Any], path: str, dpi: int = 110) -> str:
    """:func:`frontier_plot` of one setting, written to `path` (PNG)."""
    frontier_plot(record).savefig(path, dpi=dpi)
    return path


def frontier_plot(record: Mapping[str, Any]):
    """The trade-off figure of one setting (a matplotlib Figure): test error mean (x) against
    p90 (y), one point per method and grid point (the chosen ones large and outlined), the
    Pareto frontier dashed. Each method has its own colour and marker for any count of methods
    (:func:`deltafl_jax.report.figures.method_styles`, in :func:`frontier_order`); the legend
    sits beside the axes; a method whose chosen point coincides with an earlier one's is named
    '(same point as X)'. Each point's parameter is written beside it in the method's colour
    where it overlaps no other label or point
    (:func:`deltafl_jax.report.figures.place_labels`); the title lists those that found no
    room."""
    from deltafl_jax.report.figures import place_labels
    fig, ax, items, marks = frontier_axes(record)
    lost = place_labels(ax, [i[1:] for i in items], marks)
    if lost:            # say so in the title, and place them again on the new layout
        fig, ax, items, marks = frontier_axes(record, [f"{items[k][0]} {items[k][3]}"
                                                       for k in lost])
        place_labels(ax, [i[1:] for k, i in enumerate(items) if k not in lost], marks)
    return fig


def frontier_axes(record: Mapping[str, Any], lost: Sequence[str] = ()):
    """(figure, axes, labels [(method, x, y, text, colour)] chosen points first, marks [(x, y,
    radius in points)]) of :func:`frontier_plot` before its labels are placed; `lost`: the
    labels ('method parameter') named in the title for want of room."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from deltafl_jax.report.figures import method_styles, wrap_label

    points = frontier_points(record)
    methods = frontier_order(record)
    fig = Figure(figsize=(9.0, 5.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    styles = method_styles(methods)
    chosen: Dict[Tuple[float, float], str] = {}
    items, marks = [], []
    for name in methods:
        mine = [p for p in points if p["method"] == name and math.isfinite(p["p90"])]
        st = styles[name]
        named = next((p for p in mine if p["chosen"]), mine[0] if mine else None)
        if named is None:           # every point diverged: named in the legend only
            ax.scatter([], [], color=st.color, marker=st.marker, s=90, edgecolors="black",
                       label=f"{name} (diverged: not shown)")
        for p in mine:
            at = (round(p["mean"], 6), round(p["p90"], 6))
            label = None
            if p is named:
                label = name + (f" (same point as {chosen[at]})" if at in chosen else "")
                chosen.setdefault(at, name)
            ax.scatter(p["mean"], p["p90"], color=st.color, marker=st.marker,
                       s=90 if p["chosen"] else 26, zorder=3,
                       edgecolors="black" if p["chosen"] else "none", label=label)
            marks.append((p["mean"], p["p90"], 5.5 if p["chosen"] else 3.0))
            if p["text"]:
                items.append((name, p["mean"], p["p90"], p["text"], st.color, p["chosen"]))
    front = pareto(points)
    if len(front) > 1:
        ax.plot([p["mean"] for p in front], [p["p90"] for p in front], "k--", lw=0.8,
                zorder=2, label="Pareto frontier")
    ax.set_xlabel("test error, mean over clients (%)")
    ax.set_ylabel("test error, 90th percentile (%)")
    note = "\n" + wrap_label(f"no room to label: {', '.join(lost)}", 95) if lost else ""
    ax.set_title(wrap_label(f"{record['title']}: every method and parameter (large, outlined: "
                            f"chosen on validation)", 95) + note, fontsize=9)
    ax.grid(alpha=0.3)
    fig.legend(fontsize=7, loc="outside right upper", ncols=max(1, math.ceil(len(methods) / 26)))
    items.sort(key=lambda i: not i[5])
    return fig, ax, [i[:5] for i in items], marks


# --------------------------------------------------------------------------------------------
# The README's tables


def readme_block(record: Mapping[str, Any]) -> str:
    """The table of a setting as the README holds it, between its markers."""
    return (f"<!-- leaderboard: {record['name']} -->\n{table_markdown(record)}\n"
            f"<!-- /leaderboard -->")


def replace_block(readme: str, record: Mapping[str, Any]) -> str:
    """`readme` with the setting's block replaced (ValueError when its markers are missing)."""
    start = f"<!-- leaderboard: {record['name']} -->"
    if start not in readme:
        raise ValueError(f"README has no '{start}' marker")
    head, rest = readme.split(start, 1)
    _, tail = rest.split("<!-- /leaderboard -->", 1)
    return head + readme_block(record) + tail


def readme_table(readme: str, name: str) -> Optional[str]:
    """The table between the setting's markers in `readme`, or None."""
    start = f"<!-- leaderboard: {name} -->"
    if start not in readme:
        return None
    return readme.split(start, 1)[1].split("<!-- /leaderboard -->", 1)[0].strip()
