"""The quantile level 1 - theta in float64.

The authors' code takes eta = sorted(losses repeated n_k times)[ceil(N_tot * p) - 1] with
p = 1 - theta and the product in double precision. At exact boundaries of the cumulative
weights (theta = 0.9 with 10 equal clients, theta = 2/3 with 3) float32 rounds the other way
and the reference filter would keep a different set. The rule is written here in NumPy
float64 from that description, independently of deltafl_jax.superquantile.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from numpy_reference import delta_fl_round
from deltafl_jax import FederatedDataset, build_experiment
from deltafl_jax.data import ClientData
from deltafl_jax.superquantile import quantile_levels, threshold_weights, weighted_quantile

BOUNDARY_THETAS = (0.9, 2 / 3, 0.7, 1 / 3, 0.8, 0.1, 0.5)


def authors_eta(values, counts, theta):
    """The reference code's eta, in float64: p = 1 - theta, losses repeated n_k times."""
    p = 1.0 - theta
    rep = np.sort(np.repeat(np.asarray(values, np.float64), np.asarray(counts, np.int64)))
    return rep[0] if p == 0 else rep[math.ceil(rep.size * p) - 1]


def float32_eta(values, counts, theta):
    """What a float32 level gives (the behaviour before the fix)."""
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(np.asarray(counts, np.float32)[order])
    level = np.float32(1.0) - np.float32(theta)
    return np.asarray(values)[order][np.argmax(cum >= np.float32(level * cum[-1]))]


def boundary_cases():
    rng = np.random.default_rng(0)
    for theta in BOUNDARY_THETAS:
        for m in range(2, 31):
            for n in (1, 3, 7, 50, 100, 120, 1000):
                v = rng.permutation(m).astype(np.float32) + 0.25
                yield theta, v, np.full(m, n)


@pytest.mark.slow
def test_equal_weights_at_every_boundary_match_the_authors_rule():
    levels = quantile_levels(BOUNDARY_THETAS)
    table = jax.jit(lambda v, w, t: weighted_quantile(v, w, levels(t)))
    differs = set()
    for theta, v, n in boundary_cases():
        want = authors_eta(v, n, theta)
        w = n.astype(np.float32)
        assert float(weighted_quantile(v, w, 1.0 - theta)) == want, (theta, len(v), n[0])
        assert float(table(v, w, np.float32(theta))) == want, (theta, len(v), n[0])
        if float32_eta(v, n, theta) != want:
            differs.add((round(theta, 4), len(v)))
    # The cases that the float32 level got wrong: theta = 0.9 with 10 clients, 2/3 with 3.
    assert (0.9, 10) in differs and (0.6667, 3) in differs


def test_random_integer_weights_match_the_authors_rule():
    rng = np.random.default_rng(1)
    thetas = (0.9, 2 / 3, 0.7, 0.3, 0.1, 0.25, 0.55, 1.0)
    levels = quantile_levels(thetas)
    f = jax.jit(jax.vmap(lambda v, w, t: weighted_quantile(v, w, levels(t)),
                         in_axes=(0, 0, None)))
    for theta in thetas:
        counts = rng.integers(1, 40, size=(400, 12))
        counts[:200] = counts[:200, :1]          # half the cases with equal weights
        values = np.round(rng.normal(size=(400, 12)), 1).astype(np.float32)  # ties too
        got = np.asarray(f(values, counts.astype(np.float32), np.float32(theta)))
        want = [authors_eta(v, c, theta) for v, c in zip(values, counts)]
        np.testing.assert_array_equal(got, np.asarray(want, np.float32))


def test_threshold_filter_keeps_what_the_authors_keep():
    levels = quantile_levels((0.9, 2 / 3))
    keep = jax.jit(jax.vmap(lambda v, w, t: threshold_weights(v, w, t, level=levels(t)),
                            in_axes=(None, None, 0)))
    v10, w10 = jnp.arange(10.0) + 1.0, jnp.full(10, 100.0)
    v3, w3 = jnp.arange(3.0) + 1.0, jnp.full(3, 100.0)
    thetas = jnp.asarray([0.9, 2 / 3], jnp.float32)
    # theta = 0.9, 10 equal clients: N p falls just below N / 10, eta is the smallest loss and
    # all 10 are kept; theta = 2/3, 3 clients: N p falls just above N / 3, eta is the middle.
    assert int(jnp.sum(keep(v10, w10, thetas)[0] > 0)) == 10
    assert int(jnp.sum(keep(v3, w3, thetas)[1] > 0)) == 2


def equal_sized(data: FederatedDataset, n: int) -> FederatedDataset:
    """The same clients cut to their first n examples."""
    def cut(split):
        xs = [split.client(k)[0][:n] for k in range(split.num_clients)]
        ys = [split.client(k)[1][:n] for k in range(split.num_clients)]
        return ClientData.from_clients(xs, ys)
    return FederatedDataset(data.name, cut(data.train), cut(data.test),
                            num_classes=data.num_classes)


@pytest.mark.parametrize("theta,m", [(0.9, 10), (2 / 3, 3)])
def test_reference_round_at_a_boundary_equals_numpy(tiny_synthetic, theta, m):
    data = equal_sized(tiny_synthetic, 50)
    cfg = tiny_config(filter="reference", thetas=(theta,), clients_per_round=m, l2_reg=1e-3,
                      clients_per_step=2)
    exp = build_experiment(cfg, data)
    state, keys = exp.initial_state(), exp.keys()
    xs = [data.train.client(k)[0].astype(np.float64) for k in range(data.train.num_clients)]
    ys = [data.train.client(k)[1] for k in range(data.train.num_clients)]
    W, b = np.zeros((60, 10)), np.zeros(10)
    for t in range(4):
        state, metrics = exp.round_fn(state, exp.round_data(t), keys)
        W, b, F, a = delta_fl_round(W, b, xs, ys, 1, t, m, theta, "reference",
                                    cfg.learning_rate, cfg.l2_reg, cfg.batch_size)
        assert int(metrics["num_selected"][0]) == int(np.sum(a > 0)), t
        assert float(metrics["eta"][0]) == pytest.approx(authors_eta(F, np.full(m, 50), theta),
                                                         rel=1e-5)
    # After round 0 (all losses tie at log 10) the authors' rule keeps all 10 at 0.9, 2 of 3
    # at 2/3: the boundary client is kept in the first case, dropped in the second.
    assert int(np.sum(a > 0)) == (10 if m == 10 else 2)
    p = jax.device_get(state.params)["Dense_0"]
    np.testing.assert_allclose(np.asarray(p["kernel"][0]), W, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(p["bias"][0]), b, atol=2e-5, rtol=1e-4)
