"""Progress output of a run: a line per evaluation, a live bar on a terminal, a closing table.

Each evaluation line names its metrics: the alpha-weighted mean training loss and the
unweighted mean and 90th percentile of the per-client test error (paper, App. C.2.3), each the
mean over the seeds of a swept value. When the evaluation samples its clients
(``--eval_clients``, :mod:`deltafl_jax.evaluation.sample`) the summaries carry ``KEY_lo`` /
``KEY_hi`` and the 90th percentile is followed by its interval, e.g. ``p90 41.2% [38.0,
44.9]`` (with several seeds, the means over the seeds of each seed's bounds). The tail
metrics follow (:mod:`deltafl_jax.evaluation.metrics`): ``worst10`` the mean error of the worst 10% of
the test clients (with its interval on a sampled evaluation), ``std`` the std of the client
errors, ``acc<0.5`` the share of test clients below the target accuracy. On a terminal a
bar with rounds done, rounds per second and the ETA (and, on the virtual clock, the virtual
time, e.g. ``virtual 12.4 min [12.1, 12.8]``) is redrawn after every round. The run
ends with a table of the final test error (mean, p90 and the tail metrics) per swept value
and the output directory. A part of a replica's state that is not finite (the round's state
check, :mod:`deltafl_jax.run.divergence`) is a warning line the first time, naming the round,
the replica and the part.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, List, Optional, TextIO

import numpy as np

from deltafl_jax.algorithms import registry
from deltafl_jax.rounds import NONFINITE
from deltafl_jax.run.callbacks import Callback, Evaluation, RunContext
from deltafl_jax.run.divergence import part_text


def count(n: int, word: str) -> str:
    """'1 seed', '3 seeds'."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"

def coordinates(label, theta: str = "θ") -> str:
    """A replica's coordinates as progress lines show them
    (:meth:`~deltafl_jax.replicas.labels.ReplicaLabel.coordinates`), its algorithm's spec saying
    whether the swept value is named: 'θ=0.5', 'qffl_q=0.1', 'server_lr=0.03' (FedAvg).
    `theta`: how θ is written ("theta" in a multi-method run's closing table)."""
    spec = registry.find(label.algorithm)
    return label.coordinates(theta, spec is None or spec.reporting.names_value)


def interval_text(summary, key: str, rows, scale: float = 1.0, digits: int = 1) -> str:
    """' [lo, hi]' of `key` (means over `rows` of each bound, times `scale`), or '' when the
    summaries carry no interval for it. An infinite bound (too few sampled clients) shows as
    -inf / inf."""
    lo, hi = f"{key}_lo", f"{key}_hi"
    if lo not in summary or hi not in summary:
        return ""
    a, b = (scale * float(np.mean(np.asarray(summary[k], np.float64)[rows])) for k in (lo, hi))
    return f" [{a:.{digits}f}, {b:.{digits}f}]"


def personal_families(summary) -> List[str]:
    """The personalised evaluation's families in a summary ('seen', 'unseen_ft5', ...; none
    without --client_holdout), unseen first, by adaptation steps."""
    names = {k[:-len("_error_worst10")] for k in summary if k.endswith("_error_worst10")
             and k.partition("_")[0] in ("seen", "unseen")}
    steps = sorted({0 if "_ft" not in n else int(n.rsplit("_ft", 1)[1]) for n in names})
    return [n for k in steps for n in (("unseen", "seen") if k == 0 else
                                       (f"unseen_ft{k}", f"seen_ft{k}")) if n in names]


def personal_text(summary, rows, classify: bool) -> str:
    """', unseen(ft5) p90 31.0% w10 40.2%, seen(ft5) p90 ...' for the most adapted family of
    each population (means over `rows`), or '' without a personalised evaluation."""
    names = personal_families(summary)
    if not names:
        return ""
    scale, unit, digits = (100.0, "%", 1) if classify else (1.0, "", 3)
    out = []
    for population in ("unseen", "seen"):
        name = [n for n in names if n.split("_ft")[0] == population][-1]
        shown = name.replace("_ft", "(ft") + (")" if "_ft" in name else "")
        p90, w10 = (scale * float(np.mean(np.asarray(summary[f"{name}_error_{k}"])[rows]))
                    for k in ("p90", "worst10"))
        out.append(f"{shown} p90 {p90:.{digits}f}{unit} w10 {w10:.{digits}f}{unit}")
    return ", " + ", ".join(out)


