"""An asynchronous run on the command line (--algorithm=fedbuff, fedasync;
deltafl_jax/run/buffered.py): a round of the loop is one server step. Its outputs against the
library's BufferedRun driven by hand with the same settings (itself checked against a NumPy
event simulation of FedBuff's Algorithm 1, tests/test_fedbuff.py), its end by virtual time,
its refusals, and a run killed and resumed."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from conftest import refused_over_a_finished_run, run_runner, tiny_config
from deltafl_jax import run_experiment
from deltafl_jax.algorithms.buffered import fedasync, fedbuff
from deltafl_jax.asynchronous.run import BufferedRun
from deltafl_jax.asynchronous.step import current_params, init_buffered_state
from deltafl_jax.engine import LocalSGDConfig
from deltafl_jax.models import build_model
from deltafl_jax.replicas.labels import Replicas
from deltafl_jax.run.resolve import resolve
from deltafl_jax.sampling import plan as plan_lib
from deltafl_jax.asynchronous.scheduler import AsyncSettings, job_durations
from deltafl_jax.sampling.speeds import build_speeds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "tests", "tiny.flags")
SEEDS, STEPS, LR, B = (1, 2), 6, 0.05, 8


def by_hand(data, config, settings, rule=fedbuff.RULE):
    """The run's server steps through BufferedRun, built here from the settings: (served
    models [R, ...] after STEPS steps, each step's virtual time [STEPS, G])."""
    model = build_model("linear", data)
    G = len(SEEDS)
    replicas = Replicas(group=np.arange(G, dtype=np.int32), hyper=(),
                        l2=np.zeros(G, np.float32),
                        schedules=tuple(optax.constant_schedule(LR) for _ in SEEDS), labels=())
    work = plan_lib.LocalWork(batch_size=B, local_epochs=1)
    speeds = build_speeds(config.timing, num_clients=data.train.num_clients,
                          data_seed=config.data.data_seed)
    nbytes = sum(int(np.prod(a.shape)) * 4 for a in
                 jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))
    run = BufferedRun(model, replicas, LocalSGDConfig(batch_size=B, lanes=1), seeds=SEEDS,
                      settings=settings, offsets=data.train.offsets, work=work,
                      seconds=job_durations(speeds, data.train.sizes, work, nbytes),
                      availability=resolve(config, data).availability, rule=rule)
    keys = jax.vmap(jax.random.key)(np.asarray(SEEDS, np.uint32))
    state = init_buffered_state(jax.vmap(model.init)(keys), run.schedulers[0].V)
    times = []
    for _ in range(STEPS):
        state, metrics = run.step(state, data.train.x, data.train.y, keys)
        times.append(metrics["virtual_time"])
    return jax.device_get(current_params(state)), np.stack(times)


def async_config(out=None, **kw):
    base = dict(algorithm="fedbuff", thetas=(1.0,), seeds=SEEDS, num_rounds=STEPS,
                eval_every=3, batch_size=B, learning_rate=LR, client_speed="lognormal",
                concurrency=5, buffer_size=3, max_staleness=2, availability="bernoulli",
                availability_p=0.8, output_dir=out, save_models=out is not None)
    return tiny_config(**{**base, **kw})


@pytest.mark.parametrize("algorithm, client_data", [
    ("fedbuff", "device"),
    pytest.param("fedasync", "device", marks=pytest.mark.slow),   # CI's second step
    pytest.param("fedbuff", "host", marks=pytest.mark.slow)])
