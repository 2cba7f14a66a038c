"""The callback that writes a run's output directory through :class:`deltafl_jax.outputs.RunWriter`:
``metrics.jsonl`` at every evaluation; ``rounds.npz``, ``clients.npz``,
``clients_history.npz``, ``partition.npz`` (partitioned data), the models and ``summary.json``
when the run ends."""

from __future__ import annotations

from deltafl_jax import outputs
from deltafl_jax.run.callbacks import Callback, Evaluation, RunContext


class OutputFiles(Callback):
    """The callback that fills `output_dir` with the run's files (only on the process that owns
    the outputs), when they are due; :class:`deltafl_jax.outputs.RunWriter`, which it holds,
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
