"""Tuning a baseline's swept parameter on validation clients.

The rule, from the paper's lambda protocol (Sec. 5, App. C.2.2) applied to q / mu / t /
gamma_lambda: train every value on half the training clients, score the 90th percentile of the
misclassification error over the other half (unweighted lower quantile), mean over seeds, take
the smallest. The expected winner is recomputed here from the grid's clients.npz with NumPy.
"""

import json
import os

import numpy as np
import pytest

from test_tune import TINY, cli, lower_p90_unweighted


def validation_p90(run_dir):
    z = np.load(os.path.join(run_dir, "clients.npz"))
    per = {}
    for r, key in enumerate(z["replica_keys"]):
        per.setdefault(str(key).rsplit("_seed=", 1)[0], []).append(
            lower_p90_unweighted(z["test_error"][r]))
    return {k: float(np.mean(v)) for k, v in per.items()}, z


@pytest.mark.parametrize("algorithm, flag, values", [
    ("qffl", "qffl_q", (0.01, 1.0, 5.0)),
    ("fedprox", "fedprox_mu", (0.0, 1.0, 10.0)),
])
def test_baseline_parameter_is_the_validation_p90_argmin(tmp_path, capsys, algorithm, flag,
                                                         values):
    out = tmp_path / "tune"
    code, err, stdout = cli([f"--flagfile={TINY}", f"--output_dir={out}",
                             f"--algorithm={algorithm}",
                             f"--{flag}={','.join(f'{v:g}' for v in values)}",
                             "--notune_lr", "--learning_rate=0.2"], capsys)
    assert code == 0, err
    means, z = validation_p90(out / "param_grid")
    # The grid trained on 5 of the 10 training clients and scored the other 5.
    assert len(z["train_sizes"]) == 5 and len(z["test_sizes"]) == 5
    keys = [f"{flag}={v:g}" for v in values]
    assert sorted(means) == sorted(keys)
    win = values[min(range(len(values)), key=lambda i: (means[keys[i]], i))]
    record = json.load(open(out / "tuning.json"))
    assert record["param"]["flag"] == flag and record["param"]["value"] == win
    assert record["l2_scores"] == []          # lambda is tuned for Delta-FL / FedAvg only
    lines = open(out / "tuned.flags").read().splitlines()
    assert f"--{flag}={win!r}" in lines and f"--algorithm={algorithm}" in lines
    assert f"--{flag} (validation clients)" in open(out / "tuning.md").read()
    # The runner accepts the flagfile: one value, the chosen one.
    from experiments import run as runner
    runner.FLAGS.unparse_flags()
    runner.parse_flags_or_fail(["run", f"--flagfile={out / 'tuned.flags'}"])
    (config,) = runner.planned_configs()
    assert config.algorithm == algorithm and config.sweep(flag) == (win,)


def test_tune_param_needs_a_baseline_with_a_sweep(tmp_path, capsys):
    out = tmp_path / "tune"
    code, err, _ = cli([f"--flagfile={TINY}", f"--output_dir={out}", "--tune_param=yes"],
                       capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and "--tune_param" in lines[0], err
    assert not out.exists()
