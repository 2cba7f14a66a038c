"""--estimate (deltafl_jax.run.estimate): the printed block adds up to its own parts, the
evaluation count is the loop's, the memory figure says where it comes from, and nothing is
written to the output directory. No timing is asserted (the figures are wall-clock)."""

import os
import re
import types

import numpy as np
import pytest

from conftest import run_runner, tiny_config

HERE = os.path.dirname(__file__)
TINY = os.path.join(HERE, "tiny.flags")


def parse_blocks(text):
    """The figures of each printed block: {name, build, compile, rounds, round_s, evals,
    eval_s, projected, memory}."""
    blocks = []
    for line in text.splitlines():
        if line.startswith("estimate of ") and not line.startswith("estimate of all"):
            blocks.append({"name": line.split(":")[0][len("estimate of "):]})
            continue
        m = re.match(r"\s+(build|compile|projected run)\s+([0-9.]+) s", line)
        if m:
            blocks[-1][m.group(1).split()[0]] = float(m.group(2))
        m = re.match(r"\s+(rounds|evaluations)\s+(\d+) x ([0-9.]+) s = ([0-9.]+) s", line)
        if m:
            key = "round" if m.group(1) == "rounds" else "eval"
            blocks[-1][m.group(1)] = int(m.group(2))
            blocks[-1][f"{key}_s"] = float(m.group(3))
        m = re.match(r"\s+device memory\s+([0-9.]+) MB \((.*)\)", line)
        if m:
            blocks[-1]["memory"] = (float(m.group(1)), m.group(2))
    return blocks


def loop_evaluations(T, every):
    """The rounds after which run_rounds evaluates, counted by walking them."""
    return sum(1 for r in range(1, T + 1) if r % every == 0 or r == T)


def assert_adds_up(b, T, every):
    assert b["rounds"] == T
    assert b["evaluations"] == loop_evaluations(T, every)
    for part in ("build", "compile", "round_s", "eval_s"):
        assert b[part] >= 0
    # The printed parts are rounded (3 decimals, per-round and per-evaluation 6).
    parts = b["build"] + b["compile"] + T * b["round_s"] + b["evaluations"] * b["eval_s"]
    assert b["projected"] == pytest.approx(parts, abs=5e-3)


