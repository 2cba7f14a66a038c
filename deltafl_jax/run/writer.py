"""The callbacks that write a run's files into its output directory.

:class:`OutputFiles` writes through :class:`deltafl_jax.outputs.directory.RunWriter`: ``metrics.jsonl``
at every evaluation; ``rounds.npz``, ``clients.npz``, ``clients_history.npz``,
``partition.npz`` (partitioned data), the models and ``summary.json`` when the run ends.

:class:`TensorBoard` writes TensorBoard event files: one TensorBoard run per replica under
``<output_dir>/tb/<replica key>/``, through ``tensorboardX`` (the ``tensorboard`` extra).
Every evaluation writes the metrics of metrics.jsonl (train loss mean and percentiles, test
error mean and percentiles, ...) at step = round; every round writes the clients kept.

    tensorboard --logdir runs/synthetic/tb
"""

from __future__ import annotations

import os
from typing import Dict

import numpy as np

from deltafl_jax.outputs import directory as outputs
from deltafl_jax.run.callbacks import Callback, Evaluation, RunContext


class OutputFiles(Callback):
    """The callback that fills `output_dir` with the run's files (only on the process that owns
    the outputs), when they are due; :class:`deltafl_jax.outputs.directory.RunWriter`, which it holds,
    knows how each file is written."""

    def __init__(self, output_dir: str, model, model_options, data, save_models: bool = True):
        """`model`, `model_options` and `data` describe the saved models (models/index.json)
        and the clients of clients.npz."""
        self.writer = outputs.RunWriter(output_dir)
        self.model, self.model_options, self.data = model, model_options, data
        self.save_models = save_models

    def on_evaluation(self, run: RunContext, evaluation: Evaluation) -> None:
        self.writer.append_metrics(evaluation.records)

    def on_run_end(self, run: RunContext, result) -> None:
        if result.stopped:
            return  # a stopped run leaves metrics.jsonl, rounds.npz and clients_history.npz as of
            #         its last checkpoint (the resume reads them back), and no summary.json
        names = run.view.names
        self.writer.write_rounds(result.per_round, names.keys)
        self.writer.write_clients_history(result.client_history)
        self.writer.write_clients(result.per_client, self.data, names.keys)
        self.writer.write_partition(self.data)
        if self.save_models:
            self.writer.save_models(result.served, names.records, self.model,
                                    self.model_options, self.data, personal=result.personal)
        self.writer.write_summary(result.summary)


# The round metrics TensorBoard plots at every round.
ROUND_SCALARS = ("num_selected", "sampled_loss_mean", "learning_rate", "eta")


def tensorboard_available() -> bool:
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