def test_the_run_equals_buffered_run_driven_by_hand(tiny_synthetic, tmp_path, algorithm,
                                                    client_data):
    """Lognormal speeds, Bernoulli availability, C = 5 of 12 clients, S = 2: the served
    models and every step's virtual time of the run are those of BufferedRun stepped by hand
    (FedAsync: K = 1 whatever --buffer_size says, the mixing of --fedasync_alpha), with the
    split on the device or kept by the host (each step's examples packed)."""
    extra = {"fedasync_alpha": 0.7} if algorithm == "fedasync" else {}
    config = async_config(str(tmp_path / "run"), algorithm=algorithm, client_data=client_data,
                          **extra)
    result = run_experiment(config, tiny_synthetic)
    settings = AsyncSettings(5, 1 if algorithm == "fedasync" else 3, 2)
    served, times = by_hand(tiny_synthetic, config, settings,
                            fedasync.rule(0.7) if algorithm == "fedasync" else fedbuff.RULE)
    for a, b in zip(jax.tree.leaves(result.served), jax.tree.leaves(served)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(result.per_round["virtual_time"], times)
    assert np.all(result.per_round["num_selected"] == settings.buffer_size)
    out = tmp_path / "run"
    for name in ("metrics.jsonl", "summary.json", "clients.npz", "rounds.npz"):
        assert (out / name).exists(), name
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["round"] for r in recs] == [3, 3, 6, 6]
    assert [r["virtual_time"] for r in recs] == [times[2, 0], times[2, 1], times[5, 0],
                                                 times[5, 1]]
    with np.load(out / "clients.npz") as c:   # every update aggregated, per client
        assert c["train_updates_aggregated"].sum(axis=1).tolist() == [
            STEPS * settings.buffer_size] * len(SEEDS)


def test_the_run_ends_at_the_virtual_time_asked(tiny_synthetic):
    """--stop_at_virtual_time: the first step at which both seeds' clocks reached it, and
    summary.json's ``ended`` says so."""
    config = async_config(num_rounds=STEPS)
    _, times = by_hand(tiny_synthetic, config, AsyncSettings(5, 3, 2))
    stop = float(times[3].max())
    expected = int(np.flatnonzero(np.all(times >= stop, axis=1))[0]) + 1
    result = run_experiment(async_config(num_rounds=STEPS, stop_at_virtual_time=stop),
                            tiny_synthetic)
    assert result.rounds_done == expected < STEPS
    assert result.summary["ended"]["round"] == expected
    assert "--stop_at_virtual_time" in result.summary["ended"]["reason"]


@pytest.mark.parametrize("args, message", [
    (("--buffer_size=7", "--concurrency=6"), "--buffer_size=7: more than --concurrency=6"),
    (("--concurrency=11",), "--concurrency=11: more than the 10 training clients"),
    (("--round_deadline=3", "--client_speed=uniform"), "--round_deadline: --algorithm=fedbuff"),
    (("--over_select=1.5", "--client_speed=uniform"), "--over_select: --algorithm=fedbuff"),
    (("--dp_clip=0.5", "--dp_noise_multiplier=1"), "--algorithm=fedbuff"),
    (("--thetas=0.5",), "--algorithm=fedbuff trains every update"),
    (("--client_holdout=0.2",), "--client_holdout: --algorithm=fedbuff"),
    (("--client_sampling=poisson",), "--client_sampling=poisson: --algorithm=fedbuff"),
    (("--max_staleness=-1",), "--max_staleness=-1"),
    (("--algorithm=fedasync", "--fedasync_alpha=1.5"),
     "--fedasync_alpha must be a finite number > 0 and <= 1, got 1.5"),
    (("--algorithm=fedbuff+ditto",), "which is asynchronous"),
])
def test_bad_settings_are_refused_in_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    code, err, _ = run_runner([f"--flagfile={TINY}", f"--output_dir={out}",
                               "--algorithm=fedbuff", "--thetas=1", "--concurrency=6",
                               "--buffer_size=3", *args], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not out.exists()


@pytest.mark.slow
def test_the_command_refuses_k_over_c_and_leaves_the_folder(tiny_synthetic, tmp_path):
    """A subprocess with --overwrite into a folder holding a finished run: one line, exit 2,
    the folder byte-identical."""
    refused_over_a_finished_run(tmp_path, tiny_synthetic, "--algorithm=fedbuff", "--thetas=1",
                                "--concurrency=4", "--buffer_size=5",
                                message="--buffer_size=5: more than --concurrency=4")


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, thetas", [
    ("fedbuff", "1"), ("fedasync", "1"), ("fedbuff_fedscale", "1"), ("deltafl_buffered", "0.5")])