def tail_text(summary, rows, classify: bool, target: Optional[float] = None) -> str:
    """' worst10 48.2% [40.1, 55.0] std 20.1% acc<0.5 12%' (means over `rows`): the tail
    metrics of :mod:`deltafl_jax.evaluation.metrics` when the summaries have them, else ''."""
    if "test_error_worst10" not in summary:
        return ""
    scale, unit, digits = (100.0, "%", 1) if classify else (1.0, "", 3)
    w10, sd = (float(np.mean(np.asarray(summary[k], np.float64)[rows]))
               for k in ("test_error_worst10", "test_error_std"))
    text = (f" worst10 {scale * w10:.{digits}f}{unit}"
            f"{interval_text(summary, 'test_error_worst10', rows, scale, digits)}"
            f" std {scale * sd:.{digits}f}{unit}")
    if "test_share_below_target" in summary:
        share = float(np.mean(np.asarray(summary["test_share_below_target"], np.float64)[rows]))
        text += f" acc<{target:g} {100 * share:.0f}%" if target is not None else \
            f" below target {100 * share:.0f}%"
    return text


def evaluation_line(run: RunContext, ev: Evaluation) -> str:
    classify = run.view.facts.classify
    config = getattr(run.view.facts, "config", None)
    target = config.evaluation.target_accuracy if config is not None else None
    parts = []
    for name, rs in run.view.names.columns:
        loss = np.mean(ev.summary["train_loss_mean"][rs])
        err, p90 = (np.mean(ev.summary[k][rs]) for k in ("test_error_mean", "test_error_p90"))
        tail = (f"test err mean {100 * err:.1f}% p90 {100 * p90:.1f}%"
                f"{interval_text(ev.summary, 'test_error_p90', rs, 100.0, 1)}" if classify
                else f"test loss mean {err:.3f} p90 {p90:.3f}"
                f"{interval_text(ev.summary, 'test_error_p90', rs, 1.0, 3)}")
        tail += tail_text(ev.summary, rs, classify, target)
        tail += personal_text(ev.summary, rs, classify)
        if "dp_epsilon" in ev.summary:   # client-level DP: the privacy spent so far
            tail += f", ε {float(np.max(ev.summary['dp_epsilon'][rs])):.3g}"
        parts.append(f"{name}: train loss {loss:.3f}, {tail}")
    T = run.num_rounds
    done = ev.round - run.start_round
    eta = ev.elapsed_s / max(done, 1) * (T - ev.round)
    return (f"[round {ev.round:>{len(str(T))}}/{T}] {ev.elapsed_s:7.1f}s elapsed, ETA "
            f"{eta:6.0f}s{virtual_text(ev.summary)} | " + " | ".join(parts))


def virtual_text(summary) -> str:
    """', virtual 1.25 h': the virtual clock at the evaluation (the seeds' mean; with their
    range when they differ), in s, min or h, or '' without one."""
    if "virtual_time" not in summary:
        return ""
    v = np.asarray(summary["virtual_time"], np.float64)
    top = float(v.max())
    scale, unit = (1.0, "s") if top < 120 else (60.0, "min") if top < 7200 else (3600.0, "h")
    v = v / scale
    lo, hi = float(v.min()), float(v.max())
    spread = f" [{lo:.3g}, {hi:.3g}]" if hi > lo else ""
    return f", virtual {float(v.mean()):.3g} {unit}{spread}"


def bar_text(round: int, T: int, rate: float, eta: float, metrics) -> str:
    """The live bar after round `round` of `T`: its fill, rounds/s, the ETA and, on the
    virtual clock, the virtual time at the end of the round (the round's ``virtual_time``
    metric [R], as :func:`virtual_text` shows it)."""
    width = 24
    fill = int(width * round / T)
    return (f"[{'#' * fill}{'.' * (width - fill)}] round {round}/{T}, {rate:.2f} rounds/s, "
            f"ETA {eta:.0f}s{virtual_text(metrics)} ")


# The closing table's tail columns (deltafl_jax.evaluation.metrics), when every final has them.
TAIL_COLUMNS = (("test_error_worst10", "worst 10%"), ("test_error_std", "std"),
                ("test_share_below_target", "below tgt"))


def _tail_cell(key: str, values, scale: float, unit: str) -> str:
    """One tail column's cell: the mean over seeds (a share always in %)."""
    if key == "test_share_below_target":
        scale, unit = 100.0, "%"
    return f" {scale * float(np.mean(values)):10.2f}{unit or ' '}"


