"""The report's figure of the test error against availability (a run given an availability
split, :mod:`deltafl_jax.evaluation.by_availability`).

The numbers are the run's own, as it wrote them: each replica's final
``{family}_avail_q{j}_error_{mean,p90,worst10}`` and ``{family}_avail_q{j}_rate_mean`` of
summary.json's "final" (the last evaluation's metrics.jsonl records); the per-client arrays do
not hold the clients' availability, so nothing is recomputed. A family is the test devices
(``test``), the seen clients (``seen``, ``--client_holdout``) or the unseen devices
(``unseen``), each also after k adaptation steps (``_ft{k}``).

An asynchronous run (FedBuff, FedAsync) with an availability model also writes, per quintile
of the training clients' availability, the sums of its per-client counts
(``train_avail_q{j}_{jobs_started,updates_aggregated,updates_stale}`` and
``train_avail_q{j}_rate_mean``; :func:`deltafl_jax.evaluation.by_availability.count_split`):
:func:`share_table` tables the share of the updates aggregated that came from each quintile
and the share of completed updates dropped as stale.
"""

from __future__ import annotations

import re
from typing import List, Optional, Sequence

import numpy as np

from deltafl_jax.evaluation.by_availability import QUINTILES
from deltafl_jax.report.figures import (error_limits, figure_title, legend_below,
                                        legend_layout, method_styles, new_figure,
                                        percent_axis, wrap_label)
from deltafl_jax.report.tables import Column

AVAILABILITY_STATS = (("mean", "mean"), ("p90", "p90"), ("worst10", "worst 10%"))
_FAMILY_KEY = re.compile(r"^((test|seen|unseen)(_ft(\d+))?)_avail_q1_error_mean$")
_WHO = {"test": "test devices", "seen": "seen clients (held-out data)",
        "unseen": "unseen devices (held-out data)"}


def availability_families(cols: Sequence[Column]) -> List[str]:
    """The families split by availability in the columns' runs, test devices first, then by
    adaptation steps, unseen devices before seen clients."""
    found = {}
    for c in cols:
        for run, reps in c.parts:
            for r in reps:
                for key in run.summary.get("final", {}).get(run.keys[r], {}):
                    m = _FAMILY_KEY.match(key)
                    if m:
                        found[m.group(1)] = (m.group(2) != "test", int(m.group(4) or 0),
                                             m.group(2) == "seen")
    return sorted(found, key=found.get)


def final_values(col: Column, key: str) -> Optional[np.ndarray]:
    """[S] the final value of `key` of each of the column's seeds (summary.json's "final"),
    or None when a seed has none."""
    out = []
    for run, reps in col.parts:
        final = run.summary.get("final", {})
        for r in reps:
            got = final.get(run.keys[r], {})
            if key not in got:
                return None
            out.append(float(got[key]))
    return np.asarray(out, np.float64)


def availability_data(col: Column, family: str, stat: str):
    """(mean rate [5], mean over seeds [5], min [5], max [5]) of the family's `stat` error per
    availability quintile (q1 the least available), or None when the column has none."""
    rates, values = [], []
    for j in range(1, QUINTILES + 1):
        v = final_values(col, f"{family}_avail_q{j}_error_{stat}")
        rate = final_values(col, f"{family}_avail_q{j}_rate_mean")
        if v is None or rate is None:
            return None
        values.append(v)
        rates.append(np.mean(rate))
    v = np.stack(values)
    return np.asarray(rates), v.mean(axis=1), v.min(axis=1), v.max(axis=1)


def quintile_ticks(rates: List[np.ndarray]) -> List[str]:
    """The x tick labels: 'q1' .. 'q5', with the quintile's mean rate below when every
    method's runs have the same ones."""
    names = [f"q{j}" for j in range(1, QUINTILES + 1)]
    if not rates or not all(np.allclose(r, rates[0], equal_nan=True) for r in rates):
        return names
    return [f"{n}\n{r:.3g}" if np.isfinite(r) else n for n, r in zip(names, rates[0])]


UNIFORM_RTOL = 1e-6


def uniform_rate(cols: Sequence[Column]) -> Optional[float]:
    """The rate every client has when the availability is the same for all (every quintile of
    every family and column has the same mean rate, to within :data:`UNIFORM_RTOL`): the
    quintiles are then a split by client index, not by availability; None otherwise (or when
    no column has the split)."""
    rates = [final_values(c, f"{family}_avail_q{j}_rate_mean")
             for family in availability_families(cols) for c in cols
             for j in range(1, QUINTILES + 1)]
    rates = np.concatenate([r for r in rates if r is not None] or [np.zeros(0)])
    rates = rates[np.isfinite(rates)]
    if rates.size == 0 or not np.allclose(rates, rates[0], rtol=UNIFORM_RTOL, atol=0.0):
        return None
    return float(rates[0])


