"""What a new user hit on a first run (issue 51), each answered as the project answers bad
input: one line naming what is wrong, exit code 2, nothing written; and what is no error.

- a model of one's own given data of another shape (a 2-D convolution on Synthetic's flat
  features) names the model, the examples' shape and the dataset, as the built-in ``cnn``
  does, not JAX's or NumPy's words alone ("operands could not be broadcast together with
  shapes (0,) (2,)");
- a text file given as ``--availability_schedule`` says that an ``.npz`` holding
  ``available`` was expected, not that it holds "pickled (object) data";
- an asynchronous run (FedBuff, FedAsync) never reads ``--clients_per_round``: the default 10
  with fewer training clients is no error (a synchronous one still refuses it);
- a run of several algorithms prints no DeprecationWarning (the commands read every setting
  through its group; ``tests/test_config_access.py`` scans ``experiments/`` for flat reads).

In process here; by subprocess in the slow tests (CI's second step).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import run_runner, tiny_config
from deltafl_jax.errors import ConfigError
from deltafl_jax.run.resolve import resolve
from test_newcomer_errors import one_line_refusal

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TINY = os.path.join(HERE, "tiny.flags")

# A small CNN of one's own (docs/guides/own-model.md's recipe): a 2-D convolution wants
# [H, W, C] examples; Synthetic's are 60 flat features.
TINY_CNN = '''
import flax.linen as nn
import deltafl_jax


class TinyCNN(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), padding={padding})(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(self.classes)(x.reshape(x.shape[0], -1))


def tiny_cnn(data, options):
    return deltafl_jax.Model(name="tiny_cnn", module=TinyCNN(data.num_classes),
                             loss_kind="softmax", example_shape=data.feature_shape,
                             input_dtype=data.train.x_dtype, input_scale=data.x_scale)


deltafl_jax.register_model("tiny_cnn", tiny_cnn, replace=True)
'''


def _own_model(tmp_path, padding):
    path = tmp_path / "my_tiny_cnn.py"
    path.write_text(TINY_CNN.format(padding=padding))
    return ["--dataset=synthetic", f"--model_module={path}", "--model=tiny_cnn"]


def _text_schedule(tmp_path):
    path = tmp_path / "schedule.txt"
    path.write_text("round,client,online\n0,0,1\n")
    return ["--availability=schedule", f"--availability_schedule={path}"]


# 'SAME' padding: NumPy's broadcast error inside Flax; 'VALID': lax's rank error.
@pytest.mark.parametrize("padding", ['"SAME"', '"VALID"'])
def test_an_own_model_given_data_of_another_shape_names_the_mismatch(tmp_path, capsys,
                                                                     padding):
    out = str(tmp_path / "out")
    code, err, _ = run_runner([f"--flagfile={TINY}", *_own_model(tmp_path, padding),
                               f"--output_dir={out}"], capsys)
    line = one_line_refusal(code, err, out)
    assert line.startswith("error: model 'tiny_cnn' cannot take synthetic's examples of "
                           "shape (60,) (float32)"), line


def test_a_text_file_as_the_schedule_says_what_file_was_expected(tmp_path, capsys):
    out = str(tmp_path / "out")
    code, err, _ = run_runner([f"--flagfile={TINY}", *_text_schedule(tmp_path),
                               f"--output_dir={out}"], capsys)
    line = one_line_refusal(code, err, out)
    assert "pickled" not in line and "allow_pickle" not in line, line
    assert "--availability_schedule=" in line and "not a readable .npz" in line
    assert "expected an .npz holding 'available', bool [rounds, clients]" in line


@pytest.mark.parametrize("algorithm", ["fedbuff", "fedasync"])
def test_an_asynchronous_run_accepts_more_clients_per_round_than_clients(tiny_synthetic,
                                                                          algorithm):
    """12 training clients and the default --clients_per_round=10 raised above them: the
    asynchronous run resolves (C = 5 jobs in flight); FedAvg's synchronous round is still
    refused."""
    n = tiny_synthetic.train.num_clients
    config = tiny_config(algorithm=algorithm, thetas=(1.0,), clients_per_round=n + 8,
                         client_speed="lognormal", concurrency=5, buffer_size=3)
    run = resolve(config, tiny_synthetic)
    assert run.num_sampled <= n
    with pytest.raises(ConfigError, match=f"--clients_per_round={n + 8} exceeds the {n} "):
        resolve(tiny_config(algorithm="fedavg", thetas=(), clients_per_round=n + 8),
                tiny_synthetic)


# -- by subprocess (a process start each, and runs): CI's second step -----------------------

def _command(*args):
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["own model", "text schedule"])
def test_the_command_names_the_mismatch_by_subprocess(tmp_path, case):
    out = str(tmp_path / "out")
    flags = _own_model(tmp_path, '"SAME"') if case == "own model" else _text_schedule(tmp_path)
    proc = _command(f"--flagfile={TINY}", *flags, f"--output_dir={out}")
    line = one_line_refusal(proc.returncode, proc.stderr, out)
    assert ("cannot take synthetic's examples of shape (60,)" if case == "own model"
            else "expected an .npz holding 'available'") in line, line


@pytest.mark.slow
def test_two_asynchronous_methods_with_fewer_clients_than_the_default_run_quietly(tmp_path):
    """Synthetic with 8 clients (4 for training), the default --clients_per_round=10, FedBuff
    and FedAsync in one command: exit 0, both runs written, the comparison printed, and no
    warning on stderr (a flat settings read printed a DeprecationWarning)."""
    out = tmp_path / "two"
    proc = _command(f"--flagfile={TINY}", "--synthetic_num_clients=8", "--clients_per_round=10",
                    "--algorithm=fedbuff,fedasync", "--thetas=1", "--seeds=1",
                    "--num_rounds=2", "--eval_every=2", "--concurrency=2", "--buffer_size=2",
                    "--tensorboard=no", f"--output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    assert sorted(os.listdir(out)) == ["fedasync", "fedbuff"]
    assert "Final test error per method (mean over seeds):" in proc.stdout
    assert np.isfinite([float(line.split()[1].rstrip("%")) for line in
                        proc.stdout.split("per method (mean over seeds):")[1].splitlines()
                        if line.startswith(("fedbuff", "fedasync"))]).all()
