"""Smoke run of bench/before_after.py at toy sizes: a checkout of the older commit
(bench/before_after.py's BEFORE_COMMIT, a git worktree made here, removed afterwards) against this tree, softmax regression only. The
figures are not asserted (machines are noisy); the JSON's shape is, and that both trees
sampled, kept and trained the same clients and examples in every round."""

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE_COMMIT = "36a2d9c"   # bench.before_after.BEFORE_COMMIT


def git(*args, **kw):
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, **kw)


@pytest.fixture
def before_tree(tmp_path):
    """A detached worktree of BEFORE_COMMIT under tmp_path, removed afterwards."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed; bench/before_after.py compares two git checkouts")
    if git("rev-parse", "--git-dir").returncode:
        pytest.skip(f"{REPO} is not a git repository (an unpacked archive?); the benchmark "
                    f"needs commit {BEFORE_COMMIT}")
    if git("rev-parse", "--verify", "--quiet", BEFORE_COMMIT + "^{commit}").returncode:
        pytest.skip(f"commit {BEFORE_COMMIT} is not in this clone (shallow?); "
                    f"`git fetch --unshallow` to run this test")
    path = tmp_path / "before"
    made = git("worktree", "add", "--detach", str(path), BEFORE_COMMIT)
    assert made.returncode == 0, made.stderr
    try:
        yield path
    finally:
        git("worktree", "remove", "--force", str(path))
        git("worktree", "prune")


def run_script(args, timeout=600):
    return subprocess.run([sys.executable, "-m", "bench.before_after", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow   # two worker processes compile the engine: CI's second step
def test_before_after_smoke(before_tree, tmp_path):
    out = tmp_path / "before_after.json"
    proc = run_script([f"--before={before_tree}", "--models=linear", "--algorithms=deltafl",
                       "--clients=3", "--num_clients=8", "--warmup=1", "--rounds=1",
                       f"--out={out}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    head = git("rev-parse", "HEAD").stdout.strip()
    assert res["trees"]["before"]["commit"].startswith(BEFORE_COMMIT)
    assert res["trees"]["after"]["commit"] == head
    assert res["same_clients_and_examples"] is True
    (w,) = res["workloads"]
    assert (w["model"], w["algorithm"], w["theta"], w["devices"]) == ("linear", "deltafl",
                                                                       0.5, 1)
    # Each worker imported its own tree's package.
    assert w["before"]["deltafl_jax_file"].startswith(os.path.realpath(before_tree) + os.sep)
    assert w["after"]["deltafl_jax_file"].startswith(os.path.realpath(REPO) + os.sep)
    assert w["before"]["commit"] == res["trees"]["before"]["commit"]
    assert w["after"]["commit"] == head
    for side in ("before", "after"):
        s = w[side]
        assert len(s["round_s"]) == 1 and len(s["warmup_round_s"]) == 1
        assert s["median_s_per_round"] > 0 and s["build_s"] > 0
        assert s["versions"]["jax"] and s["versions"]["python"]
    assert w["ratio_after_over_before"] == pytest.approx(
        w["after"]["median_s_per_round"] / w["before"]["median_s_per_round"])
    assert len(w["per_round_ratio"]["values"]) == 1
    assert w["same_data"] and not w["mismatched_rounds"]
    assert [r["round"] for r in w["rounds"]] == [0, 1]
    for r in w["rounds"]:
        assert r["same_clients"] and r["same_num_selected"] and r["same_train_real_examples"]
        assert 1 <= r["num_selected"][0] <= 3 and r["train_real_examples"][0] > 0
    assert len(res["loadavg_start"]) == 3 and len(res["loadavg_end"]) == 3
    assert "| linear | deltafl" in proc.stdout   # the markdown table


def test_before_after_missing_checkout_is_one_line(tmp_path):
    proc = run_script([f"--before={tmp_path / 'absent'}", "--models=linear"], timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--make_before" in lines[0], proc.stderr
    assert not (tmp_path / "absent").exists()