def tree_bytes(path):
    """Every file under path: relative name -> (bytes, mtime)."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, path)] = (open(p, "rb").read(), os.stat(p).st_mtime_ns)
    return out


def test_estimate_prints_one_block_that_adds_up_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    code, err, stdout = run_runner([f"--flagfile={TINY}", f"--output_dir={out}", "--estimate",
                                    "--estimate_rounds=2"], capsys)
    assert code == 0, err
    assert not out.exists()
    assert "estimate: compiling" in err   # progress while it measures
    blocks = parse_blocks(stdout)
    assert len(blocks) == 1 and blocks[0]["name"] == "deltafl"
    assert_adds_up(blocks[0], T=6, every=3)
    mb, source = blocks[0]["memory"]
    assert mb > 0 and ("peak_bytes_in_use" in source or "compiled round" in source)
    assert not out.exists()


def test_estimate_leaves_an_existing_output_dir_byte_identical(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "models").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"round": 3}\n')
    (out / "summary.json").write_text('{"final": {}}')
    (out / "models" / "m.npz").write_bytes(b"\x00\x01")
    before = tree_bytes(out)
    code, err, stdout = run_runner([f"--flagfile={TINY}", f"--output_dir={out}", "--estimate",
                                    "--estimate_rounds=1"], capsys)
    assert code == 0, err
    assert len(parse_blocks(stdout)) == 1
    assert tree_bytes(out) == before


def test_estimate_rounds_below_one_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "run"
    code, err, _ = run_runner([f"--flagfile={TINY}", f"--output_dir={out}", "--estimate",
                               "--estimate_rounds=0"], capsys)
    assert code == 2 and "--estimate_rounds" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.fixture(scope="module")
def measured(tiny_synthetic):
    from deltafl_jax.run import build_experiment
    from deltafl_jax.run.estimate import measure
    exp = build_experiment(tiny_config(num_rounds=7, eval_every=3), tiny_synthetic)
    return exp, measure(exp, build_s=0.25, timed_rounds=3, min_seconds=0.0)


def test_measure_parts_and_projection(measured):
    exp, est = measured
    assert est.build_s >= 0.25 and est.num_rounds == 7 and est.eval_every == 3
    assert est.evaluations == loop_evaluations(7, 3) == 3
    assert est.timed_rounds == 3 and len(est.train_trips) == 3
    assert all(t > 0 for t in est.train_trips)
    assert est.work["train_trips"] == pytest.approx(np.mean(est.train_trips))
    assert est.work["train_padded_examples"] >= est.work["train_real_examples"] > 0
    assert est.projected_s == pytest.approx(est.build_s + est.compile_s + 7 * est.round_s
                                            + 3 * est.eval_s, rel=1e-12)
    j = est.to_json()
    assert j["projected_s"] == pytest.approx(j["build_s"] + j["compile_s"] + j["rounds_s"]
                                             + j["evaluations_s"], rel=1e-12)
    assert j["rounds_s"] == pytest.approx(j["num_rounds"] * j["round_s"], rel=1e-12)
    assert est.replicas == exp.replicas.size == 2 and est.lanes == exp.lanes
    if est.backend == "cpu":   # XLA:CPU reports no memory stats: the compiled round's
        assert est.memory.nbytes == est.memory.compiled_round.total
        assert "compiled round" in est.memory.source
    # The printed block says the same figures.
    b = parse_blocks("\n".join(est.lines()))[0]
    assert b["round_s"] == pytest.approx(est.round_s, abs=1e-6)
    assert_adds_up(b, T=7, every=3)


def test_measure_runs_the_rounds_the_run_would(measured, tiny_synthetic):
    """The timed rounds' critical-path trips are those of the same rounds run by the loop's
    jitted round (the plans of round_indices)."""
    import jax
    from deltafl_jax.run.estimate import round_indices
    exp, est = measured
    idx = round_indices(exp.config.num_rounds, 1 + est.timed_rounds)   # a warm-up, then these
    state, keys = exp.initial_state(), exp.keys()
    trips, real = [], []
    for t in idx:
        state, metrics = exp.round_fn(state, exp.round_data(t), keys)
        trips.append(int(jax.device_get(metrics["train_trips"])))
        real.append(float(jax.device_get(metrics["eval_real_examples"])))
    assert trips[1:] == est.train_trips
    assert np.mean(real[1:]) == pytest.approx(est.work["eval_real_examples"])


def test_round_indices_cover_the_run():
    from deltafl_jax.run.estimate import round_indices
    idx = round_indices(100, 10)
    assert all(0 <= i < 100 for i in idx) and len(set(idx)) == 10
    # any prefix is spread: the first 5 fall in at least 4 of the 5 fifths of the run
    assert len({i // 20 for i in idx[:5]}) >= 4
    assert round_indices(3, 7) == [int(((i * 0.6180339887498949) % 1.0) * 3) for i in range(7)]


def test_device_memory_takes_the_largest_reported_peak():
    from deltafl_jax.run.estimate import device_memory

    class Dev:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            if isinstance(self.stats, Exception):
                raise self.stats
            return self.stats

    fp = types.SimpleNamespace(total=123)
    devs = np.array([Dev({"peak_bytes_in_use": 10, "bytes_limit": 99}),
                     Dev({"peak_bytes_in_use": 40}), Dev(None)], dtype=object)
    exp = types.SimpleNamespace(program=types.SimpleNamespace(
        mesh=types.SimpleNamespace(devices=devs), footprint=fp), backend="gpu")
    assert device_memory(exp) == (40, "peak_bytes_in_use")
    exp.program.mesh.devices = np.array([Dev(None), Dev(RuntimeError("no stats"))], dtype=object)
    nbytes, source = device_memory(exp)
    assert nbytes == 123 and "start-up footprint" in source


def test_total_of_several_programs_is_their_sum():
    from deltafl_jax.run.estimate import DeviceMemory, Estimate, total_lines
    common = dict(num_rounds=10, eval_every=5, flops_per_round=None, train_trips=[1],
                  work={},
                  backend="gpu", devices=1, replicas=4, lanes=2)
    a = Estimate(name="a", build_s=1.0, compile_s=2.0, round_s=0.5, eval_s=0.25,
                 memory=DeviceMemory(2 ** 20, "peak_bytes_in_use"), **common)
    b = Estimate(name="b", build_s=0.5, compile_s=3.0, round_s=0.125, eval_s=1.0,
                 memory=DeviceMemory(3 * 2 ** 20, "peak_bytes_in_use"), **common)
    assert a.projected_s == 1.0 + 2.0 + 10 * 0.5 + 2 * 0.25
    line = total_lines([a, b])[0]
    assert f"projected run {a.projected_s + b.projected_s:.3f} s" in line
    assert "compile 5.000 s" in line and "at most 3.0 MB" in line


@pytest.mark.slow
def test_estimate_of_several_methods_sums_them(tmp_path, capsys):
    out = tmp_path / "run"
    code, err, stdout = run_runner([f"--flagfile={TINY}", f"--output_dir={out}", "--estimate",
                                    "--estimate_rounds=1", "--algorithm=deltafl,fedavg"],
                                   capsys)
    assert code == 0, err
    blocks = parse_blocks(stdout)
    assert [b["name"] for b in blocks] == ["deltafl", "fedavg"]
    for b in blocks:
        assert_adds_up(b, T=6, every=3)
    total = float(re.search(r"estimate of all 2 programs: projected run ([0-9.]+) s",
                            stdout).group(1))
    assert total == pytest.approx(sum(b["projected"] for b in blocks), abs=2e-3)
    assert not out.exists()


def test_measure_runs_the_callbacks_in_the_timed_rounds(tiny_synthetic, tmp_path):
    """The run's callbacks' host work is part of the timed rounds and evaluation: every timed
    round reaches on_round_end (rounds 1..k, with the host metrics), both evaluations (the
    compiling one and the timed one) reach on_evaluation."""
    from deltafl_jax.run import Callback, build_experiment
    from deltafl_jax.run.estimate import measure

    class Count(Callback):
        def __init__(self):
            self.started, self.rounds, self.evals = 0, [], []

        def on_run_start(self, run):
            self.started += 1

        def on_round_end(self, run, round, metrics):
            self.rounds.append((round, int(metrics["train_trips"])))

        def on_evaluation(self, run, evaluation):
            self.evals.append(evaluation.round)

    exp = build_experiment(tiny_config(num_rounds=5, eval_every=5), tiny_synthetic)
    count = Count()
    est = measure(exp, timed_rounds=2, min_seconds=0.0, callbacks=[count],
                  output_dir=str(tmp_path))
    assert count.started == 1
    assert count.rounds == [(i + 1, t) for i, t in enumerate(est.train_trips)]
    assert count.evals == [5, 5]


# --------------------------------------------------------------------------------------------
# Memory: what the round holds, for every registered algorithm


def _experiment_of(name, data, **kw):
    """A tiny run of `name` (its spec's default sweep; thetas only where it sweeps them)."""
    from deltafl_jax import ConfigError
    from deltafl_jax.run import build_experiment
    try:
        return build_experiment(tiny_config(algorithm=name, seeds=(1,), clients_per_step=3,
                                            thetas=(), **kw), data)
    except ConfigError:
        return build_experiment(tiny_config(algorithm=name, seeds=(1,), clients_per_step=3,
                                            **kw), data)


def _nbytes(tree):
    """The bytes of the arrays of `tree` brought to NumPy (a key array: its key data)."""
    import jax
    return sum(np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x).nbytes for x in jax.tree.leaves(tree))


