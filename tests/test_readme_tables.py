"""The documentation's result tables (the Synthetic table, in README.md and docs/results/, the
server-optimizer comparison, the DP table and the personalisation table) equal fresh
runs of their flagfiles (so they cannot go stale), and the table renderer's means, stds and bold marks are
right on a hand-made run."""

import json
import os
import subprocess
import sys

import pytest

from deltafl_jax.outputs.directory import RunWriter
from deltafl_jax.replicas.labels import ReplicaLabel
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


def options_run(path, filter, thetas=(1.0, 0.8), seeds=(1,)):
    """A finished Delta-FL run of --filter=`filter` (summary.json, written with RunWriter)."""
    labels = [ReplicaLabel("deltafl", t, s) for t in thetas for s in seeds]
    os.makedirs(path)
    RunWriter(str(path)).write_summary({
        "replicas": [lab.to_json() for lab in labels],
        "config": {"algorithm": "deltafl", "options": {"filter": filter}},
        "final": {lab.key(): {"test_error_p90": 0.6 - 0.1 * lab.theta,
                              "test_error_mean": 0.5 - 0.1 * lab.theta,
                              "train_loss_p90": 1.5 + lab.theta} for lab in labels}})
    return str(path)


def test_headers_leave_out_the_options_every_run_shares(tmp_path):
    """A table made from one flagfile (--filter=reference) names its columns as the page
    does, without '(reference filter)' on each; runs whose options differ keep them."""
    one = options_run(tmp_path / "ref", "reference")
    assert readme.render([one]).splitlines()[0] == "| | FedAvg | Δ-FL, θ = 0.8 |"
    other = options_run(tmp_path / "exact", "exact", thetas=(0.5,))
    assert readme.render([one, other]).splitlines()[0] == (
        "| | FedAvg | Δ-FL, θ = 0.8 (reference filter) | Δ-FL, θ = 0.5 |")


def test_difference_says_whether_the_numbers_or_the_names_differ():
    table = "| | A | B |\n|---|---|---|\n| p90 | **1.00** | 2.00 |"
    assert readme.difference(table, table) == ""
    assert readme.difference(table, table.replace("B |", "B (x) |")) == (
        "the column and row names (the numbers match)")
    assert readme.difference(table, table.replace("2.00", "2.01")) == "the numbers"
    assert readme.difference(table, table.replace("2.00", "2.01").replace("p90", "q")) == (
        "the numbers and the column and row names")


def test_check_of_an_existing_run_folder_says_it_read_it(tmp_path):
    """The README's main job's folder (a --filter=reference run of shakespeare_cpu.flags) read
    as it is: the page's table, headers without the shared option, matches; the command says
    it read the folder and did not run anything; a changed number fails, naming the numbers."""
    run = options_run(tmp_path / "shakespeare_cpu", "reference", seeds=(1, 2))
    page = tmp_path / "page.md"
    table = readme.render([run])
    assert "reference filter" not in table
    page.write_text(f"# t\n<!-- table: shakespeare_cpu -->\n{table}\n<!-- /table -->\n")
    command = [sys.executable, "-m", "experiments.readme_tables", "--table=shakespeare_cpu",
               f"--run_dir={run}", f"--readme={page}"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"matches the run (read the finished run in {run}, not re-run)" in proc.stdout
    assert "fresh" not in proc.stdout
    page.write_text(page.read_text().replace("**", "", 2).replace("50.00", "50.01", 1))
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the numbers differ" in proc.stdout and "not re-run" in proc.stdout