def uniform_note(setting: str, rate: float) -> str:
    """The report's note of a setting whose availability is the same for every client."""
    return (f"{setting}: every client has the same availability ({rate:.3g}), so its "
            f"'quintiles' would split the clients by index, not by availability; the "
            f"availability figure shows one group of all clients")


def whole_data(col: Column, family: str, stat: str):
    """([1] mean over seeds, [1] min, [1] max) of the family's `stat` error over all its
    clients (summary.json's ``{family}_error_{stat}``), or None."""
    v = final_values(col, f"{family}_error_{stat}")
    return None if v is None else (v.mean()[None], v.min()[None], v.max()[None])


def draw_panel(ax, cols, family: str, stat: str, styles, uniform: bool) -> List[np.ndarray]:
    """One panel: a line per method over the quintiles (a point per method with its min/max
    whisker when `uniform`); returns the quintiles' mean rates of the methods drawn."""
    rates = []
    for j, c in enumerate(cols):
        st = styles[c.label]
        if uniform:
            got = (whole_data(c, family, stat)
                   if availability_data(c, family, stat) is not None else None)
            if got is not None:
                mean, lo, hi = got
                x = np.array([1.0 + 0.6 * ((j + 0.5) / len(cols) - 0.5)])
                ax.errorbar(x, mean, yerr=np.stack([mean - lo, hi - mean]), color=st.color,
                            marker=st.marker, linestyle="none", label=c.label, markersize=5,
                            capsize=2)
            continue
        got = availability_data(c, family, stat)
        if got is None:
            continue
        rate, mean, lo, hi = got
        rates.append(rate)
        x = np.arange(1, QUINTILES + 1)
        ax.plot(x, mean, color=st.color, marker=st.marker, linestyle=st.linestyle,
                label=c.label, markersize=4)
        ax.fill_between(x, lo, hi, color=st.color, alpha=0.2, linewidth=0)
    return rates


def availability_figure(cols: Sequence[Column]):
    """The error against availability: one row of panels per family, one column per
    statistic (mean, p90, worst-10% mean, in %), the x axis the availability quintile of the
    family's clients (q1 the least available, with its mean rate, under every row: the
    families' quintiles have rates of their own), a line per method in its style (mean over
    seeds, band min/max over seeds); None when no run has the split. When
    every client has the same availability (:func:`uniform_rate`) the quintiles mean nothing:
    one group of all clients instead, a point per method (whisker: min/max over seeds), and
    the title says why."""
    families = availability_families(cols)
    if not families:
        return None
    styles = method_styles([c.label for c in cols])
    rate = uniform_rate(cols)
    fig, axes = new_figure(len(families), len(AVAILABILITY_STATS), 11.0,
                           2.9 * len(families) + 1.0 +
                           legend_layout([c.label for c in cols], 11.0)[1])
    for f, family in enumerate(families):
        rates = []
        for s, (stat, name) in enumerate(AVAILABILITY_STATS):
            ax = axes[f][s]
            rates += draw_panel(ax, cols, family, stat, styles, rate is not None)
            percent_axis(ax.yaxis)
            error_limits(ax)
            ax.grid(alpha=0.3)
            ax.set_title(wrap_label(f"{family_text(family)}: {name}", 34), fontsize=9)
        axes[f][0].set_ylabel("error (%)", fontsize=8)
        for ax in axes[f]:
            if rate is None:
                ax.set_xticks(np.arange(1, QUINTILES + 1), quintile_ticks(rates), fontsize=8)
            else:
                ax.set_xticks([1.0], [f"all clients\n(rate {rate:.3g} each)"], fontsize=8)
                ax.set_xlim(0.5, 1.5)
    for ax in axes[-1]:
        ax.set_xlabel("availability quintile (mean rate)" if rate is None else
                      "one group: the availability is the same for every client", fontsize=8)
    legend_below(fig, *axes[0][0].get_legend_handles_labels())
    what = ("error by availability quintile (q1: least available; line: mean over seeds, "
            "band: min/max over seeds)") if rate is None else (
        f"error of all clients (every client's availability is {rate:.3g}: quintiles would "
        f"split them by index, not by availability; point: mean over seeds, whisker: min/max)")
    figure_title(fig, f"{cols[0].setting}: {what}")
    return fig


TAIL_STATS = (("p90", "p90"), ("worst10", "worst 10%"))


