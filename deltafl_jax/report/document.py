"""The report itself: :func:`write_report` puts ``report.md`` (conventions, tables, runs,
notes, figures), the PNG figures and the CSV files into one directory. This is what
``python -m experiments.report`` runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.evaluation.metrics import PERCENTILE_METHODS
from deltafl_jax.report import figures
from deltafl_jax.report.availability import (SHARE_NOTE, availability_families,
                                             availability_figure, share_table, tail_table,
                                             family_text, uniform_note, uniform_rate)
from deltafl_jax.report.io import Run
from deltafl_jax.report.partition import partition_figure
from deltafl_jax.report.rows import tidy_rows, write_csv
from deltafl_jax.report.speed_drops import DROP_NOTE, drop_table
from deltafl_jax.report.tables import (BEST_NOTE, INTERVAL_NOTE, STD_NOTE, TABLES, Column,
                                       available, best_columns, columns, markdown_table,
                                       personal_tables, runs_table, settings)
from deltafl_jax.report.virtual_time import virtual_time_figure

CONVENTIONS = {
    "lower": "the **lower weighted quantile**: the smallest client value whose cumulative "
             "weight reaches the level (the rule of the filter's η; with weights n_k it is "
             "the reference code's v[ceil(N p) − 1] on values repeated n_k times)",
    "linear": "**NumPy's linear interpolation** (`np.percentile`, method 'linear'), "
              "*unweighted* for the train losses too, as the reference scripts computed it",
}
CSV_FILES = (("final", "final.csv"), ("clients", "clients.csv"), ("curves", "curves.csv"),
             ("kept", "kept_clients.csv"))
FILES_SECTION = [
    "## Files", "",
    "- `final.csv`: one row per replica (method, seed) with the final metrics above.",
    "- `clients.csv`: one row per replica and client: split, client id, number of "
    "examples, final loss and error (re-plot Figs. 4–5 from it).",
    "- `curves.csv`: one row per replica and evaluation round (Figs. 6–11).",
    "- `kept_clients.csv`: one row per replica and round: clients kept, updates "
    "rejected (Fig. 16).", ""]

Figure = Tuple[str, str, str]   # (setting, caption, file name)
CLOCK_FIGURE = "virtual_time_error_"   # the error against virtual time, then the drop table
AVAILABILITY_FIGURE = "availability_error_"   # then the tail by availability quintile


def slug(text: str) -> str:
    """A file-name fragment: 'synthetic / linear' -> 'synthetic_linear'."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "run"


def run_notes(runs: Sequence[Run], percentile: str = "lower") -> List[str]:
    """'RUN: note' for what each run lacks, for datasets without classes, and for a sampled
    evaluation's percentiles under ``--percentile=linear``."""
    notes: List[str] = []
    for run in runs:
        notes.extend(f"{run.name}: {n}" for n in run.notes)
        if run.sampled() and percentile != "lower":
            notes.append(f"{run.name}: evaluated a sample of clients (--eval_clients); its "
                         f"percentiles are the sample's lower quantiles whatever --percentile "
                         f"(the convention of their confidence intervals)")
        if run.summary.get("dataset", {}).get("num_classes", 1) == 0:
            notes.append(f"{run.name}: the dataset has no classes; its 'error' columns are not "
                         "misclassification errors")
    return notes


def paged(name: str, k: int, count: int) -> str:
    """'fig5_scatter_x.png' -> 'fig5_scatter_x_p2.png' for the k-th (0-based) of several pages."""
    return name if count == 1 else name.replace(".png", f"_p{k + 1}.png")


