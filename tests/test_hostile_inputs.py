"""Bad input as a hostile user would give it: each case prints one line naming what is wrong,
exits with code 2, and creates or changes nothing."""

import errno
import os

import numpy as np
import pytest

from conftest import run_runner

HERE = os.path.dirname(__file__)
TINY = os.path.join(HERE, "tiny.flags")


def npz(tmp_path, name, **change):
    rng = np.random.default_rng(0)
    arrays = dict(train_x=rng.normal(size=(40, 3)).astype(np.float32),
                  train_y=rng.integers(0, 3, 40), train_client=np.repeat(np.arange(4), 10),
                  test_x=rng.normal(size=(20, 3)).astype(np.float32),
                  test_y=rng.integers(0, 3, 20), test_client=np.repeat(np.arange(2), 10))
    for k, v in change.items():
        if v is None:
            del arrays[k]
        else:
            arrays[k] = v
    path = tmp_path / name
    np.savez(path, **arrays)
    return ["--dataset=npz", f"--data_path={path}", "--clients_per_round=2", "--seeds=1"]


CASES = {
    "theta zero": (["--thetas=0"], "--thetas must lie in (0, 1]"),
    "theta NaN": (["--thetas=nan"], "--thetas"),
    "negative seed": (["--seeds=-1"], "--seeds must be integers in [0, 2^31)"),
    "seed twice": (["--seeds=3,3"], "--seeds lists a seed twice"),
    "no rounds": (["--num_rounds=0"], "--num_rounds must be at least 1"),
    "no clients": (["--clients_per_round=0"], "--clients_per_round must be at least 1"),
    "negative batch": (["--batch_size=-3"], "--batch_size must be a positive integer"),
    "negative rate": (["--learning_rate=-0.1"], "--learning_rate must be positive"),
    "infinite rate": (["--learning_rate=inf"], "--learning_rate must be a finite number"),
    "negative l2": (["--l2_reg=-1"], "--l2_reg must be >= 0"),
    "l2 misaligned": (["--l2_reg=1e-3,1e-4,1e-5"], "--l2_reg gives 3 values for 2 swept"),
    "eval never": (["--eval_every=0"], "--eval_every must be at least 1"),
    "target accuracy above 1": (["--target_accuracy=1.5"], "--target_accuracy must be in (0, 1]"),
    "zero steps": (["--local_steps=0"], "--local_steps must be at least 1"),
    "decay every negative": (["--lr_decay_every=-1"], "--lr_decay_every must be >= 0"),
    "zero lanes": (["--clients_per_step=0"], "--clients_per_step must be at least 1"),
    "zero chunk": (["--eval_chunk=0"], "--eval_chunk must be at least 1"),
    "method twice": (["--algorithm=deltafl,deltafl"], "--algorithm lists a method twice"),
    "no method": (["--algorithm="], "--algorithm must name at least one method"),
    "negative q": (["--algorithm=qffl", "--qffl_q=-1"], "--qffl_q must be >= 0"),
    "mu not a number": (["--algorithm=fedprox", "--fedprox_mu=abc"], "--fedprox_mu must be a"),
    "toy means": (["--dataset=gaussian_toy", "--toy_means=1,2"], "--toy_means must list"),
    "negative checkpoint period": (["--checkpoint_every=-1"], "--checkpoint_every"),
    "cnn on vectors": (["--model=cnn"], "model 'cnn' needs image inputs"),
    "gru on floats": (["--model=gru"], "model 'gru' needs token ids"),
    "lstm on floats": (["--model=lstm"], "model 'lstm' needs"),
    "positional argument": (["extra"], "unexpected arguments 'extra'"),
    "unknown flag": (["--learning_rte=0.1"], "Unknown command line flag 'learning_rte'"),
    "integer flag text": (["--num_rounds=many"], "--num_rounds"),
}


def file_cases(tmp_path):
    not_zip = tmp_path / "junk.npz"
    not_zip.write_bytes(b"\x00" * 10)
    return {
        "missing npz": (["--dataset=npz", f"--data_path={tmp_path}/none.npz"], "no such file"),
        "npz not a zip": (["--dataset=npz", f"--data_path={not_zip}"], "not a readable .npz"),
        "one class": (npz(tmp_path, "one.npz", train_y=np.zeros(40, int),
                          test_y=np.zeros(20, int)), "at least 2 classes"),
        "labels 2-D": (npz(tmp_path, "y2.npz", train_y=np.zeros((40, 2), int)), "train_y"),
        "negative labels": (npz(tmp_path, "neg.npz", train_y=-np.ones(40, int)), "train_y"),
        "object features": (npz(tmp_path, "obj.npz", train_x=np.array([None] * 40)),
                            "not a readable .npz"),
        "empty test split": (npz(tmp_path, "empty.npz", test_x=np.zeros((0, 3), np.float32),
                                 test_y=np.zeros(0, int), test_client=np.zeros(0, int)),
                             "test"),
        "NaN features": (npz(tmp_path, "nan.npz",
                             train_x=np.full((40, 3), np.nan, np.float32)), "NaN"),
    }


def assert_refused(tmp_path, capsys, args, message, name):
    out = tmp_path / ("out_" + name.replace(" ", "_"))
    code, err, _ = run_runner([f"--flagfile={TINY}", f"--output_dir={out}"] + args, capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2, (name, err)
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("error: "), (name, err)
    assert not out.exists(), name


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_flag_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, name):
    args, message = CASES[name]
    assert_refused(tmp_path, capsys, args, message, name)


@pytest.mark.parametrize("name", ["missing npz", "npz not a zip", "one class", "labels 2-D",
                                  "negative labels", "object features", "empty test split",
                                  "NaN features"])
def test_bad_file_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, name):
    args, message = file_cases(tmp_path)[name]
    assert_refused(tmp_path, capsys, args, message, name)


def test_output_dir_that_is_a_file_is_refused_and_left_alone(tmp_path, capsys):
    target = tmp_path / "results.txt"
    target.write_text("precious")
    code, err, _ = run_runner([f"--flagfile={TINY}", f"--output_dir={target}"], capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and "--output_dir" in lines[0], err
    assert target.read_text() == "precious"


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_disk_full_while_writing_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    from deltafl_jax.outputs import directory as outputs

    def full(self, records):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path("metrics.jsonl"))

    monkeypatch.setattr(outputs.RunWriter, "append_metrics", full)
    out = tmp_path / "out"
    code, err, _ = run_runner([f"--flagfile={TINY}", f"--output_dir={out}"], capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "No space left on device" in lines[0] and "--output_dir" in lines[0]
