"""What the progress lines and closing tables call things: an algorithm that trains
one model whatever its sweep (FedAvg, SCAFFOLD: theta = 1 is no choice of the user's) is named,
not labelled 'θ=1'; a model without classes (the Gaussian toy's mean estimation) reports test
losses under a 'test loss' heading, not 'test error'."""

import os
import types

import numpy as np
import pytest

from conftest import run_runner
from deltafl_jax.algorithms import registry
from deltafl_jax.replicas.labels import ReplicaLabel, replica_names
from deltafl_jax.run.callbacks import Evaluation, RunContext
from deltafl_jax.run.progress import Progress, evaluation_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = {"train_loss_mean": np.array([0.5, 0.7]), "test_error_mean": np.array([0.3, 0.4]),
           "test_error_p90": np.array([0.5, 0.6]), "test_loss_mean": np.array([1.0, 1.2])}


def context(labels, classify=True):
    """A run's context with the names its Experiment gives (its algorithm's spec's)."""
    spec = registry.get(labels[0].algorithm)
    view = types.SimpleNamespace(facts=types.SimpleNamespace(classify=classify),
                                 names=replica_names(labels, spec.display_name,
                                                     spec.reporting.names_value))
    return RunContext(view=view, num_rounds=4, output_dir=None)


def test_one_model_algorithms_are_named_and_swept_values_labelled():
    ev = Evaluation(round=2, per_client={}, summary=SUMMARY, records=[], elapsed_s=1.0)
    line = evaluation_line(context([ReplicaLabel("scaffold", 1.0, 1),
                                    ReplicaLabel("scaffold", 1.0, 2)]), ev)
    assert "| SCAFFOLD: train loss 0.600" in line and "θ" not in line
    line = evaluation_line(context([ReplicaLabel("fedavg", 1.0, 1, extra=(("server_lr", 0.1),)),
                                    ReplicaLabel("fedavg", 1.0, 2, extra=(("server_lr", 0.1),))]),
                           ev)
    assert "| FedAvg server_lr=0.1: train loss" in line and "θ" not in line
    # Delta-FL's theta is the user's choice: labelled, theta = 1 included.
    line = evaluation_line(context([ReplicaLabel("deltafl", 1.0, 1),
                                    ReplicaLabel("deltafl", 0.5, 1)]), ev)
    assert "| θ=1: train loss 0.500" in line and "| θ=0.5: train loss 0.700" in line
    line = evaluation_line(context([ReplicaLabel("qffl", 1.0, 1, "qffl_q", 10.0),
                                    ReplicaLabel("qffl", 1.0, 2, "qffl_q", 10.0)]), ev)
    assert "| qffl_q=10: train loss" in line


def test_a_model_without_classes_is_summarised_as_losses():
    logged = []
    progress = Progress(log=logged.append, bar=False)
    labels = [ReplicaLabel("deltafl", 1.0, 1), ReplicaLabel("deltafl", 0.5, 1)]
    result = types.SimpleNamespace(stopped=False, final={
        lab.key(): {k: float(v[r]) for k, v in SUMMARY.items()} for r, lab in enumerate(labels)})
    progress.on_run_end(context(labels, classify=False), result)
    head, columns = logged[0].splitlines()[:2]
    assert head == "Final per-client test loss (mean over seeds):"
    assert "test loss mean" in columns and "error" not in logged[0]
    logged.clear()
    progress.on_run_end(context(labels, classify=True), result)
    assert logged[0].splitlines()[0] == "Final per-client test error (mean over seeds):"


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_the_toy_and_scaffold_runs_say_so(tmp_path, capsys):
    toy = os.path.join(REPO, "experiments", "toy_gaussians.flags")
    code, err, out = run_runner([f"--flagfile={toy}", "--num_rounds=2", "--eval_every=2",
                                 f"--output_dir={tmp_path / 'toy'}", "--tensorboard=no"], capsys)
    assert code == 0, err
    assert "Final per-client test loss (mean over seeds):" in out and "test error" not in out
    tiny = os.path.join(REPO, "tests", "tiny.flags")
    code, err, out = run_runner([f"--flagfile={tiny}", "--algorithm=fedavg,scaffold",
                                 "--thetas=1", "--num_rounds=2", "--eval_every=2",
                                 f"--output_dir={tmp_path / 'two'}", "--tensorboard=no"], capsys)
    assert code == 0, err
    assert "SCAFFOLD: train loss" in out and "FedAvg: train loss" in out and "θ=1" not in out
    table = out.split("Final test error per method (mean over seeds):")[1].splitlines()
    assert [l.split()[0] for l in table[2:4]] == ["fedavg", "scaffold"]
