"""Who took part, recorded by a run: each client's rounds online and rounds sampled per seed
(clients.npz, ``train_rounds_online`` / ``train_rounds_sampled``) and each round's online count
(rounds.npz, ``num_online``), against a NumPy recount of the samplers' draws; a run continued
from its checkpoint goes on with the same counts as one never stopped."""

import os

import numpy as np
import pytest

from conftest import tiny_config
from deltafl_jax import run_experiment
from deltafl_jax.sampling.samplers import poisson_cohort, sample_clients


def _recount(draw, seeds, rounds, num_clients):
    """[S, N]: the rounds each client was drawn, per seed (NumPy)."""
    out = np.zeros((len(seeds), num_clients), np.int64)
    for s, seed in enumerate(seeds):
        for t in range(rounds):
            out[s, np.unique(draw(seed, t))] += 1
    return out


def _clients(out):
    with np.load(os.path.join(out, "clients.npz")) as f:
        return {k: f[k] for k in f.files}


def _rounds(out):
    with np.load(os.path.join(out, "rounds.npz")) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_a_run_records_each_clients_rounds_online_and_sampled(tiny_synthetic, tmp_path,
                                                              sampling):
    seeds, T, m = (1, 2), 4, 5
    N = tiny_synthetic.train.num_clients
    out = str(tmp_path / "run")
    run_experiment(tiny_config(seeds=seeds, num_rounds=T, clients_per_round=m, eval_every=2,
                               client_sampling=sampling, output_dir=out), tiny_synthetic)
    if sampling == "fixed":
        want = _recount(lambda s, t: sample_clients(s, t, N, m), seeds, T, N)
    else:
        want = _recount(lambda s, t: poisson_cohort(s, t, N, m / N, N), seeds, T, N)
    c = _clients(out)
    # replicas: theta in (1, 0.5) x seeds (1, 2), each with its seed's counts
    order = [seeds.index(int(str(k).rsplit("seed=", 1)[1])) for k in c["replica_keys"]]
    assert sorted(order) == [0, 0, 1, 1]
    np.testing.assert_array_equal(c["train_rounds_sampled"], want[order])
    np.testing.assert_array_equal(c["train_rounds_online"], np.full((4, N), T))
    np.testing.assert_array_equal(_rounds(out)["num_online"], np.full((T, 4), N))