def grid_figures(sc: Sequence[Column], name: str, percentile: str):
    """Figs. 4, 12 and 5, each on as many pages as the methods need
    (:data:`~deltafl_jax.report.figures.PAGE_METHODS`), a page's caption naming its methods."""
    out = []
    styles = figures.method_styles([c.label for c in sc])
    for kind, draw, file, caption in (
            ("histogram", lambda cs: figures.histogram_figure(cs, "test", "error", percentile,
                                                              styles),
             f"fig4_hist_test_error_{name}.png",
             "Fig. 4: histogram of the per-client test misclassification error"),
            ("histogram", lambda cs: figures.histogram_figure(cs, "train", "loss", percentile,
                                                              styles),
             f"fig12_hist_train_loss_{name}.png",
             "Figs. 12–13: histogram of the per-client train loss (α-weighted)"),
            ("scatter", lambda cs: figures.scatter_figure(cs, styles), f"fig5_scatter_{name}.png",
             "Fig. 5: train loss and test error per client against its number of examples")):
        chunks = figures.pages(sc, figures.PAGE_METHODS[kind])
        for k, chunk in enumerate(chunks):
            part = f" (page {k + 1} of {len(chunks)}: {chunk[0].label} to {chunk[-1].label})" \
                if len(chunks) > 1 else ""
            out.append((draw(chunk), paged(file, k, len(chunks)), caption + part))
    return out


def round_figures(sc: Sequence[Column], name: str, percentile: str, notes: List[str]):
    """Figs. 6-11 and 16: one figure per kind of round (synchronous rounds, asynchronous server
    steps: :func:`~deltafl_jax.report.figures.round_axis`), never both on one axis; notes the
    missing curves."""
    setting = sc[0].setting
    no_curves = [c.label for c in sc
                 if figures.curve_data(c, "train_loss_mean", percentile) is None]
    if no_curves:
        why = ("neither clients_history.npz nor metrics.jsonl" if percentile == "lower" else
               f"no clients_history.npz to recompute {percentile} percentiles from")
        notes.append(f"{setting}: no curves for {', '.join(no_curves)} ({why})")
    styles = figures.method_styles([c.label for c in sc])
    groups: Dict[str, List[Column]] = {}
    for c in sc:
        groups.setdefault(figures.round_axis(c), []).append(c)
    out = []
    for axis, cols in groups.items():
        tail = "" if axis == figures.ROUND_AXIS or len(groups) == 1 else "_server_steps"
        what = ("" if axis == figures.ROUND_AXIS else
                " (asynchronous methods: against server steps, apart from synchronous rounds)")
        if any(c.label not in no_curves for c in cols):
            out.append((figures.curves_figure(cols, percentile, axis, styles),
                        f"fig6_curves_{name}{tail}.png",
                        "Figs. 6–11: train loss and test error over "
                        f"{'rounds' if axis == figures.ROUND_AXIS else 'server steps'}{what}"))
        if any(figures.kept_data(c) is not None for c in cols):
            out.append((figures.kept_figure(cols, axis, styles),
                        f"fig16_kept_clients_{name}{tail}.png",
                        ("Fig. 16: clients kept per round" if axis == figures.ROUND_AXIS else
                         "Fig. 16: updates aggregated per server step") + what))
    return out


def setting_figures(sc: Sequence[Column], setting: str, percentile: str, notes: List[str]):
    """(figure, file name, caption) of one setting's figures; notes the missing curves."""
    name = slug(setting)
    out = grid_figures(sc, name, percentile) + round_figures(sc, name, percentile, notes)
    personal = figures.personal_figure(sc, percentile)
    if personal is not None:
        out.append((personal, f"personal_held_out_error_{name}.png",
                    "Held-out error (mean, p90, worst 10%) of unseen devices and seen clients "
                    "(--client_holdout), of the model each is served"
                    + (", without and after adaptation" if any(
                        "_ft" in f for f in figures.personal_families(sc)) else "")))
    by_availability = availability_figure(sc)
    if by_availability is not None:
        rate = uniform_rate(sc)
        if rate is not None:
            notes.append(uniform_note(setting, rate))
        out.append((by_availability, f"{AVAILABILITY_FIGURE}{name}.png",
                    "The error (mean, p90, worst 10%) by availability quintile of the clients"
                    if rate is None else "The error (mean, p90, worst 10%) of all clients: "
                    "the availability is the same for every client, no quintiles"))
    by_clock = virtual_time_figure(sc, percentile)
    if by_clock is not None:
        out.append((by_clock, f"{CLOCK_FIGURE}{name}.png",
                    "The test error (mean, p90) against virtual time (the clients' device "
                    "speeds, deadline and over-selection)"))
    by_partition = partition_figure(sc)
    if by_partition is not None:
        out.append((by_partition, f"partition_clients_classes_{name}.png",
                    "The partition: each client's examples per class (clients × classes)"))
    if sc[0].run.dataset == "gaussian_toy":
        means = sc[0].run.config.get("data", {}).get("toy_means")
        out.append((figures.mixture_figure(sc, means, {c.label: model_point(c) for c in sc}),
                    f"fig3_mixtures_{name}.png",
                    "Fig. 3: the models, the loss over every mixture of the clients and its "
                    "histogram over mixtures of conformity ≥ θ"))
    return out