def error_table(rows, first: str = "replicas", classify: bool = True) -> List[str]:
    """Final test error (mean over seeds) per row: rows = [(name, [final metrics of each
    seed])]. When the metrics carry the p90's interval (sampled evaluation), a last column
    shows it (means over the seeds of each bound)."""
    scale, unit = (100.0, "%") if classify else (1.0, "")
    what = "test error" if classify else "test loss"
    width = max([28] + [len(name) for name, _ in rows])
    ci = any("test_error_p90_lo" in f for _, finals in rows for f in finals)
    tails = [(k, head) for k, head in TAIL_COLUMNS
             if all(k in f for _, finals in rows for f in finals)]
    if not classify:
        tails = [(k, head) for k, head in tails if k != "test_share_below_target"]
    lines = [f"{first:<{width}} {what + ' mean':>16} {what + ' p90':>15}"
             + "".join(f" {head:>11}" for _, head in tails) + "  seeds"
             + ("  p90 interval" if ci else "")]
    for name, finals in rows:
        mean = np.mean([f["test_error_mean"] for f in finals])
        p90 = np.mean([f["test_error_p90"] for f in finals])
        extra = ""
        if ci:
            bounds = {k: np.asarray([f.get(k, np.nan) for f in finals], np.float64)
                      for k in ("test_error_p90_lo", "test_error_p90_hi")}
            extra = " " + interval_text(bounds, "test_error_p90", slice(None), scale, 2)
        cells = "".join(_tail_cell(k, [f[k] for f in finals], scale, unit) for k, _ in tails)
        lines.append(f"{name:<{width}} {scale * mean:15.2f}{unit} {scale * p90:14.2f}{unit}"
                     f"{cells}  " + (f"{len(finals):<5}{extra}" if ci else f"{len(finals)}"))
    return lines


def closing_table(result, names, classify: bool = True) -> List[str]:
    """Final test error per swept value (mean over seeds) of each column of `names`
    (:class:`~deltafl_jax.replicas.labels.ReplicaNames`); with a personalised evaluation, then its
    table (:func:`personal_table`)."""
    rows = [(name, [result.final[names.keys[r]] for r in rs]) for name, rs in names.columns]
    return error_table(rows, "replicas", classify) + personal_table(rows, classify)


def personal_table(rows, classify: bool = True) -> List[str]:
    """Mean, p90 and worst-10% held-out error per family (unseen devices after k adaptation
    steps, seen clients) per row, means over the seeds; [] without a personalised evaluation."""
    names = personal_families(rows[0][1][0]) if rows and rows[0][1] else []
    if not names:
        return []
    scale, unit = (100.0, "%") if classify else (1.0, "")
    width = max([28] + [len(name) for name, _ in rows])
    lines = ["Held-out error of unseen devices after k adaptation steps and of seen clients "
             "(mean over seeds):",
             f"{'replicas':<{width}} {'clients':<12} {'k':>3} {'mean':>9} {'p90':>9} "
             f"{'worst 10%':>10}"]
    for name, finals in rows:
        for fam in names:
            population, _, k = fam.partition("_ft")
            vals = [scale * np.mean([f[f"{fam}_error_{m}"] for f in finals])
                    for m in ("mean", "p90", "worst10")]
            lines.append(f"{name:<{width}} {population:<12} {k or '0':>3} "
                         + " ".join(f"{v:8.2f}{unit}" for v in vals[:2])
                         + f" {vals[2]:9.2f}{unit}")
    return lines


def _cohort(config, facts) -> str:
    """m, or under Poisson sampling its expectation and the plan's slots."""
    if config.sampling.sampler == "poisson":
        return f"{config.training.clients_per_round} expected ({facts.num_sampled} slots, Poisson)"
    if config.sampling.sampler == "cyclic":
        return f"{facts.num_sampled} (cyclic groups)"
    return str(facts.num_sampled)


