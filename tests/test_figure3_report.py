"""Figure 3, complete: the loss over the mixture simplex and its histogram
over mixtures of conformity >= theta, from the Gaussian toy run, in the report.

Independent facts used (Sec. 3): F(w; p_pi) = sum_k pi_k F_k(w); P_theta = {pi in the simplex:
pi_k <= alpha_k / theta}; the worst mixture loss over P_theta is the superquantile, obtained
by filling the caps alpha_k / theta from the largest F_k down.
"""

import os

import numpy as np
import pytest

from deltafl_jax import DataConfig, ExperimentConfig, run_experiment
from deltafl_jax.report import load, mixture_data, uniform_mixtures, write_report
from deltafl_jax.report.figures import conformity_polygon

MEANS = ((0.0, 0.0), (1.5, 1.0), (4.0, 0.0))


def worst_mixture_loss(F, alpha, theta):
    """max over P_theta of sum_k pi_k F_k: greedy from the largest loss."""
    left, total = 1.0, 0.0
    for k in np.argsort(-F):
        take = min(alpha[k] / theta, left)
        total += take * F[k]
        left -= take
    return total


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy") / "run"
    config = ExperimentConfig(
        data=DataConfig("gaussian_toy", toy_means=MEANS, toy_examples_per_client=200),
        model="mean", thetas=(1.0, 2 / 3), seeds=(1,), num_rounds=60, clients_per_round=3,
        batch_size=200, learning_rate=0.1, eval_every=60, output_dir=str(out), verbose=False)
    run_experiment(config)
    return str(out)


def test_conformity_polygon_vertices():
    mid = conformity_polygon([0.5, 0.5, 0.5])     # theta = 2/3, alpha = 1/3: medial triangle
    assert sorted(map(tuple, mid)) == [(0.0, 0.5, 0.5), (0.5, 0.0, 0.5), (0.5, 0.5, 0.0)]
    hexagon = conformity_polygon([0.6, 0.6, 0.6])
    assert len(hexagon) == 6 and np.allclose(hexagon.sum(1), 1.0)
    assert np.all(hexagon <= 0.6 + 1e-12) and np.all(hexagon >= -1e-12)
    assert len(conformity_polygon([1.0, 1.0, 1.0])) == 3    # theta = 1 ... caps >= 1: simplex


def test_uniform_mixtures_respect_the_caps_and_are_uniform():
    alpha = np.full(3, 1 / 3)
    pi = uniform_mixtures(alpha, 2 / 3, count=30000, seed=1)
    assert pi.shape == (30000, 3) and np.allclose(pi.sum(1), 1.0)
    assert np.all(pi <= 0.5 + 1e-12)
    # Uniform on the medial triangle: mean at its centroid, each coordinate's law is that of
    # a uniform point of a triangle with vertices at 0, 1/2, 1/2 (density 8 x on [0, 1/2]).
    np.testing.assert_allclose(pi.mean(0), [1 / 3] * 3, atol=5e-3)
    frac_below = np.mean(pi[:, 0] < 0.25)
    assert frac_below == pytest.approx(0.25, abs=0.01)          # integral of 8x on [0, 1/4]


def test_mixture_losses_come_from_clients_npz_and_delta_fl_has_the_smaller_worst(toy_run):
    (run,), _ = load([toy_run])
    from deltafl_jax.report import columns
    cols = columns([run])
    alpha, theta, losses = mixture_data(cols)
    assert theta == pytest.approx(2 / 3)
    z = np.load(os.path.join(toy_run, "clients.npz"))
    np.testing.assert_allclose(alpha, z["train_sizes"] / z["train_sizes"].sum())
    keys = [str(k) for k in z["replica_keys"]]
    F_fedavg = z["train_loss"][keys.index(next(k for k in keys if k.startswith("theta=1_")))]
    F_delta = z["train_loss"][keys.index(next(k for k in keys if not k.startswith("theta=1_")))]
    np.testing.assert_allclose(losses["FedAvg"], F_fedavg)
    worst = {name: worst_mixture_loss(F, alpha, theta)
             for name, F in (("fedavg", F_fedavg), ("delta", F_delta))}
    assert worst["delta"] < worst["fedavg"]          # the paper's Figure 3 (right)
    pi = uniform_mixtures(alpha, theta)
    sampled = pi @ F_delta
    assert sampled.max() <= worst["delta"] + 1e-9
    assert sampled.max() >= worst["delta"] - 0.02 * abs(worst["delta"])


def test_the_report_draws_figure_3_for_the_toy(toy_run, tmp_path):
    runs, _ = load([toy_run])
    out = write_report(runs, str(tmp_path))
    names = [os.path.basename(f) for f in out["figures"]]
    assert "fig3_mixtures_gaussian_toy_mean.png" in names
    assert "Fig. 3" in open(out["report"]).read()