def model_point(col: Column):
    """The saved model w of a column (the mean-estimation model's point), mean over seeds,
    or None when the run saved no models."""
    from deltafl_jax.errors import DeltaFLError
    from deltafl_jax.outputs.directory import RunFormatError
    from deltafl_jax.outputs.serving import load_model

    points = []
    for run, reps in col.parts:
        for r in reps:
            lab = run.labels[r]
            extra = {lab.param_name: lab.param_value} if lab.param_name else {}
            try:
                served = load_model(run.path,
                    theta=None if extra else lab.theta, seed=lab.seed, **extra)
            except (DeltaFLError, RunFormatError, OSError, ValueError):
                return None
            w = np.asarray(served.params.get("w")) if "w" in served.params else None
            if w is None or w.shape != (2,):
                return None
            points.append(w)
    return np.mean(points, axis=0) if points else None


def save_figures(cols: Sequence[Column], out_dir: str, percentile: str, dpi: int,
                 notes: List[str], drawn: Optional[Dict[str, Any]] = None) -> List[Figure]:
    """Every setting's figures as PNG files in `out_dir`; `drawn` (when given) receives each
    matplotlib Figure under its file name."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    saved: List[Figure] = []
    for setting in settings(cols):
        sc = [c for c in cols if c.setting == setting]
        for fig, name, caption in setting_figures(sc, setting, percentile, notes):
            FigureCanvasAgg(fig)
            fig.savefig(os.path.join(out_dir, name), dpi=dpi)
            saved.append((setting, caption, name))
            if drawn is not None:
                drawn[name] = fig
    return saved


@contextlib.contextmanager
def staged(out_dir: str):
    """A fresh directory beside `out_dir` to write a report into: when the block ends, its
    files are moved into `out_dir` (made if needed, files of the same names replaced); when
    it raises, the staging directory and any parent directory made for it are removed, so a
    report that fails leaves no folder behind, and an existing `out_dir` is left as it was."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    missing, p = [], parent
    while not os.path.exists(p):
        missing.append(p)
        p = os.path.dirname(p)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in missing:              # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise
    os.makedirs(out_dir, exist_ok=True)
    for name in sorted(os.listdir(tmp)):
        os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    os.rmdir(tmp)


def conventions_section(runs: Sequence[Run], cols: Sequence[Column], percentile: str
                        ) -> List[str]:
    seeds = sorted({len(c.seeds) for c in cols})
    return [
        "# Δ-FL report", "",
        f"{len(runs)} run(s); {len(cols)} method column(s); "
        f"{'/'.join(map(str, seeds))} seed(s) per column. Final models (end of each run's "
        f"round budget).", "",
        "## Conventions", "",
        "- **Train losses** F_k are weighted by α_k ∝ n_k over the training clients (mean "
        "and percentiles); they include (λ/2)‖w‖² when λ > 0.",
        "- **Test errors** (misclassification rates) are unweighted over the test clients.",
        f"- **Percentiles** use {CONVENTIONS[percentile]}"
        + (" (`--percentile=linear` gives NumPy's linear interpolation, as the reference "
           "scripts)." if percentile == "lower" else "."),
        "- **Tail metrics**: the worst 10% is the mean error of the worst 10% of the test "
        "clients, the boundary client counted in part (the superquantile at 0.9; PropFair's "
        "and pFL-Bench's mean of the floor(0.1 N) worst is the same when 0.1 N is whole); the "
        "std is over the test clients (ddof = 0); the share below target counts the test "
        "clients whose accuracy is below the run's `--target_accuracy`.",
        "- Every number is recomputed from the per-client arrays (`clients.npz`, "
        "`clients_history.npz` for the curves), not read from `metrics.jsonl`.",
        f"- Cells are **{STD_NOTE}**; the lowest mean of each row is in bold. Δ-FL at "
        "θ = 1 is FedAvg and is labelled so.", ""]


