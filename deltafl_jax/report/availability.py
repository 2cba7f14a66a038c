"""The report's figure of the test error against availability (a run given an availability
split, :mod:`deltafl_jax.evaluation.availability`).

The numbers are the run's own, as it wrote them: each replica's final
``{family}_avail_q{j}_error_{mean,p90,worst10}`` and ``{family}_avail_q{j}_rate_mean`` of
summary.json's "final" (the last evaluation's metrics.jsonl records); the per-client arrays do
not hold the clients' availability, so nothing is recomputed. A family is the test devices
(``test``), the seen clients (``seen``, ``--client_holdout``) or the unseen devices
(``unseen``), each also after k adaptation steps (``_ft{k}``).

An asynchronous run (FedBuff, FedAsync) with an availability model also writes, per quintile
of the training clients' availability, the sums of its per-client counts
(``train_avail_q{j}_{jobs_started,updates_aggregated,updates_stale}`` and
``train_avail_q{j}_rate_mean``; :func:`deltafl_jax.evaluation.availability.count_split`):
:func:`share_table` tables the share of the updates aggregated that came from each quintile
and the share of completed updates dropped as stale.
"""

from __future__ import annotations

import re
import textwrap
from typing import List, Optional, Sequence

import numpy as np

from deltafl_jax.evaluation.availability import QUINTILES
from deltafl_jax.report.figures import method_styles, new_figure, percent_axis
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


def availability_figure(cols: Sequence[Column]):
    """The error against availability: one row of panels per family, one column per
    statistic (mean, p90, worst-10% mean, in %), the x axis the availability quintile of the
    family's clients (q1 the least available, with its mean rate), a line per method in its
    style (mean over seeds, band min/max over seeds); None when no run has the split."""
    families = availability_families(cols)
    if not families:
        return None
    styles = method_styles([c.label for c in cols])
    fig, axes = new_figure(len(families), len(AVAILABILITY_STATS), 11.0,
                           2.9 * len(families) + 0.8, sharex=True)
    x = np.arange(1, QUINTILES + 1)
    for f, family in enumerate(families):
        rates = []
        for s, (stat, name) in enumerate(AVAILABILITY_STATS):
            ax = axes[f][s]
            for c in cols:
                got = availability_data(c, family, stat)
                if got is None:
                    continue
                rate, mean, lo, hi = got
                rates.append(rate)
                st = styles[c.label]
                ax.plot(x, mean, color=st.color, marker=st.marker, linestyle=st.linestyle,
                        label=c.label, markersize=4)
                ax.fill_between(x, lo, hi, color=st.color, alpha=0.15, linewidth=0)
            percent_axis(ax.yaxis)
            ax.grid(alpha=0.3)
            ax.set_title(textwrap.fill(f"{family_text(family)}: {name}", 34), fontsize=9)
        axes[f][0].set_ylabel("error (%)", fontsize=8)
        for ax in axes[f]:
            ax.set_xticks(x, quintile_ticks(rates))
    for ax in axes[-1]:
        ax.set_xlabel("availability quintile (mean rate)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, fontsize=7, loc="outside right center")
    fig.suptitle(f"{cols[0].setting}: error by availability quintile (q1: least available; "
                 f"line: mean over seeds, band: min/max over seeds)", fontsize=10)
    return fig


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