@pytest.mark.slow
def test_a_continued_run_counts_on_as_one_never_stopped(tiny_synthetic, tmp_path):
    """Two rounds, then the same run continued to four from its checkpoint: the counts (and
    every output) equal a four-round run's."""
    kw = dict(seeds=(1, 2), clients_per_round=4, eval_every=2, checkpoint_every=2)
    straight, continued = str(tmp_path / "a"), str(tmp_path / "b")
    run_experiment(tiny_config(num_rounds=4, output_dir=straight, **kw), tiny_synthetic)
    run_experiment(tiny_config(num_rounds=2, output_dir=continued, **kw), tiny_synthetic)
    run_experiment(tiny_config(num_rounds=4, output_dir=continued, **kw), tiny_synthetic)
    a, b = _clients(straight), _clients(continued)
    for k in ("train_rounds_online", "train_rounds_sampled"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert a["train_rounds_sampled"].sum() == 4 * 4 * 4   # 4 rounds x 4 clients x 4 replicas
    np.testing.assert_array_equal(_rounds(straight)["num_online"],
                                  _rounds(continued)["num_online"])


# ------------------------------------------------------------------ the command line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "tests", "tiny.flags")


@pytest.mark.parametrize("args,message", [
    (["--availability=bernoulli", "--dp_clip=0.5", "--dp_noise_multiplier=1"],
     "--dp_clip with --availability=bernoulli"),
    (["--availability=markov", "--algorithm=scaffold", "--thetas=1"],
     "--availability=markov: --algorithm=scaffold needs a fixed cohort"),
    (["--availability=bernoulli", "--availability_p=1.5"], "availability_p"),
])
def test_what_availability_cannot_run_with_exits_2_with_one_line(tmp_path, capsys, args,
                                                                 message):
    from conftest import run_runner
    out = tmp_path / "out"
    code, err, _ = run_runner([f"--flagfile={TINY}", f"--output_dir={out}", *args], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not out.exists()


@pytest.mark.slow
def test_a_bernoulli_run_from_the_command_line_samples_only_online_clients(tmp_path):
    """--availability=bernoulli with m = every training client: the fixed sampler takes
    every online client, so each client's rounds sampled equal its rounds online, about
    p T of them, and the per-round online counts add up to them."""
    import subprocess
    import sys
    out = tmp_path / "run"
    T, p = 30, 0.3
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", f"--flagfile={TINY}", f"--output_dir={out}",
         "--availability=bernoulli", f"--availability_p={p}", f"--num_rounds={T}",
         "--eval_every=10", "--clients_per_round=10", "--thetas=0.5"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    c, r = _clients(str(out)), _rounds(str(out))
    online, sampled = c["train_rounds_online"], c["train_rounds_sampled"]
    N = online.shape[1]
    assert N == 10
    np.testing.assert_array_equal(sampled, online)
    np.testing.assert_array_equal(online.sum(axis=1), r["num_online"].sum(axis=0))
    rate = online.mean() / T
    assert abs(rate - p) < 4 * np.sqrt(p * (1 - p) / (T * N)), rate
    assert np.all(r["num_online"] <= N) and r["num_online"].shape == (T, online.shape[0])


@pytest.mark.slow
def test_a_markov_run_killed_and_rerun_is_bit_identical(tmp_path):
    """SIGKILL after a checkpoint, rerun: the same outputs, bit for bit, as a run never
    stopped (the markov chains' state and the participation counts come back from the
    checkpoint)."""
    from test_resume import killed_and_rerun
    out = killed_and_rerun(tmp_path, "--availability=markov", "--availability_p=0.5",
                           "--availability_markov_off_on=0.3")
    assert _rounds(out)["num_online"].min() < 20   # some clients were offline


def test_evaluations_split_the_error_by_the_availability_of_both_populations(tiny_synthetic):
    """With availability, the evaluation splits the test devices' and the seen clients' errors
    by quintile of p_i: the training clients' p_i from the run's model, the test devices' from
    the same model over the test split, the seen clients' rounds online and sampled summed
    per quintile; without it, nothing of the kind is reported."""
    from deltafl_jax.evaluation.by_availability import population_split
    from deltafl_jax.run.experiment import build_experiment
    from deltafl_jax.run.resolve import label_counts
    from deltafl_jax.sampling.availability import AvailabilitySettings, build_availability
    base = dict(algorithm="deltafl", thetas=(0.5,), num_rounds=4, clients_per_round=6,
                client_holdout=0.3)
    plain = build_experiment(tiny_config(**base), tiny_synthetic)
    assert plain.evaluator.availability_split is None
    cfg = tiny_config(**base, availability="bernoulli", availability_probs="data")
    exp = build_experiment(cfg, tiny_synthetic)
    settings = AvailabilitySettings(model="bernoulli", probabilities="data")
    for split, rates in ((exp.data.train, exp.evaluator.availability_split.train_rates),
                         (exp.data.test, exp.evaluator.availability_split.test_rates)):
        want = build_availability(settings, num_clients=split.num_clients, sizes=split.sizes,
                                  label_counts=label_counts(split, exp.data.num_classes),
                                  num_rounds=4).rates()
        np.testing.assert_array_equal(rates, want)
    assert np.ptp(exp.evaluator.availability_split.train_rates) > 0   # data-correlated: they differ
    state = exp.initial_state()
    keys = exp.keys()
    for t in range(4):
        state, _ = exp.round_fn(state, exp.round_data(t), keys)
        exp.count_round(t)
    per_client = exp.evaluate(exp.served_params(state), 4)
    per_client.update(exp.evaluate_personal(state, 4))
    out = exp.summarize(per_client)
    ref = population_split(per_client["test_error"], exp.evaluator.availability_split.test_rates)
    for j in range(1, 6):
        np.testing.assert_allclose(out[f"test_avail_q{j}_error_mean"], ref[f"q{j}_error_mean"])
    assert "seen_avail_q1_train_rounds_online" in out
    total = sum(out[f"seen_avail_q{j}_train_rounds_sampled"] for j in range(1, 6))
    np.testing.assert_array_equal(total, per_client["train_rounds_sampled"].sum(axis=1))