SAMPLED_NOTE = ("A run that evaluated a **sample of clients** (`--eval_clients`, K per split "
                "each evaluation) is reported from its sample: its cells are the sample's "
                "estimates, its histograms and scatter plots show the clients of its last "
                "evaluation's sample (training clients drawn with probability α_k ∝ n_k, with "
                "replacement, each draw weighing 1/K; test clients drawn uniformly), and "
                "`clients.csv` has one row per sampled client and draw.")


def markdown(runs: Sequence[Run], cols: Sequence[Column], percentile: str,
             skipped: Sequence[str], notes: Sequence[str], saved: Sequence[Figure],
             best: bool = False) -> str:
    """The text of report.md."""
    md = conventions_section(runs, cols, percentile)
    if best:
        md[-1:-1] = [f"- {BEST_NOTE}"]
    if percentile == "lower" and any(c.interval(spec.metric) is not None
                                     for c in cols for spec in TABLES):
        md[-1:-1] = [f"- {INTERVAL_NOTE}"]
    if any(run.sampled() for run in runs):
        md[-1:-1] = [f"- {SAMPLED_NOTE}"]
    for spec in TABLES:
        if available(cols, spec.metric, percentile):
            md += [f"## {spec.title}", "", f"Cells: {STD_NOTE}.", "",
                   markdown_table(cols, spec, percentile), ""]
    for spec in personal_tables(cols):   # the runs that made a personalised evaluation
        have = [c for c in cols if spec.metric in c.run.final(percentile)]
        md += [f"## {spec.title}", "", f"Cells: {STD_NOTE}.", "",
               markdown_table(have, spec, percentile), ""]
    md += ["## Runs", "", runs_table(runs), ""]
    if skipped or notes:
        md += ["## Skipped runs and notes", ""]
        md += [f"- {s}" for s in skipped] + [f"- {n}" for n in notes] + [""]
    md += ["## Figures", ""]
    for setting, caption, name in saved:
        md += [f"**{setting}. {caption}.**", "", f"![{caption}]({name})", ""]
        if name.startswith(CLOCK_FIGURE):
            drops = drop_table([c for c in cols if c.setting == setting])
            md += [] if drops is None else [f"{DROP_NOTE}", "", drops, ""]
        if name.startswith(AVAILABILITY_FIGURE):
            md += tail_section([c for c in cols if c.setting == setting])
    md += updates_section(cols)
    return "\n".join(md + FILES_SECTION)


TAIL_NOTE = ("The tail by availability quintile: the 90th percentile and the worst-10% mean "
             "of the error of each quintile's clients (q1 the least available fifth, with the "
             "quintile's mean rate; % mean over seeds, [min, max] over seeds), as the figure "
             "above draws them.")


def tail_section(cols: Sequence[Column]) -> List[str]:
    """The tables of the tail by availability quintile, one per family, beside the availability
    figure; [] when the availability is the same for every client (its quintiles would split
    the clients by index: :func:`~deltafl_jax.report.availability.uniform_rate`)."""
    if uniform_rate(cols) is not None:
        return []
    out: List[str] = []
    for family in availability_families(cols):
        table = tail_table(cols, family)
        if table is not None:
            out += [f"*{family_text(family)}.* {TAIL_NOTE}", "", table, ""]
    return out