def _poisson_cases():
    """The algorithms that sample a variable cohort; all but the first in CI's slow step."""
    from deltafl_jax.algorithms import registry
    names = [n for n in sorted(registry.names())
             if not registry.get(n).clients.fixed_cohort]
    return names[:1] + [pytest.param(n, marks=pytest.mark.slow) for n in names[1:]]


def _check_round_memory(exp, est):
    """The estimate's memory against the arrays the round is given and returns."""
    import jax
    held = est.memory.compiled_round
    state, keys = exp.initial_state(), exp.keys()
    data = exp.round_data(0, state)
    splits = exp.program.store.device_splits
    train = splits["train"] if splits else ()
    assert held.state == _nbytes(state) and held.keys == _nbytes(keys)
    assert held.data == _nbytes(splits)
    assert held.plan == _nbytes(data) - _nbytes(train)   # the plan: every job slot
    # On CPU the lanes' slot tables are kept between rounds (program.TableRound): given to
    # the round and returned in place, so arguments and aliased outputs, not temporaries.
    assert held.tables == _nbytes(exp.round_fn.tables) > 0
    # The compiled round reads nothing beyond these arrays and holds the new state.
    assert held.arguments <= held.state + held.plan + _nbytes(train) + held.keys + held.tables
    assert held.aliased >= held.tables
    per_model = _nbytes(state.params) // exp.replicas.size
    new_state, _ = jax.block_until_ready(exp.round_fn(state, data, keys))   # donates state
    assert held.outputs >= _nbytes(new_state)
    # Its lanes' step states are temporaries: at least one local model per lane.
    assert held.temporaries >= exp.lanes * per_model
    assert est.memory.nbytes == held.total >= (held.data + held.state + held.plan
                                              + _nbytes(new_state) - held.aliased)


