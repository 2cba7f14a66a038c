"""Clients kept on the host (``--client_data=host``) against clients on the device, clients
generated on demand, and sampled evaluation wired into a run.

The reference for host mode is device mode: the same examples reach the same computations, so
every output is equal bit for bit on one device. The packed plan and the evaluation blocks are
also checked against the unpacked plan and the whole stream, entry by entry.
"""

import json
import os

import jax
import numpy as np
import pytest

from conftest import run_runner
from deltafl_jax import DataConfig
from deltafl_jax.data import ClientData, GeneratedClientData, is_generated, split_clients
from deltafl_jax.datasets import load_dataset
from deltafl_jax.datasets import synthetic as syn
from deltafl_jax.errors import ConfigError, DataError
from deltafl_jax.run.experiment import build_experiment
from deltafl_jax.sampling import plan as plan_lib

EXPERIMENTS = os.path.join(os.path.dirname(__file__), "..", "experiments")


def _outputs(out):
    """Every output file of a run, read back: rounds/clients arrays, the metrics records
    without their wall-clock field, and the models' bytes."""
    got = {}
    for name in ("rounds.npz", "clients.npz", "clients_history.npz"):
        with np.load(os.path.join(out, name)) as z:
            got.update({f"{name}:{k}": z[k] for k in z.files})
    with open(os.path.join(out, "metrics.jsonl")) as f:
        got["metrics"] = [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
                          for line in f]
    models = os.path.join(out, "models")
    for name in sorted(os.listdir(models)):
        with open(os.path.join(models, name), "rb") as f:
            got[f"models/{name}"] = f.read()
    return got


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a[k] == b[k], k


def _run_both(tmp_path, capsys, argv):
    got = {}
    for mode in ("device", "host"):
        out = str(tmp_path / mode)
        code, err, _ = run_runner([*argv, f"--client_data={mode}", f"--output_dir={out}",
                                   "--tensorboard=no"], capsys)
        assert code == 0, err
        got[mode] = _outputs(out)
    return got


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_host_equals_device_bit_for_bit_on_the_synthetic_demo(tmp_path, capsys):
    got = _run_both(tmp_path, capsys, [
        f"--flagfile={os.path.join(EXPERIMENTS, 'synthetic.flags')}", "--num_rounds=6",
        "--eval_every=3", "--seeds=1,2"])
    _assert_same(got["device"], got["host"])


@pytest.mark.slow
def test_host_equals_device_bit_for_bit_on_the_convnet(tmp_path, capsys):
    from bench.common import femnist_like_dataset
    data = femnist_like_dataset(num_clients=24, num_test_clients=6, seed=2)
    path = tmp_path / "femnist_like.npz"
    np.savez(path, train_x=data.train.x, train_y=data.train.y,
             train_client=np.repeat(np.arange(24), data.train.sizes),
             test_x=data.test.x, test_y=data.test.y,
             test_client=np.repeat(np.arange(6), data.test.sizes), num_classes=62,
             x_scale=1 / 255)
    got = _run_both(tmp_path, capsys, [
        "--dataset=npz", f"--data_path={path}", "--model=cnn", "--thetas=1.0,0.5",
        "--num_rounds=3", "--eval_every=3", "--clients_per_round=4", "--batch_size=16",
        "--learning_rate=0.02"])
    _assert_same(got["device"], got["host"])


def _small(make_config, **kw):
    data = load_dataset(DataConfig("synthetic", synthetic_num_clients=60, data_seed=4,
                                   synthetic_shared=0.5))
    return data, make_config(**kw)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_sampled_evaluation_is_the_same_in_both_modes_and_reads_its_clients(make_config):
    data, _ = _small(make_config)
    per = {}
    for mode in ("device", "host"):
        exp = build_experiment(_small(make_config, client_data=mode, eval_clients=7)[1], data)
        state = exp.initial_state()
        state, _ = exp.round_fn(state, exp.round_data(0), exp.keys())
        per[mode] = exp.evaluate(exp.served_params(state), 3)
        full = build_experiment(_small(make_config, client_data=mode, eval_clients=0)[1], data)
        whole = full.evaluate(exp.served_params(state), 3)
        sample = exp.evaluation_sample(3)
        for name in ("train", "test"):   # the sample's values are the full evaluation's
            ids = getattr(sample, name)
            np.testing.assert_array_equal(per[mode][f"{name}_clients"], ids)
            for what in ("loss", "error"):
                np.testing.assert_allclose(per[mode][f"{name}_{what}"],
                                           whole[f"{name}_{what}"][:, ids], rtol=1e-6,
                                           atol=1e-7)
    for k in per["device"]:
        np.testing.assert_array_equal(per["device"][k], per["host"][k], err_msg=k)
    summary = exp.summarize(per["host"])
    assert np.all(summary["test_error_p90_lo"] <= summary["test_error_p90"])
    assert np.all(summary["test_error_p90"] <= summary["test_error_p90_hi"])