def setup_of(run: Run) -> Dict[str, str]:
    """What a report row may pool that changes what its numbers mean: the round budget,
    synchronous rounds or asynchronous server steps, the availability and the device speeds."""
    cfg = run.config
    asynchronous = any(figures.asynchronous(lab.algorithm) for lab in run.labels)
    return {"rounds": f"{cfg.get('num_rounds', '?')} "
                      f"{'server steps' if asynchronous else 'rounds'}",
            "availability": f"availability {cfg.get('availability', 'none')}",
            "speeds": f"device speeds {cfg.get('client_speed', 'none')}"}


def pooled_notes(cols: Sequence[Column]) -> List[str]:
    """A note per row (setting) whose runs differ in set-up (:func:`setup_of`): what differs
    and which runs have which, since the row's cells and figures put them side by side."""
    notes: List[str] = []
    for setting in settings(cols):
        runs = {run.path: run for c in cols if c.setting == setting for run, _ in c.parts}
        setups = {run.name: setup_of(run) for run in runs.values()}
        parts = []
        for key in ("rounds", "availability", "speeds"):
            by_value: Dict[str, List[str]] = {}
            for name, setup in setups.items():
                by_value.setdefault(setup[key], []).append(name)
            if len(by_value) > 1:
                parts.append("; ".join(f"{v} ({named(n)})" for v, n in by_value.items()))
        if parts:
            notes.append(f"{setting}: pools runs of different set-ups in one row (its tables "
                         f"and figures): " + " | ".join(parts))
    return notes


def named(names: Sequence[str], most: int = 3) -> str:
    """'a, b, c and 4 more' of run names (sorted)."""
    names = sorted(names)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def updates_section(cols: Sequence[Column]) -> List[str]:
    """The asynchronous runs' updates by availability quintile, a table per setting
    (:func:`deltafl_jax.report.availability.share_table`); [] when no run has them."""
    out: List[str] = []
    for setting in dict.fromkeys(c.setting for c in cols):
        table = share_table([c for c in cols if c.setting == setting])
        if table is not None:
            out += [f"**{setting}.** {SHARE_NOTE}", "", table, ""]
    return ["## Updates by availability quintile", "", *out] if out else []


def write_report(runs: Sequence[Run], out_dir: str, percentile: str = "lower",
                 skipped: Sequence[str] = (), dpi: int = 110,
                 log: Optional[Callable[[str], None]] = None,
                 best: bool = False) -> Dict[str, Any]:
    """Write report.md, the PNG figures and the CSV files into `out_dir`. With `best`, the
    tables and figures show each baseline at its best swept value by test p90, marked
    (:func:`deltafl_jax.report.tables.best_columns`); the CSV files keep every value.

    The files are written into a staging directory beside `out_dir` and moved into it once
    all are written (:func:`staged`): a report that fails leaves `out_dir` as it was (and
    makes no folder).

    Returns {"report": path, "figures": [paths], "csv": [paths], "notes": [lines],
    "drawn": {figure file name: matplotlib Figure}}.
    """
    if percentile not in PERCENTILE_METHODS:
        raise ValueError(f"percentile must be one of {', '.join(PERCENTILE_METHODS)}")
    if not runs:
        raise ValueError("no run to report")
    log = log or (lambda s: None)
    every = columns(runs)
    cols = best_columns(every, percentile) if best else every
    notes = run_notes(runs, percentile) + pooled_notes(cols)
    drawn: Dict[str, Any] = {}
    with staged(out_dir) as tmp:
        saved = save_figures(cols, tmp, percentile, dpi, notes, drawn)
        for kind, name in CSV_FILES:
            write_csv(os.path.join(tmp, name), tidy_rows(every, kind, percentile))
        with open(os.path.join(tmp, "report.md"), "w") as f:
            f.write(markdown(runs, cols, percentile, skipped, notes, saved, best))
    for n in notes:
        log(f"note: {n}")
    return {"report": os.path.join(out_dir, "report.md"),
            "figures": [os.path.join(out_dir, f[2]) for f in saved],
            "csv": [os.path.join(out_dir, name) for _, name in CSV_FILES], "notes": notes,
            "drawn": drawn}
