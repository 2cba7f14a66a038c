import os
import shutil
import sys
import tempfile

# Most of the suite's time is XLA compiling small programs, and many tests build the same
# program (the same tiny model, shapes and round) in separate experiments: one persistent
# compilation cache for the whole run, shared by the xdist workers and the commands the tests
# start (set before jax is imported; a fresh directory per run, so nothing is reused across
# runs or code versions).
_OWN_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_XLA_CACHE = tempfile.mkdtemp(prefix="deltafl_tests_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_XLA_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# The commands split a CPU host into one device per core unless --devices or XLA_FLAGS choose;
# the tests run on one host device (the trip counts and layouts they check), and a test that
# wants more asks for them (its own XLA_FLAGS, last one wins, or --devices).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=1").strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_unconfigure(config):
    """The process that made the compilation cache (not an xdist worker) removes it."""
    if _OWN_XLA_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_XLA_CACHE, ignore_errors=True)


sys.path.insert(0, os.path.dirname(__file__))

from deltafl_jax import DataConfig, ExperimentConfig, FederatedDataset  # noqa: E402
from deltafl_jax.data import split_clients  # noqa: E402
from deltafl_jax.datasets.synthetic import synthetic_clients  # noqa: E402


def run_runner(argv, capsys):
    """Runs experiments.run in-process; returns (exit code, stderr, stdout)."""
    from experiments import run as runner
    runner.FLAGS.unparse_flags()
    code = 0
    try:
        rest = runner.parse_flags_or_fail(["run"] + list(argv))
        runner.main(rest)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.err, captured.out


@pytest.fixture(scope="session")
def tiny_synthetic():
    """24 synthetic clients of 50..80 examples (12 train / 12 test), 60 features, 10 classes."""
    clients = synthetic_clients(1.0, 1.0, 24, seed=3, max_examples=80, shared=0.5)
    train, test = split_clients(clients, seed=3)
    return FederatedDataset("synthetic", train, test, num_classes=10)


def tiny_config(**overrides):
    """A small configuration; a swept flag of a baseline (fedprox_mu=..., qffl_q=...) may be
    passed as a keyword and goes into ``sweeps``, an algorithm's option (filter=...,
    weighting=...) into ``options``."""
    from deltafl_jax.algorithms import registry
    base = dict(data=DataConfig("synthetic"), model="linear", thetas=(1.0, 0.5), seeds=(1,),
                num_rounds=3, clients_per_round=6, batch_size=8, learning_rate=0.05,
                eval_every=3, output_dir=None, save_models=False, verbose=False)
    flags = {s.flag for s in registry.sweeps()} - {"thetas"}
    sweeps = {k: tuple(overrides.pop(k)) for k in list(overrides) if k in flags}
    option_flags = {name for name, _ in registry.options()}
    options = {k: overrides.pop(k) for k in list(overrides) if k in option_flags}
    base.update(overrides)
    return ExperimentConfig(**base, sweeps=sweeps, options=options)


@pytest.fixture
def make_config():
    return tiny_config


def run_rounds_history(exp, rounds):
    """Run `rounds` rounds of a built experiment; (final state, per-round host metrics)."""
    import jax
    state, keys, hist = exp.initial_state(), exp.keys(), []
    for t in range(rounds):
        state, metrics = exp.round_fn(state, exp.round_data(t, state), keys)
        hist.append(jax.device_get(metrics))
    return state, hist


def linear_rows(params, r):
    """(W, b) in float64 of replica r of a softmax regression's params ({'Dense_0': ...})."""
    import jax
    p = jax.device_get(params)["Dense_0"]
    return np.asarray(p["kernel"][r], np.float64), np.asarray(p["bias"][r], np.float64)


def client_lists(split):
    """(xs, ys): each client's inputs (float64) and labels, for the NumPy references."""
    xs = [split.client(k)[0].astype(np.float64) for k in range(split.num_clients)]
    ys = [split.client(k)[1] for k in range(split.num_clients)]
    return xs, ys


def client_job(learning_rate, steps, l2=0.0):
    """The job a client update sees, with the default client optimizer (plain SGD)."""
    from deltafl_jax.client_optimizer import ClientOptimizer
    from deltafl_jax.engine import ClientJob
    return ClientJob(optimizer=ClientOptimizer().transformation(learning_rate, l2),
                     learning_rate=np.float32(learning_rate), l2=np.float32(l2),
                     steps=np.int32(steps))