def test_packed_plan_reads_the_same_examples_as_the_split_plan():
    rng = np.random.default_rng(0)
    sizes = rng.integers(3, 40, size=30)
    split = ClientData(x=rng.normal(size=(int(sizes.sum()), 2)).astype(np.float32),
                       y=rng.integers(0, 5, size=int(sizes.sum())).astype(np.int32),
                       offsets=np.concatenate([[0], np.cumsum(sizes)]),
                       client_ids=np.arange(30))
    work = plan_lib.LocalWork(batch_size=4, local_epochs=2)
    caps = plan_lib.capacities(split.sizes, 5, work, eval_chunk=8)
    plain = plan_lib.make_round_plan((1, 9), 3, split.offsets, 5, work, caps)
    packed = plan_lib.make_round_plan((1, 9), 3, split.offsets, 5, work, caps, packed=True)
    x, y = plan_lib.pack_round(split, packed.clients, caps)
    np.testing.assert_array_equal(plain.clients, packed.clients)
    for g in range(2):
        n = plain.eval_len[g]
        np.testing.assert_array_equal(x[packed.eval_idx[g, :n]], split.x[plain.eval_idx[g, :n]])
        np.testing.assert_array_equal(y[packed.eval_idx[g, :n]], split.y[plain.eval_idx[g, :n]])
        used = int(packed.train_start[g, -1] + 2 * packed.sizes[g, -1])
        np.testing.assert_array_equal(x[packed.train_idx[g, :used]],
                                      split.x[plain.train_idx[g, :used]])
    for f in ("eval_seg", "eval_len", "train_start", "seg_len", "steps", "sizes"):
        np.testing.assert_array_equal(getattr(plain, f), getattr(packed, f), err_msg=f)


def test_stream_blocks_cover_the_stream_in_order():
    sizes = np.array([5, 1, 12, 3, 7])
    blocks = list(plan_lib.stream_blocks(sizes, 8, pad_segment=99))
    whole = np.repeat(np.arange(5), sizes)
    assert [(b.lo, b.hi) for b in blocks] == [(0, 8), (8, 16), (16, 24), (24, 28)]
    for b in blocks:
        np.testing.assert_array_equal(b.seg[0, :b.hi - b.lo], whole[b.lo:b.hi])
        assert np.all(b.seg[0, b.hi - b.lo:] == 99)
        assert (b.first, b.last) == (whole[b.lo], whole[b.hi - 1] + 1)


def _reference_client(alpha, beta, n_clients, seed, cap, rho, k):
    """Synthetic client k of the on-demand generator, from the module docstring's streams."""
    pop = np.random.default_rng([seed, 0])
    size = np.minimum(pop.lognormal(4, 2, n_clients).astype(np.int64) + 50, cap)[k]
    u = pop.normal(0.0, alpha, n_clients)[k]
    shift = pop.normal(0.0, beta, n_clients)[k]
    W0, b0 = pop.standard_normal((60, 10)), pop.standard_normal(10)
    own = np.random.default_rng([seed, 1, k])
    v = own.normal(shift, 1.0, 60)
    W = u + rho * W0 + np.sqrt(1 - rho ** 2) * own.standard_normal((60, 10))
    b = u + rho * b0 + np.sqrt(1 - rho ** 2) * own.standard_normal(10)
    z = own.standard_normal((size, 60), dtype=np.float32)
    x = (v + z * np.arange(1, 61) ** -0.6).astype(np.float32)
    logits = np.einsum("nd,dc->nc", x, W.astype(np.float32)) + b.astype(np.float32)
    return x, np.argmax(logits, axis=1)


def test_on_demand_synthetic_clients_are_their_streams_and_repeatable():
    gen = syn.synthetic_on_demand(1.0, 0.5, 300, seed=7, max_examples=400, shared=0.9)
    assert is_generated(gen) and gen.num_clients == 300
    for k in (0, 123, 299):
        x, y = gen.client(k)
        rx, ry = _reference_client(1.0, 0.5, 300, 7, 400, 0.9, k)
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
    x1, y1 = gen.gather([5, 2, 5])
    x2, y2 = gen.gather([5, 2, 5])
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(x1, np.concatenate([gen.client(k)[0] for k in (5, 2, 5)]))
    sub = gen.subset([9, 4]).truncated(60)
    np.testing.assert_array_equal(sub.sizes, np.minimum(gen.sizes[[9, 4]], 60))
    np.testing.assert_array_equal(sub.client(1)[0], gen.client(4)[0][:60])


def test_today_s_synthetic_data_is_unchanged_below_the_threshold():
    cfg = DataConfig("synthetic", synthetic_num_clients=40, data_seed=2)
    assert not syn.on_demand(cfg)
    assert syn.on_demand(DataConfig("synthetic", synthetic_num_clients=syn.ON_DEMAND_CLIENTS + 2))
    data = load_dataset(cfg)
    train, _ = split_clients(syn.synthetic_clients(1.0, 1.0, 40, 2), seed=2)
    np.testing.assert_array_equal(data.train.x, train.x)


