"""Continuing a finished run to more rounds: the same command with a larger
``--num_rounds`` continues from the run's last checkpoint, and ends with the outputs of an
uninterrupted run of the longer length, bit for bit (every per-round output, the per-client
arrays and the models; the continued run keeps the evaluation that the shorter run made after
its last round). What cannot be continued exactly is refused with one line, exit code 2, the
folder left byte for byte as it was."""

import json
import os
import shutil

import flax.serialization
import jax
import numpy as np
import pytest

from conftest import run_runner
from test_output_dir import snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = [f"--flagfile={os.path.join(REPO, 'tests', 'resume.flags')}"]   # eval every 4 rounds

# Each continued run: what it adds to tests/resume.flags, the short and the long length.
VARIANTS = {
    # a step learning-rate schedule (gamma_0 c^-floor(t / t_0)) running across the boundary
    "deltafl": (("--algorithm=deltafl", "--lr_decay=2", "--lr_decay_every=3"), 10, 20),
    "scaffold": (("--algorithm=scaffold", "--thetas=1"), 10, 20),        # per-client state
    "fedadam": (("--algorithm=deltafl", "--server_optimizer=adam", "--server_lr=0.03"), 10, 20),
    # private Delta-FL at a given noise multiplier: epsilon is accounted round by round
    "private": (("--algorithm=deltafl", "--weighting=unweighted", "--quantile=secagg_mm",
                 "--mm_iters=3", "--dp_clip=0.5", "--dp_noise_multiplier=0.7"), 10, 20),
    # a sampled evaluation, the clients on the host
    "sampled": (("--eval_clients=4", "--client_data=host"), 10, 20),
    # every replica stopped at round 4 by --stop_on_divergence: the continued run records the
    # round each replica stopped at, as the uninterrupted one does
    "diverging": (("--stop_on_divergence", "--learning_rate=5"), 8, 12),
}
FAST = ("deltafl",)


def run(capsys, out, *extra):
    code, err, stdout = run_runner([*FLAGS, f"--output_dir={out}", *extra], capsys)
    return code, err, stdout


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    for r in recs:
        r.pop("elapsed_s")
    return recs


def npz(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def same_arrays(a, b, what):
    assert sorted(a) == sorted(b), what
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}:{k}")


def models(out):
    mdir = os.path.join(out, "models")
    return {f: flax.serialization.msgpack_restore(open(os.path.join(mdir, f), "rb").read())
            for f in sorted(os.listdir(mdir)) if f.endswith(".msgpack")}


def same_models_and_summaries(out, whole):
    """The saved models of two runs are equal bit for bit, and so are their summaries' results;
    (summary, summary)."""
    a, b = models(out), models(whole)
    assert sorted(a) == sorted(b) and a
    for f in a:
        jax.tree.map(np.testing.assert_array_equal, a[f], b[f])
    sa, sb = (json.load(open(os.path.join(d, "summary.json"))) for d in (out, whole))
    for key in ("final", "replicas", "diverged", "privacy", "dataset", "clients_per_round"):
        assert sa.get(key) == sb.get(key), key
    return sa, sb


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in VARIANTS])
@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_continued_run_equals_the_uninterrupted_one(tmp_path, capsys, name):
    extra, short, long = VARIANTS[name]
    out, whole = str(tmp_path / "continued"), str(tmp_path / "whole")
    code, err, _ = run(capsys, out, *extra, f"--num_rounds={short}")
    assert code == 0, err
    shorter = records(out)
    assert os.path.exists(os.path.join(out, "summary.json"))
    code, err, stdout = run(capsys, out, *extra, f"--num_rounds={long}")
    assert code == 0, err
    assert (f"deltafl_jax: continuing {out} from its checkpoint after round {short}, to round "
            f"{long}") in stdout
    assert stdout.count("resuming") + stdout.count("continuing") == 1
    code, err, _ = run(capsys, whole, *extra, f"--num_rounds={long}")
    assert code == 0, err

    # metrics.jsonl: the uninterrupted run's records, plus the evaluation the shorter run made
    # after its last round (off the every-4-rounds schedule), unchanged.
    got, want = records(out), records(whole)
    assert short % 4 != 0 or name == "diverging"
    extra_eval = short % 4 != 0
    assert [r for r in got if not (extra_eval and r["round"] == short)] == want
    assert [r for r in got if r["round"] <= short] == shorter
    same_arrays(npz(os.path.join(out, "rounds.npz")), npz(os.path.join(whole, "rounds.npz")),
                "rounds.npz")
    same_arrays(npz(os.path.join(out, "clients.npz")), npz(os.path.join(whole, "clients.npz")),
                "clients.npz")
    hist, hist_whole = (npz(os.path.join(d, "clients_history.npz")) for d in (out, whole))
    keep = [i for i, t in enumerate(hist["rounds"]) if not (extra_eval and t == short)]
    same_arrays({k: v[keep] for k, v in hist.items()}, hist_whole, "clients_history.npz")
    sa, sb = same_models_and_summaries(out, whole)
    assert {k: v for k, v in sa["config"].items() if k != "output_dir"} == \
        {k: v for k, v in sb["config"].items() if k != "output_dir"}
    if name == "diverging":
        assert set(sa["diverged"].values()) == {4}
    if name == "private":
        assert got[-1]["dp_epsilon"] > [r for r in got if r["round"] == short][0]["dp_epsilon"]