def _registry_cases():
    """Every registered algorithm of synchronous rounds (--estimate refuses the asynchronous
    ones); all but the first in CI's slow step."""
    from deltafl_jax.algorithms import registry
    names = [n for n in sorted(registry.names()) if registry.get(n).asynchronous is None]
    return names[:1] + [pytest.param(n, marks=pytest.mark.slow) for n in names[1:]]


@pytest.mark.parametrize("name", _registry_cases())
def test_estimate_counts_what_the_round_holds(tiny_synthetic, name):
    """Every registered algorithm: the estimate's device memory (XLA:CPU reports no peak) is
    the compiled round's: the actual state, plan, data and keys, its new outputs and its
    temporaries."""
    from deltafl_jax.run.estimate import measure
    exp = _experiment_of(name, tiny_synthetic)
    est = measure(exp, timed_rounds=1, min_seconds=0.0)
    if est.backend != "cpu":
        pytest.skip("the peak of a backend that reports one is checked elsewhere")
    _check_round_memory(exp, est)
    assert "compiled round" in est.memory.source


@pytest.mark.parametrize("name", _poisson_cases())
def test_estimate_sizes_a_poisson_plan_from_its_cap(tiny_synthetic, name):
    """--client_sampling=poisson: the plan has cap > m slots, and the estimate counts them."""
    from deltafl_jax.run.estimate import measure
    exp = _experiment_of(name, tiny_synthetic, client_sampling="poisson", clients_per_round=3)
    cap = exp.run.poisson.cap
    assert cap > 3 and exp.round_plan(0).clients.shape[-1] == cap
    est = measure(exp, timed_rounds=1, min_seconds=0.0)
    _check_round_memory(exp, est)


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_a_program_measured_once_is_reused(tiny_synthetic):
    """measure(cache=...): the same program again (another name, another number of rounds)
    reuses the measured figures and only its own build time and rounds; a program of another
    shape (more replicas) is measured anew."""
    from deltafl_jax.run import build_experiment
    from deltafl_jax.run.estimate import measure
    cache, lines = {}, []
    first = measure(build_experiment(tiny_config(num_rounds=4), tiny_synthetic),
                    timed_rounds=1, min_seconds=0.0, name="a", cache=cache)
    again = measure(build_experiment(tiny_config(num_rounds=9, eval_every=2), tiny_synthetic),
                    timed_rounds=1, min_seconds=0.0, name="b", cache=cache, log=lines.append)
    assert len(cache) == 1 and any("measurements reused" in line for line in lines)
    assert (again.name, again.num_rounds, again.evaluations) == ("b", 9, 5)
    for field in ("compile_s", "round_s", "eval_s", "memory", "train_trips"):
        assert getattr(again, field) == getattr(first, field)
    assert again.projected_s == pytest.approx(again.build_s + first.compile_s
                                              + 9 * first.round_s + 5 * first.eval_s)
    other = measure(build_experiment(tiny_config(thetas=(1.0, 0.5, 0.1)), tiny_synthetic),
                    timed_rounds=1, min_seconds=0.0, name="c", cache=cache)
    assert len(cache) == 2 and other.replicas == 3