def test_a_million_clients_build_without_their_examples(make_config):
    data_cfg = DataConfig("synthetic", synthetic_num_clients=1_000_000)
    data = load_dataset(data_cfg)
    assert isinstance(data.train, GeneratedClientData) and data.train.num_clients == 500_000
    exp = build_experiment(make_config(data=data_cfg, clients_per_round=10), data)
    assert exp.placement.client_data == "host" and exp.evaluator.eval_clients == 1000
    line = exp.view().facts.placement_line
    assert "the host keeps the 500000 + 500000 clients" in line
    # The device holds a round's buffer and one evaluation block, whatever N is.
    row = (60 * 4 + 4)
    assert exp.program.footprint.data == row * (exp.program.caps.eval_len + exp.placement.eval_block)
    chunk = exp.placement.eval_chunk
    assert exp.program.caps.eval_len == -(-10 * 1000 // chunk) * chunk   # m clients at the size cap
    small_cfg = DataConfig("synthetic", synthetic_num_clients=1000, synthetic_on_demand=True)
    small = build_experiment(make_config(data=small_cfg, clients_per_round=10, eval_clients=50),
                             load_dataset(small_cfg))
    assert small.program.footprint.data == exp.program.footprint.data
    state, _ = exp.round_fn(exp.initial_state(), exp.round_data(0), exp.keys())
    assert np.all(np.isfinite(jax.device_get(state.params["w"] if "w" in state.params
                                             else jax.tree.leaves(state.params)[0])))


def test_bad_client_data_and_eval_clients_are_one_line_errors(make_config):
    with pytest.raises(ConfigError, match="--client_data must be one of"):
        make_config(client_data="gpu")
    with pytest.raises(ConfigError, match="--eval_clients must be >= 0"):
        make_config(eval_clients=-3)
    data_cfg = DataConfig("synthetic", synthetic_num_clients=200, synthetic_on_demand=True)
    with pytest.raises(ConfigError, match="generated on demand"):
        build_experiment(make_config(data=data_cfg, client_data="device"), load_dataset(data_cfg))
    with pytest.raises(DataError, match="--normalize=none"):
        load_dataset(DataConfig("synthetic", synthetic_num_clients=200,
                                synthetic_on_demand=True, normalize="standard"))


@pytest.mark.slow
def test_a_million_client_run_from_the_command_line_reports_intervals(tmp_path):
    """The README's population command: a million generated clients, two rounds, a sampled
    evaluation whose intervals reach metrics.jsonl and the progress line."""
    import subprocess
    import sys
    out = tmp_path / "population"
    cmd = [sys.executable, "-m", "experiments.run", "--dataset=synthetic",
           "--synthetic_num_clients=1000000", "--synthetic_shared=0.98", "--model=linear",
           "--thetas=1.0,0.5", "--num_rounds=2", "--eval_every=2", "--clients_per_round=20",
           "--eval_clients=200", "--learning_rate=0.02", f"--output_dir={out}",
           "--tensorboard=no"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "the host keeps the 500000 + 500000 clients" in done.stdout + done.stderr
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 2
    for rec in records:
        assert rec["test_error_p90_lo"] <= rec["test_error_p90"] <= rec["test_error_p90_hi"]
        assert rec["train_loss_p50_lo"] <= rec["train_loss_p50"] <= rec["train_loss_p50_hi"]
    with np.load(out / "clients.npz") as z:
        assert z["train_loss"].shape == (2, 200) and z["train_clients"].shape == (200,)
        assert np.all(np.diff(z["train_clients"]) >= 0)


def test_the_report_reads_a_sampled_run_as_the_run_summarised_it(tmp_path, make_config):
    """metrics.jsonl holds the run's own estimates and intervals; the report recomputes them
    from clients.npz / clients_history.npz with the sample's statistics, not every client's."""
    from deltafl_jax import run_experiment
    from deltafl_jax.report.io import read_run
    data, _ = _small(make_config)
    out = str(tmp_path / "sampled")
    run_experiment(_small(make_config, eval_clients=9, output_dir=out, num_rounds=4,
                          eval_every=2)[1], data)
    run = read_run(out)
    final = run.final()
    rounds, curves = run.curves()
    np.testing.assert_array_equal(rounds, [2, 4])
    for r in range(len(run.keys)):
        last = [rec for rec, i in zip(run.records, run.record_replicas)
                if rec["round"] == 4 and i == r][0]
        first = [rec for rec, i in zip(run.records, run.record_replicas)
                 if rec["round"] == 2 and i == r][0]
        for name in ("test_error_p90", "test_error_p90_lo", "test_error_p90_hi",
                     "train_loss_p50", "train_loss_p50_hi", "train_loss_mean"):
            np.testing.assert_allclose(final[name][r], last[name], rtol=1e-6, err_msg=name)
            np.testing.assert_allclose(curves[name][0, r], first[name], rtol=1e-6,
                                       err_msg=name)