class Progress(Callback):
    """Progress lines through `log`; a live bar on `stream` when it is a terminal."""

    def __init__(self, log: Callable[[str], None] = print, stream: Optional[TextIO] = None,
                 bar: Optional[bool] = None):
        self.log = log
        self.stream = stream if stream is not None else sys.stderr
        self.bar = bar if bar is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = time.perf_counter()   # on_run_start starts it again
        self._reported = set()
        self._bar_width = 0

    def on_run_start(self, run: RunContext) -> None:
        self._t0 = time.perf_counter()
        facts = run.view.facts
        config = facts.config
        server = ("" if config.server.is_default
                  else f" with server {config.server.describe()}")
        self.log(f"deltafl_jax: {facts.dataset} ({facts.train_clients} train / "
                 f"{facts.test_clients} test clients), model {facts.model}, "
                 f"{config.algorithm}{server}, {count(len(run.view.names), 'replica')} "
                 f"({count(len(config.training.seeds), 'seed')}), m={_cohort(config, facts)}, "
                 f"{count(facts.lanes, 'client lane')} per step, backend {facts.backend}")
        self.log(facts.placement_line)
        if facts.accounting is not None:
            acc = facts.accounting
            zs = ", ".join(f"{z:.4g}" for z in dict.fromkeys(acc.noise))
            privacy = config.privacy
            clip = (f"clip adaptive from C_0={privacy.initial_clip:g} toward the "
                    f"{privacy.clip_quantile:g} quantile" if privacy.adaptive
                    else f"clip C={privacy.initial_clip:g}")
            if acc.sampler == "poisson":
                how = (f"Poisson sampling, q={acc.m / acc.population:.4g}, cap {acc.cap}; "
                       f"add-or-remove, {acc.accountant.upper()}")
            elif acc.correlated is not None:
                c = acc.correlated
                how = (f"cyclic groups, a client every {c.min_sep} rounds; "
                       + (f"BandMF with {len(c.coef)} bands" if len(c.coef) > 1 else
                          "independent noise") + f", add-or-remove, {acc.accountant.upper()}")
            else:
                how = "sampled without replacement, replace-one"
            self.log(f"privacy: {clip}, noise multiplier z = {zs}; "
                     f"epsilon at delta={acc.delta:.3g} for m={acc.m} of {acc.population} "
                     f"clients a round ({how})")

    def on_round_end(self, run: RunContext, round: int, metrics) -> None:
        self._nonfinite_lines(run, round, metrics)
        if not self.bar:
            return
        T, done = run.num_rounds, round - run.start_round
        elapsed = time.perf_counter() - self._t0
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (T - round) / rate if rate > 0 else float("nan")
        self._bar_line(bar_text(round, T, rate, eta, metrics))

    def _nonfinite_lines(self, run: RunContext, round: int, metrics) -> None:
        """A warning the first time each part of a replica's state is not finite (the round's
        ``nonfinite_<part>`` metrics, :mod:`deltafl_jax.run.divergence`)."""
        config = run.view.facts.config
        stops = config is not None and bool(config.training.stop_on_divergence)
        for key, counts in metrics.items():
            if not key.startswith(NONFINITE):
                continue
            part = key[len(NONFINITE):]
            for r in np.flatnonzero(np.asarray(counts) > 0):
                key = run.view.names.keys[r]
                if (key, part) in self._reported:
                    continue
                self._reported.add((key, part))
                self._clear_bar()
                self.log(f"warning: round {round}, replica {key}: "
                         f"{part_text(part, int(counts[r]))} is not finite; "
                         + ("--stop_on_divergence stops it" if stops else
                            "it trains on (--stop_on_divergence stops it) and the metrics "
                            "computed from a non-finite model are NaN"))

    def _bar_line(self, text: str) -> None:
        """Redraw the bar as `text`, blanking what a longer previous bar left."""
        self.stream.write("\r" + text.ljust(self._bar_width))
        self._bar_width = len(text)
        self.stream.flush()

    def _clear_bar(self):
        if self.bar:
            self.stream.write("\r" + " " * max(72, self._bar_width) + "\r")
            self._bar_width = 0
            self.stream.flush()

    def on_evaluation(self, run: RunContext, evaluation: Evaluation) -> None:
        self._clear_bar()
        self.log(evaluation_line(run, evaluation))
        s = evaluation.summary["train_loss_mean"]
        bad = [r for r in range(s.shape[0]) if not np.isfinite(s[r])]
        if bad:
            keys = run.view.names.keys
            self.log(f"warning: the training loss of {len(bad)} replica(s) is not finite "
                     f"({', '.join(keys[r] for r in bad)})")

    def on_run_end(self, run: RunContext, result) -> None:
        self._clear_bar()
        if result.stopped or not result.final:
            return
        if run.end_reason:
            self.log(f"deltafl_jax: run ended: {run.end_reason}")
        what = "test error" if run.view.facts.classify else "test loss"
        self.log("\n".join([f"Final per-client {what} (mean over seeds):"]
                           + closing_table(result, run.view.names,
                                           run.view.facts.classify)))
        if run.output_dir:
            self.log(f"results in {run.output_dir} (metrics.jsonl, summary.json, rounds.npz, "
                     f"clients.npz, models/); report: python -m experiments.report "
                     f"{run.output_dir} --out=DIR")
