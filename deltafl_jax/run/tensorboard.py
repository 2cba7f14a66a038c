"""TensorBoard event files of a run: one TensorBoard run per replica under
``<output_dir>/tb/<replica key>/``, written through ``tensorboardX`` (the ``tensorboard``
extra). Every evaluation writes the metrics of metrics.jsonl (train loss mean and percentiles,
test error mean and percentiles, ...) at step = round; every round writes the clients kept.

    tensorboard --logdir runs/synthetic/tb
"""

from __future__ import annotations

import os
from typing import Dict

import numpy as np

from deltafl_jax.run.callbacks import Callback, Evaluation, RunContext

ROUND_SCALARS = ("num_selected", "sampled_loss_mean", "learning_rate", "eta")


def available() -> bool:
    """tensorboardX can be imported."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoard(Callback):
    """Writes every replica's metrics as TensorBoard scalars."""

    def __init__(self, output_dir: str):
        self.root = os.path.join(output_dir, "tb")
        self.writers: Dict[int, object] = {}

    def on_run_start(self, run: RunContext) -> None:
        from tensorboardX import SummaryWriter
        for r, key in enumerate(run.view.names.keys):
            self.writers[r] = SummaryWriter(os.path.join(self.root, key))

    def on_round_end(self, run: RunContext, round: int, metrics) -> None:
        for name in ROUND_SCALARS:
            if name in metrics and getattr(metrics[name], "ndim", 0) == 1:
                for r, w in self.writers.items():
                    w.add_scalar(f"round/{name}", float(metrics[name][r]), round)

    def on_evaluation(self, run: RunContext, evaluation: Evaluation) -> None:
        for r, w in self.writers.items():
            for name, values in evaluation.summary.items():
                if np.isfinite(values[r]):   # an interval's missing bound is +-inf
                    w.add_scalar(f"eval/{name}", float(values[r]), evaluation.round)
            w.flush()

    def on_run_end(self, run: RunContext, result) -> None:
        for w in self.writers.values():
            w.close()