def refused(capsys, out, *extra):
    before = snapshot(out)
    code, err, _ = run(capsys, out, *extra)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1, err
    assert snapshot(out) == before
    return lines[0]


def test_a_finished_run_is_refused_unless_only_num_rounds_grows(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert run(capsys, out, "--num_rounds=6")[0] == 0
    line = refused(capsys, out, "--num_rounds=6")
    assert "already holds results" in line and "its 6 rounds are done" in line
    line = refused(capsys, out, "--num_rounds=4")
    assert "already holds results" in line
    line = refused(capsys, out, "--num_rounds=12", "--learning_rate=0.1")
    assert "holds a finished run with other settings (--learning_rate differ)" in line
    # A run written before the marker: its summary.json's configuration is compared.
    marker = os.path.join(out, "deltafl_run.json")
    saved = open(marker).read()
    os.remove(marker)
    line = refused(capsys, out, "--num_rounds=6")
    assert "already holds results" in line and "its 6 rounds are done" in line
    line = refused(capsys, out, "--num_rounds=12", "--synthetic_shared=0.5")
    assert "holds a finished run with other settings (--synthetic_shared differ)" in line
    open(marker, "w").write(saved)
    # No checkpoint to continue from.
    shutil.rmtree(os.path.join(out, "checkpoints"))
    line = refused(capsys, out, "--num_rounds=12")
    assert "without a checkpoint to continue it from" in line


@pytest.mark.slow
def test_what_depends_on_the_planned_rounds_cannot_continue(tmp_path, capsys):
    # A noise multiplier calibrated to a target epsilon over the planned rounds.
    dp = str(tmp_path / "dp")
    private = ("--algorithm=fedavg", "--thetas=1", "--weighting=unweighted", "--dp_clip=0.5")
    assert run(capsys, dp, *private, "--dp_target_epsilon=8", "--num_rounds=4")[0] == 0
    line = refused(capsys, dp, *private, "--dp_target_epsilon=8", "--num_rounds=8")
    assert f"cannot continue the run in {dp} to --num_rounds=8 exactly" in line
    assert "calibrated to --dp_target_epsilon=8 over its planned rounds" in line
    # epsilon = inf (clipped, not noised: z = 0 whatever the rounds) continues.
    inf = str(tmp_path / "inf")
    assert run(capsys, inf, *private, "--dp_target_epsilon=inf", "--num_rounds=2")[0] == 0
    code, err, stdout = run(capsys, inf, *private, "--dp_target_epsilon=inf", "--num_rounds=4")
    assert code == 0 and "continuing" in stdout, err

    # A replica stopped at the evaluation after the last round, which the longer run would
    # not make (every 4 rounds): the longer run would have gone on training it.
    div = str(tmp_path / "div")
    diverging = ("--stop_on_divergence", "--learning_rate=5")
    assert run(capsys, div, *diverging, "--num_rounds=2")[0] == 0
    line = refused(capsys, div, *diverging, "--num_rounds=8")
    assert "--stop_on_divergence stopped" in line and "(round 2)" in line