# --------------------------------------------------------------------------------------------
# A dataset that is not here: its known shape


def test_known_sizes_have_the_tables_median_min_and_max():
    """FEMNIST's Table 1 row (865 writers, median 179, min 101, max 447)."""
    from deltafl_jax.datasets.known_shapes import KNOWN, client_sizes
    k = KNOWN["femnist"]
    sizes = client_sizes(k.train_clients, k.median, k.lo, k.hi)
    assert len(sizes) == 865 and sizes.min() == 101 and sizes.max() == 447
    assert abs(np.median(sizes) - 179) <= 1 and np.all(np.diff(sizes) >= 0)


def test_the_data_when_present_else_its_known_shape(tmp_path):
    """load_or_stand_in: a prepared FEMNIST (here from a TFF h5 fixture) is loaded; with none
    and no --data_path, the stand-in has the table's clients and the real data's example
    shape, dtype, classes and scale; a --data_path that does not exist stays an error."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from fixtures import federated_files as ff
    from deltafl_jax.data import DataError
    from deltafl_jax.datasets import DataConfig, load_dataset
    from deltafl_jax.datasets.known_shapes import load_or_stand_in
    sizes = {f"f{i:04d}_0{i}": 8 + i for i in range(8)}
    src = ff.write_tff_h5(str(tmp_path / "h5"), ff.femnist_writers(sizes, seed=3))
    cache = str(tmp_path / "cache")
    real = load_dataset(DataConfig(dataset="femnist", data_path=src, data_dir=cache,
                                   min_client_examples=8))
    got, note = load_or_stand_in(DataConfig(dataset="femnist", data_dir=cache,
                                            min_client_examples=8))
    assert note is None and list(got.train.client_ids) == list(real.train.client_ids)
    stand, note = load_or_stand_in(DataConfig(dataset="femnist",
                                              data_dir=str(tmp_path / "empty")))
    assert "known shape" in note and "no prepared data" in note
    assert (stand.train.num_clients, stand.test.num_clients) == (865, 865)
    assert stand.train.feature_shape == real.train.feature_shape
    assert stand.train.x.dtype == real.train.x.dtype and stand.num_classes == real.num_classes
    assert stand.x_scale == real.x_scale
    with pytest.raises(DataError):
        load_or_stand_in(DataConfig(dataset="femnist", data_path=str(tmp_path / "none"),
                                    data_dir=str(tmp_path / "empty")))


@pytest.mark.slow   # builds and compiles the ConvNet on 865 stand-in writers
def test_the_tours_estimate_runs_offline(tmp_path, capsys):
    """experiments.run --flagfile=experiments/emnist.flags --estimate with no FEMNIST here:
    one block measured on the known shape; nothing written."""
    out = tmp_path / "run"
    flagfile = os.path.join(os.path.dirname(HERE), "experiments", "emnist.flags")
    code, err, stdout = run_runner([f"--flagfile={flagfile}", "--estimate",
                                    "--estimate_rounds=1", "--thetas=1.0", "--seeds=1",
                                    "--clients_per_round=4", "--max_train_clients=20",
                                    "--max_test_clients=4", f"--data_dir={tmp_path / 'none'}",
                                    f"--output_dir={out}"], capsys)
    assert code in (0, None), err
    assert len(parse_blocks(stdout)) == 1 and "femnist's known shape" in stdout
    assert not out.exists()
