"""Diverged replicas: found from the losses and from the state, stopped with
``--stop_on_divergence``.

**The losses**, as the reference code does: a replica whose mean training loss is NaN,
infinite, or above 3x its value at w_0 has diverged (checked at each evaluation).

**The state**: every round checks the state it returns, part by part
(:func:`deltafl_jax.rounds.state_nonfinite`: the model, the server optimizer's state, the
algorithm's state, the clients' own state such as Ditto's personal models, DP's state), and
records per replica ``nonfinite_<part>`` in the round metrics (rounds.npz): 1 when the part
holds a NaN or an infinity, or, for the clients' own state, the number of the round's
clients whose state is not finite. summary.json's ``nonfinite`` names, per replica, each part
that went non-finite and the first round it was (the recorder's,
:func:`deltafl_jax.run.loop.nonfinite_summary`); the progress lines say it once, naming the
round, the replica and the part.

With ``--stop_on_divergence`` a replica that diverged by either rule stops training: its model
and algorithm state stay as they were, its clients do no more work, and the other replicas go
on; the round at which each stopped is recorded in summary.json ("diverged"). Without the
option, a replica with non-finite losses or state keeps running: its non-finite client updates
are rejected and counted (``num_rejected``), a client whose own state is not finite keeps it,
and the personalised metrics computed from a non-finite model are NaN
(:mod:`deltafl_jax.run.personal`).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from deltafl_jax.rounds import CLIENT_PART, NONFINITE
from deltafl_jax.run.callbacks import Callback, Evaluation, RunContext
from deltafl_jax.run.loop import nonfinite_rounds

DIVERGENCE_FACTOR = 3.0
PART_NAMES = {"params": "the model", "server_opt_state": "the server optimizer's state",
              "algo_state": "the algorithm's state", CLIENT_PART: "the clients' own state",
              "dp": "the state of client-level DP"}


def part_text(part: str, count: int = 0) -> str:
    """How a line names a part of the state: "the model (params)", "the clients' own state
    (client_state.personal) of 3 of the round's clients"."""
    head = PART_NAMES.get(part.partition(".")[0], part)
    clients = (f" of {count} of the round's clients"
               if part.partition(".")[0] == CLIENT_PART else "")
    return f"{head} ({part}){clients}"


class StopOnDivergence(Callback):
    """Marks replicas inactive at the evaluation where their training loss diverged.

    Also marks them inactive at the round where a part of their state went non-finite.

    `history`, `per_round`: the metrics.jsonl records and the round metrics of a resumed run,
    from which the round at which an already stopped replica was stopped is read back (the
    first of its evaluations whose loss diverged, or the first round its state was not finite,
    whichever came first), so that the resumed run records the round an uninterrupted one
    does."""

    def __init__(self, factor: float = DIVERGENCE_FACTOR,
                 history: Sequence[Mapping[str, Any]] = (),
                 per_round: Optional[Mapping[str, Any]] = None):
        self.factor = factor
        self.initial = None
        self.diverged: Dict[str, int] = {}
        self.history = history
        self.per_round = per_round or {}

    def _bad(self, loss, r: int) -> bool:
        return not np.isfinite(loss) or loss > self.factor * self.initial[r]

    def stopped_at(self, fields: Mapping[str, Any], r: int, default: int) -> int:
        """The round at which replica `r` (its label as written: `fields`) stopped, read back
        from the histories (`default` when they do not say)."""
        found = [int(first[r]) for first in nonfinite_rounds(self.per_round).values()
                 if first[r] > 0]
        for rec in self.history:
            if all(rec.get(k) == v for k, v in fields.items()) and \
                    self._bad(float(rec.get("train_loss_mean", np.nan)), r):
                found.append(int(rec["round"]))
                break
        return min(found) if found else default

    def on_run_start(self, run: RunContext) -> None:
        view = run.view
        first = view.initial_state()   # w_0 from the seeds, also when resuming
        self.initial = view.summarize(view.evaluate(view.served_params(first), 0))[
            "train_loss_mean"]
        active = run.state.active
        if active is not None:
            for r in np.flatnonzero(~np.asarray(active)):
                self.diverged.setdefault(view.names.keys[r],
                                         self.stopped_at(view.names.records[r], r,
                                                         run.start_round))

    def on_round_end(self, run: RunContext, round: int, metrics) -> None:
        parts = [np.asarray(v) > 0 for k, v in metrics.items() if k.startswith(NONFINITE)]
        if parts:
            self._stop(run, np.any(parts, axis=0), round)

    def on_evaluation(self, run: RunContext, evaluation: Evaluation) -> None:
        loss = evaluation.summary["train_loss_mean"]
        self._stop(run, ~np.isfinite(loss) | (loss > self.factor * self.initial),
                   evaluation.round)

    def _stop(self, run: RunContext, bad, round: int) -> None:
        state = run.state
        active = (np.ones(bad.shape, bool) if state.active is None
                  else np.asarray(state.active))
        newly = bad & active
        if not newly.any():
            return
        keys = run.view.names.keys
        for r in np.flatnonzero(newly):
            self.diverged[keys[r]] = round
        run.state = state.replace(active=jnp.asarray(active & ~newly))

    def on_run_end(self, run: RunContext, result) -> None:
        result.summary["diverged"] = dict(self.diverged)
