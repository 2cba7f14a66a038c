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
