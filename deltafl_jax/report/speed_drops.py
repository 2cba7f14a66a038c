"""Which devices the deadline drops: the drop rate of a run on the virtual clock by the
training clients' compute-speed quintile, in all and by cause.

A run with ``--client_speed`` writes, per replica and training client, the rounds the client
was selected and the rounds it was selected but not aggregated (clients.npz,
``train_rounds_selected`` and ``train_rounds_dropped`` [R, N]; :mod:`deltafl_jax.sampling.
timeline`), and of those, with a deadline, the rounds it was past the deadline
(``train_rounds_late``) and, when clients may go offline mid-job, the rounds it went offline
before its work arrived (``train_rounds_offline``); the rest of the drops are the clients
beyond the m first under over-selection. The speeds themselves are not written: they are
rebuilt here from the run's
config (:func:`deltafl_jax.sampling.speeds.build_speeds` of its ``timing`` settings and data
seed; a generated model needs no file, a capacity trace must still be readable at its path).

The training clients are ranked by their compute seconds per example and cut into quintiles
as :func:`deltafl_jax.evaluation.by_availability.availability_quintiles` cuts availability rates
(ties by client index, groups as equal as N allows), here q1 the **fastest** fifth and q5 the
slowest. A quintile's drop rate is the sum over its clients of the rounds dropped over the
sum of the rounds selected (NaN when none of its clients was ever selected), per replica;
the table shows the mean over the seeds, a row for every drop and, where the run recorded
them, a row per cause (the same denominator, so the causes' rates add up to at most the
whole's).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from deltafl_jax.errors import DeltaFLError
from deltafl_jax.evaluation.by_availability import QUINTILES, availability_quintiles
from deltafl_jax.report.availability import columns_with, percent_cell
from deltafl_jax.report.tables import Column

SELECTED = "train_rounds_selected"
DROPPED = "train_rounds_dropped"
LATE = "train_rounds_late"
OFFLINE = "train_rounds_offline"
CAUSES = ((LATE, "deadline"), (OFFLINE, "offline"))


def speed_quintiles(per_example_s) -> np.ndarray:
    """[N] int64 quintile (0: the fastest fifth .. 4: the slowest) of each client by its
    compute seconds per example (ties by client index)."""
    return availability_quintiles(per_example_s)


def drop_rates(selected, dropped, groups, num_groups: int = QUINTILES) -> np.ndarray:
    """[R, num_groups] rounds dropped / rounds selected summed over each group's clients, from
    `selected` and `dropped` [R, N] (or [N]) and `groups` [N] (0 .. num_groups - 1); NaN
    where a group's clients were never selected."""
    sel = np.atleast_2d(np.asarray(selected, np.float64))
    drop = np.atleast_2d(np.asarray(dropped, np.float64))
    groups = np.asarray(groups, np.int64)
    if sel.shape != drop.shape or sel.shape[-1] != groups.size:
        raise ValueError(f"selected {sel.shape}, dropped {drop.shape} and groups "
                         f"{groups.shape} do not match")
    onehot = groups[:, None] == np.arange(num_groups)[None, :]      # [N, G]
    num, den = drop @ onehot, sel @ onehot
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def run_per_example_s(run) -> Optional[np.ndarray]:
    """[N] each training client's compute seconds per example, rebuilt from a report run's
    config; None when the run has no clock or its speeds cannot be rebuilt (a capacity trace
    no longer at its path, a config of another version)."""
    import dataclasses

    from deltafl_jax.sampling.speeds import TimingSettings, build_speeds

    config = run.config
    timing = {f.name: config[f.name] for f in dataclasses.fields(TimingSettings)
              if f.name in config}
    try:
        settings = TimingSettings(**timing)
        speeds = build_speeds(settings, num_clients=len(run.clients["train_sizes"]),
                              data_seed=int(run.config.get("data", {}).get("data_seed", 0)))
    except (DeltaFLError, TypeError, ValueError, OSError):
        return None
    if speeds is None:
        return None
    return speeds.per_example_s(np.arange(len(run.clients["train_sizes"]), dtype=np.int64))


def column_drop_rates(col: Column, key: str = DROPPED):
    """([5] mean seconds per example of each quintile, [S, 5] drop rates of each seed) of a
    report column, counting the drops of clients.npz's `key` (every drop, or one cause's);
    None when a run of it has no clock or no such counts."""
    rows, speeds = [], None
    for run, reps in col.parts:
        x = run_per_example_s(run)
        c = run.clients
        if x is None or SELECTED not in c or key not in c or \
                np.shape(c[SELECTED])[-1] != x.size:
            return None
        q = speed_quintiles(x)
        speeds = np.array([x[q == j].mean() if np.any(q == j) else np.nan
                           for j in range(QUINTILES)])
        rows.append(drop_rates(np.asarray(c[SELECTED])[reps], np.asarray(c[key])[reps], q))
    return speeds, np.concatenate(rows)


def drop_table(cols: Sequence[Column]) -> Optional[str]:
    """The markdown table of the drop rate (%) by compute-speed quintile, a row per method
    column (mean over seeds, the seeds' min-max in brackets), the quintiles' mean ms per
    example in the header; None when no column has the counts."""
    found = columns_with(cols, column_drop_rates)
    if found is None:
        return None
    got, speeds, same = found
    heads = [f"q{j + 1}" + (f" ({1000 * speeds[j]:.3g} ms)" if same else "")
             for j in range(QUINTILES)]
    lines: List[str] = ["| method | " + " | ".join(heads) + " | all |",
                        "|---|" + "---|" * (QUINTILES + 1)]
    for col, (_, rates) in got:
        lines.append(_row(col.label, rates, _overall(col)))
        for key, cause in CAUSES:
            by_cause = column_drop_rates(col, key)
            if by_cause is not None:
                lines.append(_row(f"{col.label}: {cause}", by_cause[1], _overall(col, key)))
    return "\n".join(lines)


def _row(label: str, rates: np.ndarray, overall: str) -> str:
    cells = [percent_cell(rates[:, j]) for j in range(QUINTILES)]
    return f"| {label} | " + " | ".join(cells) + f" | {overall} |"


def _overall(col: Column, key: str = DROPPED) -> str:
    """The column's drop rate (drops counted by `key`) over every training client (%, mean
    over seeds)."""
    vals = []
    for run, reps in col.parts:
        c = run.clients
        sel = np.asarray(c[SELECTED], np.float64)[reps].sum(axis=-1)
        drop = np.asarray(c[key], np.float64)[reps].sum(axis=-1)
        vals.append(np.where(sel > 0, drop / np.maximum(sel, 1), np.nan))
    return percent_cell(np.concatenate(vals))


DROP_NOTE = ("Drop rate by compute-speed quintile (rounds a client was selected but not "
             "aggregated, over the rounds it was selected, summed over the quintile's "
             "training clients; q1 the fastest fifth by compute seconds per example, with the "
             "quintile's mean; % mean over seeds, [min, max] over seeds). The rows "
             "'deadline' and 'offline' count only the drops of that cause: past the "
             "deadline, or gone offline before the work arrived; the rest of a method's drops "
             "are the clients beyond the m first under over-selection.")