def test_an_asynchronous_run_killed_and_rerun_is_bit_identical(tmp_path, algorithm, thetas):
    """SIGKILL after a checkpoint in the middle of the run, rerun: the same outputs, bit for
    bit, as a run never stopped (the ring of versions, the server optimizer's state, the
    schedulers' clocks, jobs in flight, buffers and Markov chains come back; FedScale's form
    with its larger ring and its refill before the step, buffered Delta-FL with its filter)."""
    from test_resume import killed_and_rerun
    out = killed_and_rerun(tmp_path, f"--algorithm={algorithm}", f"--thetas={thetas}",
                           "--client_speed=lognormal", "--concurrency=6", "--buffer_size=3",
                           "--max_staleness=3", "--availability=markov", "--availability_p=0.7",
                           "--server_optimizer=adam", "--server_lr=0.05")
    with np.load(os.path.join(out, "rounds.npz")) as r:
        assert np.all(np.diff(r["virtual_time"], axis=0) >= 0)
        assert r["staleness_mean"].max() > 0


def test_the_report_draws_fedbuff_beside_synchronous_rounds(tiny_synthetic, tmp_path):
    """A FedBuff run and a clocked FedAvg run on the same data share the report's row: the
    figure of the error against virtual time draws both, FedBuff's line from its own steps'
    virtual times and evaluations (hand-read: from the later seed's first evaluation, each
    seed's last evaluation at or before that time)."""
    from deltafl_jax import report
    from deltafl_jax.report.virtual_time import virtual_time_figure
    from test_virtual_clock import check_curve_against_the_files
    buff, sync = str(tmp_path / "fedbuff"), str(tmp_path / "fedavg")
    run_experiment(async_config(buff, num_rounds=4, eval_every=2), tiny_synthetic)
    run_experiment(tiny_config(algorithm="fedavg", thetas=(1.0,), seeds=SEEDS, num_rounds=4,
                               eval_every=2, client_speed="lognormal", output_dir=sync),
                   tiny_synthetic)
    runs, _ = report.load([buff, sync])
    cols = report.columns(runs)
    assert len({c.setting for c in cols}) == 1 and len(cols) == 2
    (col,) = [c for c in cols if c.run.path.rstrip("/") == buff]
    check_curve_against_the_files(col, buff)
    fig = virtual_time_figure(cols)
    labels = {line.get_label() for line in fig.axes[0].get_lines()}
    assert {c.label for c in cols} <= labels and any("FedBuff" in x for x in labels)


@pytest.mark.slow
def test_one_and_two_devices_agree(tmp_path):
    """The same FedBuff run on one and on two (XLA:CPU) devices: the same models and metrics
    within 1e-5."""
    import flax.serialization
    outs = []
    for d in (1, 2):
        out = str(tmp_path / f"d{d}")
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.run", f"--flagfile={TINY}",
             f"--output_dir={out}", "--algorithm=fedbuff", "--thetas=1", "--concurrency=6",
             "--buffer_size=3", "--client_speed=lognormal", f"--devices={d}",
             "--tensorboard=no"], cwd=REPO, capture_output=True, text=True, timeout=300,
            env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
        assert proc.returncode == 0, proc.stderr
        assert f"placement: {d} cpu device(s)" in proc.stdout
        outs.append(out)
    recs = [[json.loads(line) for line in open(os.path.join(o, "metrics.jsonl"))] for o in outs]
    for a, b in zip(*recs):
        for k in ("train_loss_mean", "test_error_mean", "test_error_p90", "virtual_time"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    for f in sorted(f for f in os.listdir(os.path.join(outs[0], "models"))
                    if f.endswith(".msgpack")):
        ta, tb = (flax.serialization.msgpack_restore(open(os.path.join(o, "models", f),
                                                          "rb").read()) for o in outs)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
                     ta, tb)
