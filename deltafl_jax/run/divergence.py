"""Stopping diverged replicas (``--stop_on_divergence``), as the reference code does: a replica
whose mean training loss is NaN, infinite, or above 3x its value at w_0 stops training; its
model and algorithm state stay as they were, its clients do no more work, and the other
replicas go on. The round at which each replica stopped is recorded in summary.json
("diverged"). Without the option, a replica with non-finite losses keeps running and its
non-finite client updates are rejected and counted (``num_rejected``).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from deltafl_jax.run.callbacks import Callback, Evaluation, RunContext

DIVERGENCE_FACTOR = 3.0


class StopOnDivergence(Callback):
    """Marks replicas inactive at the evaluation where their training loss diverged.

    `history`: the metrics.jsonl records of a resumed run, from which the round at which an
    already stopped replica was stopped is read back (the first of its evaluations whose loss
    diverged), so that the resumed run records the round an uninterrupted one does."""

    def __init__(self, factor: float = DIVERGENCE_FACTOR,
                 history: Sequence[Mapping[str, Any]] = ()):
        self.factor = factor
        self.initial = None
        self.diverged: Dict[str, int] = {}
        self.history = history

    def _bad(self, loss, r: int) -> bool:
        return not np.isfinite(loss) or loss > self.factor * self.initial[r]

    def _stopped_at(self, label, r: int, default: int) -> int:
        fields = label.to_json()
        for rec in self.history:
            if all(rec.get(k) == v for k, v in fields.items()) and \
                    self._bad(float(rec.get("train_loss_mean", np.nan)), r):
                return int(rec["round"])
        return default

    def on_run_start(self, run: RunContext) -> None:
        view = run.view
        first = view.initial_state()   # w_0 from the seeds, also when resuming
        self.initial = view.summarize(view.evaluate(view.served_params(first), 0))[
            "train_loss_mean"]
        active = run.state.active
        if active is not None:
            for r in np.flatnonzero(~np.asarray(active)):
                label = view.labels[r]
                self.diverged.setdefault(label.key(), self._stopped_at(label, r, run.start_round))

    def on_evaluation(self, run: RunContext, evaluation: Evaluation) -> None:
        loss = evaluation.summary["train_loss_mean"]
        bad = ~np.isfinite(loss) | (loss > self.factor * self.initial)
        state = run.state
        active = (np.ones(loss.shape, bool) if state.active is None
                  else np.asarray(state.active))
        newly = bad & active
        if not newly.any():
            return
        labels = run.view.labels
        for r in np.flatnonzero(newly):
            self.diverged[labels[r].key()] = evaluation.round
        run.state = state.replace(active=jnp.asarray(active & ~newly))

    def on_run_end(self, run: RunContext, result) -> None:
        result.summary["diverged"] = dict(self.diverged)