def tail_table(cols: Sequence[Column], family: str) -> Optional[str]:
    """The markdown table of the tail by availability quintile beside the figure: a row per
    method and tail statistic (p90, worst-10% mean) of the family's error, a column per
    quintile (% mean over seeds, [min, max] over seeds), the quintiles' mean rate in the header
    when every row has the same; None when no column has the split."""
    rows, rates = [], []
    for c in cols:
        for stat, name in TAIL_STATS:
            got = availability_data(c, family, stat)
            if got is None:
                continue
            rates.append(got[0])
            per_seed = np.stack([final_values(c, f"{family}_avail_q{j}_error_{stat}")
                                 for j in range(1, QUINTILES + 1)])          # [5, S]
            rows.append(f"| {c.label} | {name} | " +
                        " | ".join(percent_cell(v) for v in per_seed) + " |")
    if not rows:
        return None
    heads = [t.replace("\n", " (") + (")" if "\n" in t else "") for t in quintile_ticks(rates)]
    return "\n".join(["| method | statistic | " + " | ".join(heads) + " |",
                      "|---|---|" + "---|" * QUINTILES, *rows])


def family_text(family: str) -> str:
    """'unseen_ft5' -> 'unseen devices (held-out data), after 5 steps'."""
    population, _, k = family.partition("_ft")
    return _WHO[population] + (f", after {k} steps" if k else "")


AGGREGATED_KEY = "train_avail_q{j}_updates_aggregated"
STALE_KEY = "train_avail_q{j}_updates_stale"
RATE_KEY = "train_avail_q{j}_rate_mean"
SHARE_NOTE = ("Share of the updates aggregated by availability quintile of the training "
              "clients (an asynchronous run's updates aggregated from the quintile's clients "
              "over all its updates aggregated, at the last evaluation; q1 the least available "
              "fifth, with the quintile's mean availability; % mean over seeds, [min, max] "
              "over seeds; a fifth of the updates each when availability does not matter). "
              "Stale: the updates dropped as stale (--max_staleness) over the updates "
              "completed (aggregated or dropped), over every training client.")


def update_shares(col: Column):
    """([5] the quintiles' mean availability, [S, 5] each seed's share of the updates
    aggregated per quintile, [S] each seed's stale share of the completed updates) of a
    report column, or None when a run of it has no counts by availability quintile."""
    agg, stale, rates = [], [], []
    for j in range(1, QUINTILES + 1):
        a = final_values(col, AGGREGATED_KEY.format(j=j))
        d = final_values(col, STALE_KEY.format(j=j))
        r = final_values(col, RATE_KEY.format(j=j))
        if a is None or d is None or r is None:
            return None
        agg.append(a)
        stale.append(d)
        rates.append(np.mean(r))
    agg, stale = np.stack(agg, axis=1), np.stack(stale, axis=1)     # [S, 5]
    total = agg.sum(axis=1)
    done = total + stale.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = np.where(total[:, None] > 0, agg / np.maximum(total, 1)[:, None], np.nan)
        stale_share = np.where(done > 0, stale.sum(axis=1) / np.maximum(done, 1), np.nan)
    return np.asarray(rates), shares, stale_share


def columns_with(cols: Sequence[Column], values):
    """([(column, values(column))] for the columns where `values` gives a tuple whose first
    item is the quintiles' mean (availability, speed), that first column's mean, whether every
    column has the same); None when no column has values."""
    got = [(c, values(c)) for c in cols]
    got = [(c, g) for c, g in got if g is not None]
    if not got:
        return None
    first = got[0][1][0]
    return got, first, all(np.allclose(g[0], first, equal_nan=True) for _, g in got)


def share_table(cols: Sequence[Column]) -> Optional[str]:
    """The markdown table of :data:`SHARE_NOTE`: a row per method column with the counts
    (%, mean over seeds, the seeds' [min, max]), the quintiles' mean availability in the
    header when every row has the same; None when no column has them."""
    found = columns_with(cols, update_shares)
    if found is None:
        return None
    got, rates, same = found
    heads = [f"q{j + 1}" + (f" ({rates[j]:.3g})" if same and np.isfinite(rates[j]) else "")
             for j in range(QUINTILES)]
    lines = ["| method | " + " | ".join(heads) + " | stale |",
             "|---|" + "---|" * (QUINTILES + 1)]
    for col, (_, shares, stale) in got:
        cells = [percent_cell(shares[:, j]) for j in range(QUINTILES)]
        lines.append(f"| {col.label} | " + " | ".join(cells) + f" | {percent_cell(stale)} |")
    return "\n".join(lines)


def percent_cell(values) -> str:
    """'12.3 [10.1, 14.0]' (%) of per-seed fractions; '—' when none is finite."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return "—"
    if v.size == 1 or v.min() == v.max():
        return f"{100 * v.mean():.1f}"
    return f"{100 * v.mean():.1f} [{100 * v.min():.1f}, {100 * v.max():.1f}]"
