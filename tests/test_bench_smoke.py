"""Smoke runs of the benchmark scripts at tiny sizes, so that they keep working: every
``bench/*.py`` with a ``__main__`` is run end to end by a test named in SMOKE_RUNS (a test
fails when a script has none). The figures themselves are not asserted (machines are noisy);
the JSON's shape and its internal consistency are. Two halves need what CI's venv does not hold,
and only they are skipped, with the reason in pytest's summary: bench/compare.py's PyTorch loop
(the `bench` extra, `pip install -e '.[bench]'`; the engine and the JAX loop run without it) and
the peers' own scripts (bench/peer_fedjax.py, bench/peer_drjax.py), which run in the pinned
venvs `python -m bench.peers` creates from the package index (the engine's half runs without
them), and pfl-research's side of bench/peer_pfl.py (bench/peer_pfl_worker.py), which runs in a
venv holding `pfl` and torch that is no dependency of this package (docs/benchmarks/
pfl-research.md: `.venv-pfl/` at the repository's root, or the python named by $PFL_PYTHON)."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(__file__))

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed; bench/compare.py's PyTorch loop needs the bench extra: "
           "pip install -e '.[bench]'")


def run_json(args, tmp_path, name, host_devices=None):
    """Run a bench entry point into tmp_path; `host_devices`: the CPU host split into that many
    devices (the tests run on one unless a test asks, tests/conftest.py)."""
    out = tmp_path / f"{name}.json"
    env = dict(os.environ)
    if host_devices:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                            + f" --xla_force_host_platform_device_count={host_devices}").strip()
    proc = subprocess.run([sys.executable, "-m"] + args + [f"--out={out}"], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_femnist_like_sizes_have_femnist_shape():
    from bench.common import femnist_like_sizes
    sizes = femnist_like_sizes(865, seed=0)
    assert sizes.min() == 101 and sizes.max() == 447
    assert abs(np.median(sizes) - 179) <= 6


@pytest.mark.slow
def test_round_speed_smoke(tmp_path):
    res = run_json(["bench.round_speed", "--shapes=cnn,linear", "--cnn_lanes=1",
                    "--linear_lanes=1,3", "--clients=3", "--num_clients=8", "--rounds=1"],
                   tmp_path, "round_speed")
    assert set(res["shapes"]) == {"cnn", "linear"}
    for shape, per_lanes in res["shapes"].items():
        for lanes, row in per_lanes.items():
            assert "error" not in row, row
            assert row["clients_per_step"] == int(lanes)
            assert row["s_per_round"] > 0 and row["peak_rss_mb"] > 0
            assert row["padded_over_real"] >= 1.0
            assert row["trained_over_kept"] == pytest.approx(1.0)


COMPARE_KEYS = {"model", "backend", "engine_s_per_round", "torch_loop_s_per_round",
                "jax_loop_s_per_round", "speedup_vs_torch", "speedup_vs_jax_loop",
                "padded_over_real", "trained_over_kept", "compile_s", "peak_rss_mb"}


@pytest.mark.slow
def test_compare_smoke_engine_and_jax_loop(tmp_path):
    """The documented command, `python -m bench.compare --model=linear --json --out=F`, at toy
    size without the PyTorch loop (CI's venv has no torch)."""
    res = run_json(["bench.compare", "--model=linear", "--json", "--methods=engine,jax_loop",
                    "--clients=3", "--num_clients=8", "--rounds=1", "--warmup=1"], tmp_path,
                   "compare")
    assert COMPARE_KEYS <= set(res) and res["model"] == "linear"
    assert res["torch_loop_s_per_round"] is None and res["speedup_vs_torch"] is None
    assert res["speedup_vs_jax_loop"] == pytest.approx(
        res["jax_loop_s_per_round"] / res["engine_s_per_round"])
    assert res["trained_over_kept"] == pytest.approx(1.0)


def test_compare_without_torch_says_so_in_one_line(tmp_path):
    """Asking for the PyTorch loop where torch is not installed: one line naming the extra and
    the flag that leaves it out, exit code 2, nothing written."""
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here: the PyTorch loop runs (test_compare_smoke)")
    out = tmp_path / "compare.json"
    proc = subprocess.run([sys.executable, "-m", "bench.compare", "--model=linear",
                           f"--out={out}"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "compare: error: torch is not installed: pip install -e '.[bench]' for the PyTorch "
        "loop, or pass --methods=engine,jax_loop"]
    assert not out.exists()


@needs_torch
@pytest.mark.parametrize("model", ["linear", "cnn"])
def test_compare_smoke(tmp_path, model):
    res = run_json(["bench.compare", f"--model={model}", "--clients=3", "--num_clients=8",
                    "--rounds=1", "--warmup=1"], tmp_path, "compare")
    assert COMPARE_KEYS <= set(res)
    assert res["speedup_vs_torch"] == pytest.approx(
        res["torch_loop_s_per_round"] / res["engine_s_per_round"])
    assert res["trained_over_kept"] == pytest.approx(1.0)


def flagfile_value(flagfile, name):
    """The value of --name in an experiments/ flagfile, as text."""
    with open(os.path.join(REPO, flagfile)) as f:
        values = [line.strip().split("=", 1)[1] for line in f
                  if line.strip().startswith(f"--{name}=")]
    assert len(values) == 1, (flagfile, name, values)
    return values[0]


def check_recurrent_compare(res, model, methods):
    """A toy compare run of the recurrent workloads: its flagfile's batch size and learning rate,
    and the same work for every method. Three clients capped at 40 examples each (Shakespeare's
    and Sent140's smallest hold 101 and 51), theta = 0.5: each client's cap is
    40 / (0.5 * 120) = 2/3 of the mass, so the largest loss gets 2/3, the next 1/3, the third
    none, whatever the losses: 2 clients kept and 80 examples trained by each method."""
    flagfile = {"gru": "experiments/shakespeare.flags",
                "lstm": "experiments/sent140_lstm.flags"}[model]
    assert COMPARE_KEYS <= set(res) and res["model"] == model and res["flagfile"] == flagfile
    assert res["batch_size"] == int(flagfile_value(flagfile, "batch_size"))
    assert res["learning_rate"] == float(flagfile_value(flagfile, "learning_rate"))
    assert res["m"] == 3 and res["num_clients"] == 8 and res["max_client_size"] == 40
    assert res["sampled_examples_per_round"] == [120]
    assert set(res["work_per_round"]) == set(methods)
    for work in res["work_per_round"].values():
        assert work == {"kept_clients": 2.0, "trained_examples": 80.0}
    assert res["trained_over_kept"] == pytest.approx(1.0)


RECURRENT_TOY = ["--clients=3", "--num_clients=8", "--max_client_size=40", "--rounds=1",
                 "--warmup=1"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gru", "lstm"])
def test_compare_recurrent_engine_and_jax_loop(tmp_path, model):
    """`python -m bench.compare --model=gru|lstm` at toy size, engine and JAX loop (CI's venv
    has no torch; test_compare_recurrent_against_torch runs the PyTorch loop where it is)."""
    res = run_json(["bench.compare", f"--model={model}", "--methods=engine,jax_loop",
                    *RECURRENT_TOY], tmp_path, "compare")
    check_recurrent_compare(res, model, ["engine", "jax_loop"])
    assert res["torch_loop_s_per_round"] is None


@needs_torch
@pytest.mark.slow
@pytest.mark.parametrize("model", ["gru", "lstm"])
def test_compare_recurrent_against_torch(tmp_path, model):
    """The same toy runs with torch.nn.GRU / torch.nn.LSTM's per-client loop as well."""
    res = run_json(["bench.compare", f"--model={model}", *RECURRENT_TOY], tmp_path, "compare")
    check_recurrent_compare(res, model, ["engine", "torch", "jax_loop"])
    assert res["speedup_vs_torch"] == pytest.approx(
        res["torch_loop_s_per_round"] / res["engine_s_per_round"])


@pytest.mark.slow
def test_theta_sweep_smoke(tmp_path):
    res = run_json(["bench.theta_sweep", "--r=2", "--clients=3", "--num_clients=8",
                    "--rounds=1"], tmp_path, "theta_sweep")
    rows = {row["r"]: row for row in res["rows"]}
    assert set(rows) == {2}
    assert rows[2]["joint_compiles"] == 1 and rows[2]["separate_compiles"] == 2
    assert len(rows[2]["separate_s_per_round_each"]) == 2


def test_emnist_shaped_smoke_writes_a_loadable_npz(tmp_path):
    """bench/emnist_shaped.py at toy size: the file loads with --dataset=npz (its writers as
    clients, 10 classes, 28x28 pixels scaled by 1/255), the same seed writes the same arrays,
    and a stroke's ink is the Gaussian profile of its distance to the segment (by hand:
    exp(-d^2 / 2) at width 1, d = 2 beside it and d = 3 beyond its end)."""
    from bench import emnist_shaped
    from deltafl_jax import DataConfig, load_dataset
    out = tmp_path / "e.npz"
    info = emnist_shaped.main([f"--out={out}", "--train_clients=5", "--test_clients=5",
                               "--size_scale=0.05"])
    assert info["strong_train"] == info["strong_test"] == 1
    data = load_dataset(DataConfig("npz", data_path=str(out)))
    assert (data.train.num_clients, data.test.num_clients, data.num_classes) == (5, 5, 10)
    assert data.train.x.shape[1:] == (28, 28) and data.x_scale == pytest.approx(1 / 255)
    again = emnist_shaped.generate(0, 5, 5, 0.05)
    with np.load(out) as z:
        assert all(np.array_equal(z[k], again[k]) for k in z.files)
    ink = emnist_shaped.render(np.array([[[14.0, 5.0], [14.0, 20.0]]]), width=1.0)
    assert ink[14, 10] == 1.0 and ink[16, 10] == pytest.approx(np.exp(-2.0))
    assert ink[14, 2] == pytest.approx(np.exp(-4.5))

@pytest.mark.slow
def test_loop_shape_smoke_trains_identical_models(tmp_path):
    res = run_json(["bench.loop_shape", "--model=linear", "--shapes=1,3,b1,b2", "--clients=3",
                    "--num_clients=8", "--rounds=3"], tmp_path, "loop_shape")
    rows = res["shapes"]
    assert set(rows) == {"1", "3", "b1", "b2"}
    assert len({row["params_sha1"] for row in rows.values()}) == 1, rows
    for row in rows.values():
        assert row["train_loop_trips"] == pytest.approx(
            np.ceil(row["train_steps"] / row["unroll"]), abs=1)


@pytest.mark.slow
def test_peers_smoke_engine_side(tmp_path):
    """The engine half of bench/peers.py (no peer venv: --peers is empty)."""
    res = run_json(["bench.peers", "--peers=", "--models=linear", "--clients=3",
                    "--num_clients=8", "--rounds=1", "--gemm_n=256",
                    f"--cache_dir={tmp_path / 'cache'}"], tmp_path, "peers", host_devices=2)
    row = res["models"]["linear"]
    assert set(row["s_per_round"]) == {"engine_fedavg", "engine_deltafl_0.5",
                                       "engine_fedavg_2dev", "engine_deltafl_0.5_2dev"}
    for key, devices in (("engine_fedavg", 1), ("engine_fedavg_2dev", 2)):
        assert row["engine"][key]["placement"]["devices"] == devices
    one, two = row["engine"]["engine_deltafl_0.5"], row["engine"]["engine_deltafl_0.5_2dev"]
    assert 0 < two["eval_steps"] <= one["eval_steps"]   # the busiest device's trips
    assert row["engine"]["engine_fedavg"]["eval_steps"] == 0   # FedAvg does not evaluate
    for eng in row["engine"].values():
        assert eng["critical_path_steps"] == pytest.approx(
            eng["eval_steps"] + eng["train_steps"])
        assert eng["train_steps"] > 0 and eng["fraction_of_gemm_peak"] > 0
    assert os.path.exists(tmp_path / "cache" / "data")


def accelerator_run(tmp_path, backend, deadline_s=540):
    """bench/accelerator_run.sh with a stub python that prints its arguments: (exit code, the
    stub's lines, the step log's records)."""
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\necho "PY $*"\n')
    stub.chmod(0o755)
    results = tmp_path / backend
    env = dict(os.environ, BACKEND=backend, PYTHON=str(stub), RESULTS=str(results),
               DEADLINE_S=str(deadline_s), SUFFIX=backend)
    proc = subprocess.run(["bash", "bench/accelerator_run.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    log = results / f"accelerator_steps_{backend}.jsonl"
    steps = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    lines = [line[6:] for line in proc.stdout.splitlines() if line.startswith("PY -m ")]
    return proc, lines, steps


def test_accelerator_run_orders_its_steps_and_keeps_gpu_steps_to_a_gpu(tmp_path):
    """The accelerator script's shell logic, with a stub python: on a GPU the toy run, the
    ConvNet's paper run in float32 and bfloat16, the GRU's with the scan and the Pallas kernels,
    then the comparisons against torch on CUDA (gru, lstm, cnn), first and in that order; on a
    TPU no Pallas kernel, no --deterministic and no CUDA, the comparisons against the JAX loop;
    with no time left the toy step is skipped and the script stops."""
    proc, gpu, steps = accelerator_run(tmp_path, "gpu")
    out = tmp_path / "gpu"
    assert proc.returncode == 0, proc.stderr
    assert gpu[:8] == [
        f"bench.paper_grid --model=linear --scale=0.01 --rounds=1 --min_seconds=0 "
        f"--out={out}/toy.json",
        f"bench.paper_grid --model=cnn --out={out}/paper_grid_cnn_gpu.json",
        f"bench.paper_grid --model=cnn --flag=--compute_dtype=bfloat16 "
        f"--out={out}/paper_grid_cnn_bf16_gpu.json",
        f"bench.paper_grid --model=gru --rounds=2 --flag=--rnn_impl=scan "
        f"--out={out}/paper_grid_gru_gpu.json",
        f"bench.paper_grid --model=gru --rounds=2 --flag=--rnn_impl=pallas "
        f"--out={out}/paper_grid_gru_pallas_gpu.json",
        f"bench.compare --model=gru --rounds=2 --torch_device=cuda --methods=engine,torch "
        f"--out={out}/compare_gru_gpu.json",
        f"bench.compare --model=lstm --torch_device=cuda --out={out}/compare_lstm_gpu.json",
        f"bench.compare --model=cnn --torch_device=cuda --out={out}/compare_cnn_gpu.json"]
    assert "experiments.run --flagfile=experiments/emnist.flags --estimate " \
           "--compute_dtype=bfloat16" in gpu
    assert [s["rc"] for s in steps] == [0] * len(steps) and len(steps) == len(gpu) == 19
    proc, tpu, steps = accelerator_run(tmp_path, "tpu")
    assert proc.returncode == 0, proc.stderr
    assert not [c for c in tpu if "pallas" in c or "deterministic" in c or "cuda" in c]
    assert [c.split(" --out")[0] for c in tpu if c.startswith("bench.compare")] == [
        "bench.compare --model=gru --rounds=2 --methods=engine,jax_loop",
        "bench.compare --model=lstm --methods=engine,jax_loop",
        "bench.compare --model=cnn --methods=engine,jax_loop"]
    assert sorted(s["step"] for s in steps if s.get("skipped")) == [
        "estimate emnist --deterministic", "paper_grid gru pallas",
        "paper_grid gru pallas bf16", "paper_grid lstm pallas"]
    proc, lines, steps = accelerator_run(tmp_path, "cpu", deadline_s=10)
    assert proc.returncode == 1 and lines == []
    assert proc.stdout.splitlines()[-1] == "no time for the toy run: stopping"
    assert steps == [{"step": "toy", "rc": None, "s": 0, "skipped": steps[0]["skipped"]}]


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_paper_grid_toy_json_adds_up(tmp_path):
    """bench.paper_grid at toy size: the flagfile's workload shrunk (emnist_linear.flags: 4
    thetas x 5 seeds, m = 100, 3000 rounds, every 50), its JSON's fields, and its whole-run
    projection equal to its own parts; on stdout a one-screen summary of the same numbers
    (not the JSON)."""
    out = tmp_path / "paper_grid.json"
    proc = subprocess.run([sys.executable, "-m", "bench.paper_grid", "--model=linear",
                           "--scale=0.01", "--rounds=1", "--min_seconds=0", f"--out={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    lines = proc.stdout.strip().splitlines()
    assert len(lines) <= 12 and lines[-1] == f"wrote {out}", proc.stdout
    assert "{" not in proc.stdout
    assert f"s/round {res['s_per_round']:.4g}, compile {res['compile_s']:.3g} s" in proc.stdout
    assert f"whole run (projected) {res['whole_run_s']:.4g} s" in proc.stdout
    assert "30 rounds, evaluation every 30" in proc.stdout
    c = res["config"]
    assert res["model"] == "linear" and res["flagfile"] == "experiments/emnist_linear.flags"
    assert c["thetas"] == [1.0, 0.8, 0.5, 0.1] and c["seeds"] == [1]
    assert c["replicas"] == 4 and c["clients_per_round"] == 1 and c["num_rounds"] == 30
    assert c["train_clients"] == 9 and c["test_clients"] == 9 and c["eval_every"] == 30
    assert c["batch_size"] == 10 and c["local_epochs"] == 1
    p = res["whole_run_parts"]
    assert p["rounds"] == 30 and p["evaluations"] == 1
    assert res["whole_run_s"] == pytest.approx(
        p["build_s"] + p["compile_s"] + p["rounds"] * p["s_per_round"]
        + p["evaluations"] * p["s_per_evaluation"], rel=1e-9)
    assert res["s_per_round"] == p["s_per_round"] > 0 and res["compile_s"] > 0
    assert res["device_memory_bytes"] > 0 and res["device_memory_source"]
    cp = res["critical_path"]
    assert cp["train_trips"] > 0 and cp["per_round"] == cp["train_trips"] + cp["eval_trips"]
    ex = res["examples_per_round"]
    # softmax regression, 784 x 62 (no bias): a forward pass is one 784 x 62 product per
    # example (XLA counts 2 FLOPs a multiply-add, plus the softmax's few per class)
    assert 2 * 784 * 62 <= res["forward_flops_per_example"] <= 2 * 784 * 62 + 20 * 62
    assert res["round_flops"] == pytest.approx(res["forward_flops_per_example"] * (
        ex["eval_real_examples"] + 3 * ex["train_real_examples"]))
    assert res["achieved_flop_per_s"] == pytest.approx(res["round_flops"] / res["s_per_round"])
    if res["machine"]["backend"] == "cpu":
        assert res["device_peak_flop_per_s"] == "unknown" == res["fraction_of_peak"]


def test_paper_grid_device_peaks_and_bad_scale():
    from bench.paper_grid import Fail, device_peak, parse
    assert device_peak("NVIDIA H100 80GB HBM3")[0] == 494.7e12
    assert device_peak("NVIDIA H100 PCIe")[0] == 378e12
    assert device_peak("TPU v5 lite")[0] == 197e12
    assert device_peak("cpu") == (None, "unknown")
    for bad in (["--model=cnn", "--scale=0"], ["--model=cnn", "--scale=1.5"],
                ["--model=cnn", "--rounds=0"]):
        with pytest.raises(Fail):
            parse(bad)


def test_table1_shaped_datasets():
    """Shakespeare- and Sent140-like data: Table 1's median, min and max, the loaders' shapes."""
    from bench.common import (SENT140_TABLE1, SHAKESPEARE_TABLE1, sent140_like_dataset,
                              shakespeare_like_dataset, table1_sizes)
    from deltafl_jax.datasets import sent140, shakespeare
    for t in (SHAKESPEARE_TABLE1, SENT140_TABLE1):
        s = table1_sizes(t["train"], t["median"], t["lo"], t["hi"], seed=0)
        assert s.min() == t["lo"] and s.max() == t["hi"] and len(s) == t["train"]
        assert abs(np.median(s) - t["median"]) <= 0.1 * t["median"]
    sh = shakespeare_like_dataset(6, 4)
    assert sh.train.x.shape[1:] == (shakespeare.WINDOW,) and sh.train.x.dtype == np.uint8
    assert sh.train.num_clients == 6 and sh.test.num_clients == 4
    assert sh.train.x.max() < shakespeare.NUM_CLASSES == sh.num_classes
    se = sent140_like_dataset(5, 3, vocabulary=100)
    assert se.train.x.dtype == np.int32 and se.metadata["embeddings"].shape == (
        100, sent140.EMBED_DIM)
    x = se.train.x   # PAD only after the tweet's last token, at least one token
    assert np.all(x[:, 0] != sent140.PAD_ID)
    pad = x == sent140.PAD_ID
    assert np.all(pad[:, :-1] <= pad[:, 1:])


def peer_cache_with(name, tmp_path):
    """A peers' cache folder under tmp_path holding a link to the user's `name` venv, made
    earlier by `python -m bench.peers` (tests/conftest.py gives the user's peers cache in
    $DELTAFL_TESTS_USER_PEERS). Used only when that venv holds the pins of bench/peers.py, so
    that bench.peers runs it as it is and never rebuilds it; the test is skipped otherwise."""
    tag = f"{name}-py{sys.version_info.major}{sys.version_info.minor}"
    venv = os.path.join(os.environ.get("DELTAFL_TESTS_USER_PEERS", ""), tag)
    marker = os.path.join(venv, "deltafl_peer.json")
    if not os.path.exists(marker):
        pytest.skip(f"the {name} peer's venv is not at {venv}; `python -m bench.peers "
                    f"--peers={name}` creates it (pip, from the package index)")
    code = "import json; from bench.peers import peer_pins; print(json.dumps(peer_pins(%r)))"
    pins = json.loads(subprocess.run([sys.executable, "-c", code % name], cwd=REPO,
                                     capture_output=True, text=True, check=True).stdout)
    with open(marker) as f:
        if json.load(f).get("pins") != pins:
            pytest.skip(f"the {name} peer's venv at {venv} holds other pins than "
                        f"bench/peers.py's; `python -m bench.peers --peers={name}` rebuilds it")
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    os.symlink(venv, cache / tag)
    return cache


def peer_row(peer, tmp_path):
    """bench.peers' linear row for `peer` and the engine: 3 of 8 clients, one timed round."""
    cache = peer_cache_with(peer, tmp_path)
    res = run_json(["bench.peers", f"--peers={peer}", "--models=linear", "--clients=3",
                    "--num_clients=8", "--rounds=1", "--engine_devices=1", "--gemm_n=256",
                    f"--cache_dir={cache}"], tmp_path, "peers")
    return res["models"]["linear"]


@pytest.mark.slow
def test_peers_smoke_drjax_agrees_with_engine(tmp_path):
    """The DrJAX peer's first round equals the engine's FedAvg (checked inside bench/peers.py)
    and its padded/real ratio is that of clients padded to the largest client's batches."""
    from bench.common import femnist_like_sizes
    from deltafl_jax.sampling.plan import sample_clients

    row = peer_row("drjax", tmp_path)
    assert set(row["s_per_round"]) == {"drjax_fedavg", "engine_fedavg", "engine_deltafl_0.5"}
    check = row["peer_checks"]["drjax"]
    assert check["agrees"] and check["max_abs_diff"] <= 1e-5
    assert check["max_abs_engine_update"] > 1e-3   # round 0 moved the model
    sizes = femnist_like_sizes(8, seed=0)          # bench.common's population, seed 0
    chosen = sizes[sample_clients(1, 1, 8, 3)]     # the timed round (t = 1, seed 1)
    steps = -(-sizes.max() // 10)                  # linear: batch 10
    ex = row["peer_examples"]["drjax"]
    assert ex["real_examples"] == chosen.sum()
    assert ex["padded_examples"] == 3 * steps * 10
    assert row["peer_versions"]["drjax"]["drjax"] == "0.2.1"


@pytest.mark.slow
def test_peers_smoke_fedjax(tmp_path):
    """bench/peer_fedjax.py through bench.peers: FedJAX's FedAvg on the same sampled clients,
    each client's last short batch filled to B with more of its examples (FedJAX's batching)."""
    from bench.common import femnist_like_sizes
    from deltafl_jax.sampling.plan import sample_clients

    row = peer_row("fedjax", tmp_path)
    assert set(row["s_per_round"]) == {"fedjax_fedavg", "engine_fedavg", "engine_deltafl_0.5"}
    assert row["s_per_round"]["fedjax_fedavg"] > 0 and row["peer_checks"] == {}
    chosen = femnist_like_sizes(8, seed=0)[sample_clients(1, 1, 8, 3)]   # round t = 1
    ex = row["peer_examples"]["fedjax"]
    assert ex["real_examples"] == chosen.sum()
    assert ex["padded_examples"] == np.sum(-(-chosen // 10) * 10)
    assert row["peer_versions"]["fedjax"]["fedjax"] == "0.0.17"


def test_peer_pins_with_an_accelerator_extra():
    """--peer_jax_extra puts the extra on the peers' jax pin only (same release). In a
    subprocess: bench.peers defines absl flags that other bench modules define too."""
    code = ("import json; from bench.peers import PEERS, peer_pins; print(json.dumps("
            "{n: [p['pins'], peer_pins(n), peer_pins(n, 'cuda12')] for n, p in PEERS.items()}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    for name, (pins, plain, with_extra) in json.loads(out).items():
        assert plain == pins
        changed = [(a, b) for a, b in zip(pins, with_extra) if a != b]
        assert len(with_extra) == len(pins) and len(changed) == 1, name
        old, new = changed[0]
        assert old.startswith("jax==") and new == "jax[cuda12]==" + old[len("jax=="):]


@pytest.mark.slow
def test_population_smoke_reports_every_row(tmp_path):
    """bench.population at toy size: its rows, the host rows' ratios as the rows give them,
    and device bytes that do not grow with the population once the m largest clients are at
    the size cap."""
    res = run_json(["bench.population", "--sizes=2000,200000", "--rounds=2", "--evals=1",
                    "--clients=10", "--eval_clients=50", "--femnist_models=linear:5"],
                   tmp_path, "population")
    rows = res["rows"]
    assert [(r["clients"], r["client_data"]) for r in rows] == [
        (2000, "device"), (2000, "host"), (200000, "host")]
    small, large = rows[1], rows[2]
    assert res["ratios"]["s_per_round_largest_over_smallest"] == pytest.approx(
        large["s_per_round"] / small["s_per_round"])
    assert large["eval_clients"] == 50 and large["device_data_bytes"] == small["device_data_bytes"]
    assert [r["client_data"] for r in res["femnist_rows"]] == ["device", "host"]


@pytest.mark.slow
def test_availability_smoke_pairs_and_parts(tmp_path):
    """bench.availability at toy size: the fixed sampler and bernoulli rows of one model and the
    markov rows of two populations, ratios as the rows give them, each round's host parts
    adding up to less than the round, and every client online under the fixed sampler."""
    res = run_json(["bench.availability", "--models=linear:5", "--rounds=2",
                    "--sizes=1000,20000", "--clients=10"], tmp_path, "availability")
    (pair,) = res["bernoulli"]
    fixed, bern = pair["rows"]
    assert (fixed["availability"], bern["availability"]) == ("always", "bernoulli")
    assert fixed["online_clients_per_round"] == fixed["clients"] == bern["clients"]
    assert 5 <= bern["online_clients_per_round"] < bern["clients"]
    assert res["ratios"]["bernoulli_over_fixed (linear, m = 5)"] == pytest.approx(
        bern["s_per_round"] / fixed["s_per_round"])
    small, large = res["markov"]["rows"]
    assert (small["clients"], large["clients"]) == (1000, 20000)
    assert (small["train_clients"], large["train_clients"]) == (500, 10000)
    assert 10 <= small["online_clients_per_round"] < 500 < large["online_clients_per_round"]
    assert res["ratios"]["markov_N20000_over_N1000"] == pytest.approx(
        large["s_per_round"] / small["s_per_round"])
    assert res["ratios"]["markov_peak_rss_gb"] == pytest.approx(
        res["markov"]["peak_rss_mb"] / 1024)
    for row in pair["rows"] + res["markov"]["rows"]:
        assert len(row["round_s"]) == 2 and row["trained_examples_per_round"] > 0
        assert 0 < row["host_s"] and row["wait_s"] >= 0
        assert row["host_s"] <= max(row["round_s"])


def test_benchmarks_write_a_git_ignored_default_and_print_one_screen(tmp_path, monkeypatch,
                                                                      capsys):
    """A benchmark run without --out leaves the clone clean (bench/out/ is
    git-ignored; bench/results/ keeps the committed figures) and prints a summary, not the
    JSON."""
    from bench import common, paths
    path = paths.default_out("paper_grid_cnn_cpu")
    assert os.path.dirname(path) == os.path.join(REPO, "bench", "out")
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index",
                              os.path.relpath(path, REPO)], cwd=REPO)
    assert ignored.returncode == 0, "bench/out/ must be git-ignored"
    tracked = subprocess.run(["git", "check-ignore", "-q", "--no-index",
                              "bench/results/paper_grid_cnn_cpu.json"], cwd=REPO)
    assert tracked.returncode == 1
    # Every bench script defaults to it: none names bench/results/ as its default.
    for name in sorted(os.listdir(os.path.join(REPO, "bench"))):
        if name.endswith(".py"):
            text = open(os.path.join(REPO, "bench", name)).read()
            assert '"results"' not in text and 'DEFINE_string("out", "bench/results' not in text, name

    monkeypatch.setattr(paths, "OUT_DIR", str(tmp_path / "out"))
    result = {"benchmark": "toy", "machine": {"backend": "cpu"}, "s_per_round": 0.123456,
              "rows": [{"clients": n, "s_per_round": n / 1e4, "detail": {"x": 1}}
                       for n in range(40)], "nested": {"a": {"b": 2.0}}, "list": [1, 2, 3]}
    written = common.emit(result)
    assert written == str(tmp_path / "out" / "toy.json")
    assert json.loads(open(written).read()) == result
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == common.SUMMARY_LINES + 1 and lines[-1] == f"wrote {written}"
    assert lines[:2] == ["benchmark: toy", "s_per_round: 0.1235"]
    assert lines[2] == "rows[0]: clients=0, s_per_round=0"
    assert lines[-2].startswith("... ") and "more lines in the JSON" in lines[-2]


@pytest.mark.slow
def test_personal_cost_smoke(tmp_path):
    """bench.personal_cost at toy size: a row per method, its ratio to FedAvg as its own
    s/round gives it; Ditto trains the examples FedAvg trains (its second model steps on the
    same minibatches)."""
    res = run_json(["bench.personal_cost", "--models=linear", "--rounds=1", "--clients=3",
                    "--num_clients=8"], tmp_path, "personal_cost")
    rows = {r["algorithm"]: r for r in res["rows"]}
    assert set(rows) == {"fedavg", "ditto", "deltafl+ditto", "feddyn", "scaffold"}
    base = rows["fedavg"]["s_per_round"]
    for r in rows.values():
        assert r["model"] == "linear" and r["m"] == 3 and len(r["round_s"]) == 1
        assert r["ratio_to_fedavg"] == pytest.approx(r["s_per_round"] / base)
    assert rows["ditto"]["trained_examples_per_round"] == rows["fedavg"][
        "trained_examples_per_round"] > 0


@pytest.mark.slow
def test_scaling_smoke_deals_every_job(tmp_path):
    """bench.scaling at toy size on 1 and 2 fake CPU devices: the devices' jobs add up to the
    kept jobs of the round, and the critical path is the evaluation's and the busiest
    device's trips."""
    res = run_json(["bench.scaling", "--devices=1,2", "--clients=3", "--num_clients=8",
                    "--rounds=1"], tmp_path, "scaling")
    assert [r["devices"] for r in res["rows"]] == [1, 2] and res["replicas"] == 4
    for r in res["rows"]:
        assert len(r["device_jobs"]) == r["devices"] and r["s_per_round"] > 0
        assert sum(r["device_jobs"]) == pytest.approx(r["kept_jobs"])
        assert r["critical_path_trips"] == pytest.approx(r["eval_trips"] + r["train_trips"])
        assert r["imbalance"] >= 1.0


@pytest.mark.slow
def test_code_paths_smoke(tmp_path):
    """bench.code_paths: the files a traced round and a whole tiny run call, among the
    package's files (the round's are a part of the run's)."""
    out = tmp_path / "code_paths.json"
    proc = subprocess.run([sys.executable, "-m", "bench.code_paths", f"--out={out}"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert 0 < res["round_path_files"] == len(res["round_path"])
    assert res["round_path_files"] < res["config_path_files"] == len(res["config_path"])
    assert res["config_path_files"] <= res["package_files"]
    assert "deltafl_jax/rounds.py" in res["round_path"]
    assert "experiments/run.py" in res["config_path"]


def test_code_paths_counts_functions_called_not_imports():
    """bench.code_paths counts a file when a function of it is called: a module's or a class
    body's code run by its import is not, nor the package's first-use import hooks
    (lazy_exports' ``__getattr__``, the package's ``__setattr__``); a function of the same
    files is. (Counted, imports made the configuration's walk 58 files at 5c38704 where 53
    functions were called.)"""
    from types import SimpleNamespace
    from bench import code_paths
    root = os.path.abspath(REPO)
    ours = os.path.join(root, "deltafl_jax", "run", "distributed.py")
    hooks = os.path.join(root, "deltafl_jax", "lazy_exports.py")
    package = os.path.join(root, "deltafl_jax", "__init__.py")

    def frames(source, path):
        """The frames' stand-ins of the code of `source` compiled as file `path`: the
        module's code, then each function or class body it defines."""
        module = compile(source, path, "exec")
        return [SimpleNamespace(f_code=c) for c in
                [module] + [c for c in module.co_consts if hasattr(c, "co_code")]]

    seen = code_paths._Files()
    for frame in (frames("import os\nclass Stop:\n    x = 1\n", ours)
                  + frames("def __getattr__(name):\n    return name\n", hooks)
                  + frames("def __setattr__(self, name, value):\n    pass\n", package)):
        seen(frame, "call", None)
    assert seen.files == set()
    for frame in frames("def initialize(spec):\n    return spec\n", ours)[1:]:
        seen(frame, "call", None)
        seen(frame, "return", None)
    assert seen.files == {os.path.join("deltafl_jax", "run", "distributed.py")}


# Every bench/ entry point (a bench/*.py with a __main__) and the tests that run it end to end
# at toy size ("file::name"; a test of this file by its name). The peers' scripts run inside
# the pinned venvs bench/peers.py makes, through bench/peers.py.
@pytest.mark.slow
def test_image_convs_smoke_times_every_case_four_ways(tmp_path):
    """bench.image_convs at one step and one repeat: every case's four variants timed, and
    the ratios those times' ratios."""
    res = run_json(["bench.image_convs", "--steps=1", "--repeats=1"], tmp_path, "image_convs")
    assert res["benchmark"] == "image_convs" and res["rows"]
    for r in res["rows"]:
        ms = r["ms_per_step"]
        assert set(ms) == {"xla", "fast", "via_same", "same"} and min(ms.values()) > 0
        assert r["xla_over_same"] == pytest.approx(ms["xla"] / ms["same"])
        assert r["xla_over_fast"] == pytest.approx(ms["xla"] / ms["fast"])
        assert r["via_same_over_fast"] == pytest.approx(ms["via_same"] / ms["fast"])


@pytest.mark.slow
def test_recurrent_smoke_times_each_way_and_checks_the_kernels(tmp_path):
    """bench.recurrent at toy size with the interpreted kernels: every case's variants timed,
    the ratios those times' ratios, and each variant's gradient scan's within 1e-5."""
    res = run_json(["bench.recurrent", "--steps=1", "--repeats=1", "--lanes=2", "--batch=2",
                    "--interpret"], tmp_path, "recurrent")
    assert res["variants"] == ["scan", "hoisted", "pallas_interpret"]
    assert [r["case"] for r in res["rows"]] == ["gru", "lstm"]
    for r in res["rows"]:
        ms = r["ms_per_step"]
        assert set(ms) == set(res["variants"]) and min(ms.values()) > 0
        assert r["over_scan"]["hoisted"] == pytest.approx(ms["hoisted"] / ms["scan"])
        assert max(r["max_grad_diff"].values()) < 1e-5


@pytest.mark.slow
def test_own_model_conv_smoke_times_both_networks(tmp_path):
    """bench.own_model_conv at toy size: the guide's network and the built-in one, each with
    pfl-research's parameter count, timed round by round, and the ratio of their medians."""
    res = run_json(["bench.own_model_conv", "--rounds=1", "--clients=2", "--examples=10"],
                   tmp_path, "own_model_conv")
    rows = res["variants"]
    assert set(rows) == {"own_model", "builtin"}
    assert rows["own_model"]["model"] == "cifar_cnn" and rows["builtin"]["model"] == "pfl_cnn"
    assert all(len(r["round_times_s"]) == 1 and r["s_per_round"] > 0 for r in rows.values())
    assert res["own_model_over_builtin"] == pytest.approx(
        rows["own_model"]["s_per_round"] / rows["builtin"]["s_per_round"])
    assert res["own_model_over_builtin_paired_median"] == pytest.approx(
        rows["own_model"]["round_times_s"][0] / rows["builtin"]["round_times_s"][0])


# bench/peer_pfl.py at toy size: 12 x 12 x 3 images, 6 clients of 10, cohort 3 (one batch each).
PFL_TOY = ["--num_clients=6", "--client_size=10", "--cohort=3", "--side=12", "--rounds=1",
           "--gemm_n=256"]
PFL_PYTHON = os.environ.get("PFL_PYTHON") or os.path.join(REPO, ".venv-pfl", "bin", "python")
needs_pfl = pytest.mark.skipif(
    not os.path.exists(PFL_PYTHON),
    reason="no venv with pfl and torch (not dependencies of this package): create .venv-pfl as "
           "docs/benchmarks/pfl-research.md shows, or set PFL_PYTHON")


def toy_pfl_cnn_flops() -> float:
    """pfl_cnn's training FLOPs per example on 12 x 12 x 3 images, by hand: conv 3x3 3->32
    (10 x 10 outputs), conv 3x3 32->64 (8 x 8), dense 4*4*64 -> 128, dense 128 -> 10; each
    layer's multiply-adds twice forward, twice for the weight gradient, twice for the input
    gradient except the first layer's."""
    macs = [10 * 10 * 32 * 27, 8 * 8 * 64 * 288, 4 * 4 * 64 * 128, 128 * 10]
    return 2.0 * (3 * sum(macs) - macs[0])


@pytest.mark.slow
def test_peer_pfl_smoke_engine_side(tmp_path):
    """bench/peer_pfl.py without --pfl_python: the engine on 1 and 2 host devices, each round
    training the cohort's examples, the network's FLOPs as counted by hand."""
    wgrad = "devices=2+clients_per_step=2+conv_impl=im2col_wgrad"
    res = run_json(["bench.peer_pfl", f"--engines=devices=1,{wgrad}", *PFL_TOY], tmp_path,
                   "peer_pfl")
    assert set(res["sides"]) == {"engine_devices=1", f"engine_{wgrad}"}
    assert res["speedup_vs_pfl"] == res["speedup_vs_pfl_paired"] == {}
    for name, devices, lanes in (("engine_devices=1", 1, 2), (f"engine_{wgrad}", 2, 2)):
        row = res["sides"][name]
        info = row["info"]
        assert info["jax_devices"] == devices and info["placement"]["devices"] == devices
        assert info["placement"]["lanes"] == lanes
        assert row["train_examples_per_round"] == 30
        assert info["network_flops_per_example"] == toy_pfl_cnn_flops()
        if name == "engine_devices=1":   # pfl_cnn's CPU default, Winograd: fewer multiplies
            assert info["engine_flops_per_example"] < 0.6 * info["network_flops_per_example"]
        else:   # the SAME-then-crop convolutions compute the border too
            assert info["engine_flops_per_example"] > info["network_flops_per_example"]
        assert row["network_gflop_per_round"] == pytest.approx(30 * toy_pfl_cnn_flops() / 1e9)
        assert 0 < row["fraction_of_gemm_peak"] and row["s_per_round"] > 0
    assert res["engine_command_lines"]["engine_devices=1"].startswith(
        "--model=pfl_cnn --algorithm=fedavg --clients_per_round=3 --batch_size=10")
    assert len(res["load"]) == 2 * 2   # a warm-up and a timed round per side


@needs_pfl
@pytest.mark.slow
def test_peer_pfl_smoke_against_pfl(tmp_path):
    """pfl-research's FedAvg (bench/peer_pfl_worker.py in its own venv) beside the engine: the
    same network (parameter count), the same FLOPs per example by PyTorch's counter and by
    hand, and the same examples trained per round."""
    res = run_json(["bench.peer_pfl", f"--pfl_python={PFL_PYTHON}", "--engines=devices=1",
                    "--profile_repeats=1",
                    *PFL_TOY], tmp_path, "peer_pfl")
    pfl, eng = res["sides"]["pfl"], res["sides"]["engine_devices=1"]
    assert pfl["info"]["pfl"] == "0.6.0"
    assert pfl["info"]["parameters"] == eng["info"]["parameters"] == 151882
    assert pfl["info"]["train_flops_per_example"] == toy_pfl_cnn_flops()
    assert pfl["train_examples_per_round"] == eng["train_examples_per_round"] == 30
    assert set(res["speedup_vs_pfl"]) == {"pfl_over_engine_devices=1"}
    pfl_t, eng_t = pfl["round_times_s"], eng["round_times_s"]
    assert res["speedup_vs_pfl_paired"]["pfl_over_engine_devices=1"] == pytest.approx(
        float(np.median([a / b for a, b in zip(pfl_t, eng_t)])))
    assert res["gemm_gflops"]["torch_pfl"] > 0 and res["profile_ms"]["torch_sgd_step_pfl"] > 0


# bench/peer_pfl_llm.py at toy size: a random Llama of width 64, 2 layers, 4 heads (2 key/value
# heads), MLP 172, vocabulary 512; sequences of 32 tokens; 8 users of 4 (4 train), cohort 2.
LLM_TOY = ["--vocab=512", "--hidden=64", "--layers=2", "--heads=4", "--kv_heads=2",
           "--intermediate=172", "--seq_len=32", "--num_clients=8", "--sequences_per_client=4",
           "--cohort=2", "--rounds=1"]


def toy_llama_lora_flops(T=32, H=64, kv=32, inter=172, V=512, r=8) -> float:
    """One LoRA step's FLOPs per sequence of the toy Llama (2 layers, adapters on q and v), by
    hand, per token in multiply-adds: forward, each layer's projections (q, k, v, o, the MLP's
    three), its adapters (x A then B), attention (Q K^T and P V over T keys) and the head;
    backward, the head's and the last layer's input gradients, the adapters' two weight and two
    input products, attention's four products; in the first layer (its input is the frozen
    embedding) no input gradient of q, k, v or of their adapters, and attention's three
    products towards Q and V only."""
    proj = 2 * H * H + 2 * H * kv + 3 * H * inter
    lora = (H * r + r * H) + (H * r + r * kv)
    attn = 2 * T * H
    forward = 2 * (proj + lora + attn) + H * V
    last = proj + 2 * lora + 2 * attn
    first = 3 * H * inter + H * H + 3 * T * H + (H * r + 2 * r * H) + (H * r + 2 * r * kv)
    return 2.0 * T * (forward + H * V + last + first)


@pytest.mark.slow
def test_peer_pfl_llm_smoke_engine_side(tmp_path):
    """bench/peer_pfl_llm.py without --pfl_python: the engine reads the users' file as a user
    would, trains the cohort's sequences each round, and its step's FLOPs and parameter counts
    are the toy Llama's by hand."""
    res = run_json(["bench.peer_pfl_llm", "--engines=devices=1", *LLM_TOY], tmp_path,
                   "peer_pfl_llm")
    assert set(res["sides"]) == {"engine_devices=1"} and res["speedup_vs_pfl"] == {}
    row = res["sides"]["engine_devices=1"]
    info = row["info"]
    assert row["train_sequences_per_round"] == 2 * 4
    assert info["users_for_pfl"] == {"clients": 4, "client_size": 4, "seq_len": 32}
    assert info["trainable_parameters"] == 2 * (64 * 8 + 8 * 64 + 64 * 8 + 8 * 32)
    assert info["parameters"] == (2 * 512 * 64 + 64 + 2 * (
        2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 172 + 2 * 64) + info["trainable_parameters"])
    assert info["train_flops_per_example"] == toy_llama_lora_flops()
    assert row["gflop_per_round"] == pytest.approx(8 * toy_llama_lora_flops() / 1e9)
    line = res["engine_command_lines"]["engine_devices=1"]
    assert "--model=llama" in line and "--lora_rank=8" in line and line.endswith("--devices=1")
    assert len(res["load"]) == 2 and res["uptime_start"]


@needs_pfl
@pytest.mark.slow
def test_peer_pfl_llm_smoke_against_pfl(tmp_path):
    """pfl-research's LoRA fine-tuning (bench/peer_pfl_llm_worker.py: transformers + peft in its
    own venv) beside the engine on the same checkpoint: the same parameter counts, the same
    FLOPs per sequence by PyTorch's counter and by hand, the same sequences per round."""
    res = run_json(["bench.peer_pfl_llm", f"--pfl_python={PFL_PYTHON}", "--engines=devices=1",
                    *LLM_TOY], tmp_path, "peer_pfl_llm")
    pfl, eng = res["sides"]["pfl"], res["sides"]["engine_devices=1"]
    assert pfl["info"]["pfl"] == "0.6.0" and pfl["info"]["peft"]
    for key in ("parameters", "trainable_parameters"):
        assert pfl["info"][key] == eng["info"][key]
    assert pfl["info"]["train_flops_per_example"] == toy_llama_lora_flops()
    assert pfl["train_sequences_per_round"] == eng["train_sequences_per_round"] == 8
    assert res["speedup_vs_pfl"]["pfl_over_engine_devices=1"] == pytest.approx(
        pfl["s_per_round"] / eng["s_per_round"])


@pytest.mark.slow
def test_virtual_clock_smoke_times_both_rows_alike(tmp_path):
    """bench.virtual_clock at toy size: the run without the clock and the clock alone train the
    same examples every round (the clock only measures), only the clock's row has a virtual
    time, and the ratio is the rows' own."""
    res = run_json(["bench.virtual_clock", "--models=linear:5", "--rounds=2"], tmp_path,
                   "virtual_clock")
    (pair,) = res["pairs"]
    plain, clocked = pair["rows"]
    assert (plain["client_speed"], clocked["client_speed"]) == ("none", "lognormal")
    assert plain["trained_examples"] == clocked["trained_examples"]
    assert plain["virtual_time_end"] is None and clocked["virtual_time_end"] > 0
    assert res["ratios"]["clock_over_none (linear, m = 5)"] == pytest.approx(
        clocked["s_per_round"] / plain["s_per_round"])
    for row in pair["rows"]:
        assert len(row["round_s"]) == 2 and 0 < row["host_s"] <= max(row["round_s"])


@pytest.mark.slow
def test_fedbuff_step_smoke_times_both(tmp_path):
    """bench.fedbuff_step at toy size: one row per shape, the ratio its medians' own, as many
    timings of each as repeats."""
    res = run_json(["bench.fedbuff_step", "--shapes=linear", "--buffer_size=2",
                    "--num_clients=8", "--repeats=2"], tmp_path, "fedbuff_step")
    row = res["shapes"]["linear"]
    assert row["K"] == 2 and len(row["fedbuff_step_times_s"]) == len(row["fedavg_round_times_s"]) == 2
    assert row["ratio"] == pytest.approx(row["fedbuff_step_s"] / row["fedavg_round_s"])


@pytest.mark.slow
def test_timing_comparison_smoke_reads_every_setting(tmp_path):
    """bench.timing_comparison at toy size: a row per setting and method, the p90 at the fixed
    time read from the runs' own evaluations, drops only where the deadline drops, and
    FedBuff's updates counted as its clients' own counts; --reuse of the synchronous
    settings runs only the asynchronous one (FedBuff and buffered Delta-FL at two thetas, the
    last three rows) and reads the others' runs back."""
    runs = tmp_path / "runs"
    toy = ["bench.timing_comparison", "--rounds=4", "--seeds=1", "--eval_every=2",
           "--virtual_hours=0.004", f"--runs_dir={runs}"]
    sync = "no_deadline,deadline_overselect,partial_work"
    first = run_json(toy + [f"--settings={sync}"], tmp_path, "timing_comparison")
    res = run_json(toy + [f"--reuse={sync}"], tmp_path, "timing_comparison")
    assert set(first["wall_seconds"]) == set(sync.split(","))
    assert set(res["wall_seconds"]) == {"asynchronous"}
    for key in ("final_p90", "final_virtual_hours", "drop_rate_by_speed_quintile"):
        assert [r[key] for r in first["rows"]] == [r[key] for r in res["rows"][:-3]]
    got = {(r["setting"], r["method"]) for r in res["rows"]}
    assert got == {(s, m) for s in ("no_deadline", "deadline_overselect", "partial_work")
                   for m in ("FedAvg", "Δ-FL, θ = 0.8", "Δ-FL, θ = 0.5")} | {
        ("partial_work", "FedNova"), ("asynchronous", "FedBuff"),
        ("asynchronous", "Δ-FL (buffered), θ = 0.8"), ("asynchronous", "Δ-FL (buffered), θ = 0.5")}
    at = res["fixed_virtual_hours"] * 3600
    for r in res["rows"]:
        recs = [json.loads(line) for line in open(
            runs / r["setting"] / r["algorithm"] / "metrics.jsonl")]
        recs = [x for x in recs if x.get("theta", 1.0) == r["theta"] and x["virtual_time"] <= at]
        want = recs[-1]["test_error_p90"] if recs else None
        assert (r["p90_at_fixed_time"][0] == pytest.approx(want) if want is not None
                else np.isnan(r["p90_at_fixed_time"][0]))
        if r["setting"] == "asynchronous":
            assert r["drop_rate_by_speed_quintile"] is None     # no deadline, no rounds
            clients = np.load(runs / "asynchronous" / r["algorithm"] / "clients.npz")
            aggregated = clients["train_updates_aggregated"]   # [replicas, clients]
            assert r["updates_aggregated"] == [int(aggregated.sum()) // aggregated.shape[0]]
            assert r["stale_updates_dropped"] == [0]             # --max_staleness unset
            assert sum(r["update_share_by_speed_quintile"][0]) == pytest.approx(1.0)
            continue
        assert r["updates_aggregated"] is None
        assert len(r["drop_rate_by_speed_quintile"][0]) == 5
        if r["setting"] == "no_deadline":
            assert r["drop_rate_by_speed_quintile"] == [[0.0] * 5]



def test_timing_comparison_shakespeare_pair_runs_its_flagfiles(tmp_path):
    """--flagfiles=shakespeare: each setting's command is its flagfile's own lines (read here
    from the file), with the setting's changes; the default still runs the synthetic pair."""
    from bench import timing_comparison as tc

    def lines(path):
        return {ln.strip() for ln in open(path) if ln.strip().startswith("--")}

    def got(args, setting):
        cmd = tc.command(setting, args, str(tmp_path / setting))
        return {a.split("=")[0] for a in cmd[3:]}, set(cmd[3:])

    shk = tc._parse(["--flagfiles=shakespeare"])
    syn = tc._parse([])
    assert shk.runs_dir != syn.runs_dir
    cases = {"deadline_overselect": "experiments/async_shakespeare_cpu.flags",
             "asynchronous": "experiments/async_shakespeare_cpu_fedbuff.flags"}
    for setting, path in cases.items():
        names, flags = got(shk, setting)
        own = {ln for ln in lines(path) if ln.split("=")[0] not in (
            "--algorithm", "--seeds", "--eval_every", "--output_dir", "--num_rounds")}
        assert own <= flags and "--dataset=shakespeare" in flags
    names, flags = got(shk, "no_deadline")
    assert "--round_deadline" not in names and "--over_select" not in names
    assert "--partial_work" in got(shk, "partial_work")[1]
    assert "--dataset=synthetic" in got(syn, "asynchronous")[1]
    assert "--round_deadline=3" in got(syn, "deadline_overselect")[1]


def resnet18_forward_macs(side: int, classes: int = 10) -> int:
    """Multiply-adds of one image's forward pass of ResNet-18 with the CIFAR stem, by hand: a
    k x k convolution to an h x w x c_out map from c_in channels does h w c_out c_in k^2."""
    conv = lambda hw, cin, cout, k: hw * hw * cout * cin * k * k
    macs = conv(side, 3, 64, 3) + 4 * conv(side, 64, 64, 3)
    for s, (cin, cout) in enumerate(((64, 128), (128, 256), (256, 512)), start=1):
        hw = side >> s
        macs += conv(hw, cin, cout, 3) + conv(hw, cin, cout, 1) + 3 * conv(hw, cout, cout, 3)
    return macs + 512 * classes


@pytest.mark.slow
def test_resnet_profile_smoke_counts_and_splits(tmp_path):
    """bench.resnet_profile at toy size (one client of 4 images, one replica; the step on
    2 images of 8 x 8): the network's FLOPs are ResNet-18's counted by hand (train: 3 x forward
    less the stem's input gradient), the round's FLOPs its examples' and its share of the GEMM
    peak its rate's, and the step's parts add up to their groups."""
    res = run_json(["bench.resnet_profile", "--rounds=1", "--flag=--clients_per_round=1",
                    "--flag=--max_examples_per_client=4", "--flag=--thetas=1.0", "--side=8",
                    "--batch=2", "--steps=1", "--repeats=1", "--gemm_n=128"], tmp_path,
                   "resnet_profile")
    rnd, step = res["round"], res["step"]
    f = rnd["flops_per_example"]
    assert f["parameters"] == 11_173_962
    assert f["forward"] == 2 * resnet18_forward_macs(32)
    assert f["stem_forward"] == 2 * 32 * 32 * 64 * 3 * 9
    assert f["train"] == 3 * f["forward"] - f["stem_forward"]
    (r,) = rnd["rounds"]
    assert r["gflop"] * 1e9 == pytest.approx(f["train"] * r["train_real_examples"]
                                             + f["forward"] * r["eval_real_examples"])
    assert rnd["share_of_gemm_peak"] == pytest.approx(
        rnd["gflop_per_s"] / res["gemm_peak_gflops"])
    rows = step["parts"]
    forward = sum(p["gflop_per_call"] * p["count"] for p in rows
                  if p["variant"] == "forward" and p["gflop_per_call"])
    assert forward * 1e9 == pytest.approx(2 * 2 * (resnet18_forward_macs(8) - 512 * 10))
    assert sum(g["ms_in_step"] for g in step["groups"].values()) == pytest.approx(
        step["parts_sum_ms"])
    assert {"stem conv", "groupnorm", "relu / add", "head", "sgd update", "downsample 3x3/2",
            "shortcut 1x1/2", "3x3 convs forward", "3x3 convs weight grad",
            "3x3 convs input grad"} == set(step["groups"])



def test_command_start_smoke_runs_each_case_in_both_trees(tmp_path):
    """This tree against itself: each case answers alike in both, with its exit code and the
    CPU of every run."""
    res = run_json(["bench.command_start", f"--before={REPO}", "--repeats=2",
                    "--cases=run_bad_flag,prepare_no_source"], tmp_path, "command_start")
    assert res["trees"]["before"] == res["trees"]["after"] == os.path.abspath(REPO)
    assert list(res["cases"]) == ["run_bad_flag", "prepare_no_source"]
    for row in res["cases"].values():
        assert row["exit_code"] == {"before": 2, "after": 2} and row["same_output"]
        for tree in ("before", "after"):
            assert len(row[tree]["cpu_s_all"]) == 2 and row[tree]["cpu_s"] > 0

SMOKE_RUNS = {
    "command_start.py": ["test_command_start_smoke_runs_each_case_in_both_trees"],
    "suite_cpu.py": ["test_suite_cpu_smoke_charges_each_test_its_cpu_and_compiles",
                     "test_suite_cpu_merge_counts_the_workers_once"],
    "fedbuff_step.py": ["test_fedbuff_step_smoke_times_both"],
    "availability.py": ["test_availability_smoke_pairs_and_parts"],
    "timing_comparison.py": ["test_timing_comparison_smoke_reads_every_setting"],
    "virtual_clock.py": ["test_virtual_clock_smoke_times_both_rows_alike"],
    "before_after.py": ["test_bench_before_after.py::test_before_after_smoke"],
    "code_paths.py": ["test_code_paths_smoke"],
    "image_convs.py": ["test_image_convs_smoke_times_every_case_four_ways"],
    "recurrent.py": ["test_recurrent_smoke_times_each_way_and_checks_the_kernels"],
    "own_model_conv.py": ["test_own_model_conv_smoke_times_both_networks"],
    "compare.py": ["test_compare_smoke_engine_and_jax_loop", "test_compare_smoke",
                   "test_compare_recurrent_engine_and_jax_loop",
                   "test_compare_recurrent_against_torch"],
    "loop_shape.py": ["test_loop_shape_smoke_trains_identical_models"],
    "paper_grid.py": ["test_paper_grid_toy_json_adds_up"],
    "peer_drjax.py": ["test_peers_smoke_drjax_agrees_with_engine"],
    "peer_fedjax.py": ["test_peers_smoke_fedjax"],
    "peer_pfl.py": ["test_peer_pfl_smoke_engine_side"],
    "peer_pfl_worker.py": ["test_peer_pfl_smoke_against_pfl"],
    "peer_pfl_llm.py": ["test_peer_pfl_llm_smoke_engine_side"],
    "peer_pfl_llm_worker.py": ["test_peer_pfl_llm_smoke_against_pfl"],
    "peers.py": ["test_peers_smoke_engine_side"],
    "personal_cost.py": ["test_personal_cost_smoke"],
    "population.py": ["test_population_smoke_reports_every_row"],
    "round_speed.py": ["test_round_speed_smoke"],
    "scaling.py": ["test_scaling_smoke_deals_every_job"],
    "theta_sweep.py": ["test_theta_sweep_smoke"],
    "emnist_shaped.py": ["test_emnist_shaped_smoke_writes_a_loadable_npz"],
    "resnet_profile.py": ["test_resnet_profile_smoke_counts_and_splits"],
}


SUITE_CPU_TESTS = """
import subprocess, sys, time

def test_busy_child():
    subprocess.run([sys.executable, "-c",
                    "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass"],
                   check=True)

def test_two_programs():
    import jax, numpy as np
    jax.jit(lambda x: x + 1)(np.float32(1))
    jax.jit(lambda x: x * 3)(np.float32(1))
"""


def program_compiles(res):
    """{jitted function: compiles} of a bench/suite_cpu.py result."""
    return {k: v["compiles"] for k, v in res["summary"]["programs_by_compile_s"].items()}


@pytest.mark.slow   # a pytest run in a subprocess: CI's second step
def test_suite_cpu_smoke_charges_each_test_its_cpu_and_compiles(tmp_path):
    """bench/suite_cpu.py on a run of two tests: a 0.3 s busy subprocess is charged to its
    test as its children's CPU, two jitted programs to the other as two fresh compiles, and
    the compare command puts two runs side by side."""
    (tmp_path / "test_two.py").write_text(SUITE_CPU_TESTS)
    out = tmp_path / "cpu.json"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR="", PYTHONPATH=REPO)
    env.pop("JAX_COMPILATION_CACHE_DIR")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-n", "0",
                           "-p", "no:cacheprovider", "-p", "bench.suite_cpu",
                           f"--suite_cpu_out={out}", f"--rootdir={tmp_path}",
                           str(tmp_path / "test_two.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.load(open(out))
    child = res["tests"]["test_two.py::test_busy_child"]
    jitted = res["tests"]["test_two.py::test_two_programs"]
    assert child["children_s"] >= 0.3 and child["cpu_s"] >= child["children_s"]
    assert child["compiles"] == 0 and jitted["compiles"] == 2 and jitted["cache_hits"] == 0
    assert program_compiles(res) == {"jit(<lambda>)": 2}
    s = res["summary"]
    assert s["tests"] == 2 and s["compiles"] == s["fresh_compiles"] == 2
    assert s["total_cpu_s"] >= s["tests_cpu_s"] - 0.1
    assert res["files"]["test_two.py"]["tests"] == 2
    side = tmp_path / "side.json"
    proc = subprocess.run([sys.executable, "-m", "bench.suite_cpu", "compare", str(out), str(out),
                           f"--out={side}"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    both = json.load(open(side))
    assert both["before"] == both["after"] == s
    assert both["files"]["test_two.py"]["after"]["tests"] == 2


def test_suite_cpu_merge_counts_the_workers_once(tmp_path):
    """The merge adds each worker's own and children's CPU and the controller's own only (its
    children are the workers), sums per file, and sorts the costliest first."""
    from bench import suite_cpu
    out = str(tmp_path / "m.json")
    t = lambda cpu, ch, c, h: {"cpu_s": cpu, "own_s": cpu - ch, "children_s": ch,  # noqa: E731
                               "compiles": c, "compile_s": 0.5 * c, "cache_hits": h}
    parts = {"controller": {"own_cpu_s": 2.0, "children_cpu_s": 30.0, "tests": {}},
             "gw0": {"own_cpu_s": 10.0, "children_cpu_s": 4.0,
                     "tests": {"a.py::x": t(3.0, 1.0, 4, 1), "b.py::y": t(6.0, 3.0, 0, 0)}},
             "gw1": {"own_cpu_s": 15.0, "children_cpu_s": 1.0,
                     "tests": {"a.py::z": t(12.0, 1.0, 6, 2)},
                     "programs": {"jit(f)": [4, 2.0], "jit(g)": [6, 3.0]}}}
    parts["gw0"]["programs"] = {"jit(f)": [1, 2.0]}
    for name, part in parts.items():
        json.dump(part, open(f"{out}.{name}.json", "w"))
    res = suite_cpu.merge(out)
    assert res == json.load(open(out))
    s = res["summary"]
    assert s["total_cpu_s"] == 2.0 + 14.0 + 16.0 and s["quiet_wall_estimate_s"] == 16.0
    assert s["per_process_cpu_s"] == {"controller": 2.0, "gw0": 14.0, "gw1": 16.0}
    assert (s["tests"], s["tests_cpu_s"], s["compiles"], s["cache_hits"],
            s["fresh_compiles"], s["children_cpu_s"]) == (3, 21.0, 10, 3, 7, 5.0)
    assert list(res["files"]) == ["a.py", "b.py"]
    assert res["files"]["a.py"] == {"cpu_s": 15.0, "children_s": 2.0, "compiles": 10,
                                    "compile_s": 5.0, "tests": 2}
    assert list(res["tests"]) == ["a.py::z", "b.py::y", "a.py::x"]
    assert s["programs_by_compile_s"] == {"jit(f)": {"compiles": 5, "compile_s": 4.0},
                                          "jit(g)": {"compiles": 6, "compile_s": 3.0}}
    assert list(s["programs_by_compile_s"]) == ["jit(f)", "jit(g)"]


def test_every_bench_entry_point_has_a_smoke_run():
    bench = os.path.join(REPO, "bench")
    main = re.compile(r"""^if\s+__name__\s*==\s*["']__main__["']""", re.M)
    entry_points = sorted(name for name in os.listdir(bench) if name.endswith(".py")
                          and main.search(open(os.path.join(bench, name)).read()))
    assert entry_points == sorted(SMOKE_RUNS), (
        "a bench/ script with a __main__ needs a smoke run at toy size in SMOKE_RUNS")
    here = os.path.dirname(os.path.abspath(__file__))
    for script, tests in SMOKE_RUNS.items():
        for test in tests:
            path, _, name = test.rpartition("::")
            text = open(os.path.join(here, path or os.path.basename(__file__))).read()
            assert f"\ndef {name}(" in text, (script, test)
