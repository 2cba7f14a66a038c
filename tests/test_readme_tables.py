"""The documentation's result tables (the Synthetic table, in README.md and docs/results/, the
server-optimizer comparison, the DP table and the personalisation table) equal fresh
runs of their flagfiles (so they cannot go stale), and the table renderer's means, stds and bold marks are
right on a hand-made run."""

import json
import os
import subprocess
import sys

import pytest

from deltafl_jax.outputs import RunWriter
from deltafl_jax.replicas import ReplicaLabel
from deltafl_jax.report import readme

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_run(path, finals):
    labels = [ReplicaLabel("deltafl", theta, seed) for theta, seed in finals]
    os.makedirs(path)
    RunWriter(str(path)).write_summary({
        "replicas": [lab.to_json() for lab in labels],
        "final": {lab.key(): dict(zip(("test_error_p90", "test_error_mean", "train_loss_p90"),
                                      finals[(lab.theta, lab.seed)]))
                  for lab in labels}})
    return str(path)


def test_render_means_stds_and_bold(tmp_path):
    run = fake_run(tmp_path / "r", {(1.0, 1): (0.8, 0.4, 1.0), (1.0, 2): (0.6, 0.2, 3.0),
                                    (0.5, 1): (0.5, 0.5, 2.0), (0.5, 2): (0.5, 0.5, 2.0)})
    table = readme.render([run]).splitlines()
    assert table[0] == "| | FedAvg | Δ-FL, θ = 0.5 |"
    assert table[2] == "| test error, 90th percentile | 70.00 ± 10.00 | **50.00** ± 0.00 |"
    assert table[3] == "| test error, mean | **30.00** ± 10.00 | 50.00 ± 0.00 |"
    assert table[4] == ("| train loss, 90th percentile (α-weighted) | **2.000** ± 1.000 | "
                        "**2.000** ± 0.000 |")
    text = "a\n<!-- table: x -->\nold\n<!-- /table -->\nb"
    assert readme.replace(text, "x", "new") == "a\n<!-- table: x -->\nnew\n<!-- /table -->\nb"
    with pytest.raises(KeyError):
        readme.replace(text, "y", "new")
    # A new, empty block is filled without reaching into the next table's block.
    two = "<!-- table: e -->\n<!-- /table -->\nmid\n<!-- table: x -->\nold\n<!-- /table -->"
    assert readme.replace(two, "e", "t") == (
        "<!-- table: e -->\nt\n<!-- /table -->\nmid\n<!-- table: x -->\nold\n<!-- /table -->")
    assert readme.current(two, "e") == "" and readme.current(two, "x") == "old"


def test_render_personal_rows_per_method_and_steps(tmp_path):
    """One row per method and adaptation steps (k = 0, then '+ FT (k steps)'), the held-out
    errors of both populations in %, mean +- std over seeds, the lowest mean in bold."""
    labels = [ReplicaLabel("fedavg", 1.0, s) for s in (1, 2)]
    keys = [f"{p}{ft}_error_{m}" for p in ("unseen", "seen") for ft in ("", "_ft5")
            for m in ("mean", "p90", "worst10")]
    final = {lab.key(): {k: (0.1 if "ft5" in k else 0.3) + 0.1 * (lab.seed - 1) for k in keys}
             for lab in labels}
    os.makedirs(tmp_path / "r")
    RunWriter(str(tmp_path / "r")).write_summary({
        "replicas": [lab.to_json() for lab in labels], "final": final,
        "config": {"algorithm": "fedavg", "finetune_steps": [0, 5]}})
    table = readme.render_personal([str(tmp_path / "r")]).splitlines()
    assert table[0] == ("| method | unseen mean | unseen p90 | unseen worst 10% | seen mean | "
                        "seen p90 | seen worst 10% |")
    assert table[2] == "| FedAvg | " + " | ".join(["35.0 ± 5.0"] * 6) + " |"
    assert table[3] == "| FedAvg + FT (5 steps) | " + " | ".join(["**15.0** ± 5.0"] * 6) + " |"


@pytest.mark.slow
@pytest.mark.parametrize("table", ["synthetic", "compare_fedopt_synthetic", "dp_synthetic",
                                   "personalize_synthetic"])
def test_readme_table_matches_a_fresh_run(table):
    proc = subprocess.run([sys.executable, "-m", "experiments.readme_tables",
                           f"--table={table}", "--run"], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
