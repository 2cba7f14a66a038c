"""--algorithm=deltafl_alt: Delta-FL with eta refreshed every T_eta rounds (Algorithm 1 as
App. C.3 runs it), against a NumPy loop written from the paper, and its limit T_eta = 1."""

import json
import os

import jax
import numpy as np
import pytest

import numpy_options as no
from conftest import run_runner, tiny_config, run_rounds_history
from numpy_reference import exact_weights, reference_weights
from deltafl_jax import build_experiment, load_model

HERE = os.path.dirname(__file__)


run = run_rounds_history


def leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
@pytest.mark.parametrize("filter,lanes", [("exact", 1), ("exact", 3), ("reference", 2)])
def test_eta_every_one_is_deltafl_bit_for_bit(tiny_synthetic, filter, lanes):
    kw = dict(thetas=(1.0, 0.5, 0.2), seeds=(1, 2), l2_reg=1e-3, filter=filter,
              clients_per_step=lanes)
    sd, hd = run(build_experiment(tiny_config(**kw), tiny_synthetic), 5)
    sa, ha = run(build_experiment(tiny_config(algorithm="deltafl_alt", eta_every=(1,), **kw),
                                  tiny_synthetic), 5)
    assert leaves_equal(sd.params, sa.params)
    for d, a in zip(hd, ha):
        for k in ("eta", "num_selected", "kept_examples"):
            np.testing.assert_array_equal(d[k], a[k])
        assert (a["eta_refreshed"] == 1).all() and (a["empty_round"] == 0).all()


def alt_rule(theta, T, filter):
    """The NumPy round rule with eta held between refreshes (closure state)."""
    held = {}

    def rule(F, n, t):
        if t % T == 0:
            held["eta"] = no.authors_eta(F, n, theta)
            return (exact_weights if filter == "exact" else reference_weights)(F, n, theta)
        return np.where(F > held["eta"], n, 0.0)
    return rule, held


@pytest.mark.parametrize("filter", ["exact", "reference"])
def test_rounds_equal_numpy(tiny_synthetic, filter):
    rounds = 9
    cfg = tiny_config(algorithm="deltafl_alt", thetas=(0.7, 0.2), eta_every=(3, 4),
                      seeds=(1, 2), l2_reg=1e-3, filter=filter, clients_per_step=3)
    exp = build_experiment(cfg, tiny_synthetic)
    state, hist = run(exp, rounds)
    xs = [tiny_synthetic.train.client(k)[0].astype(np.float64)
          for k in range(tiny_synthetic.train.num_clients)]
    ys = [tiny_synthetic.train.client(k)[1] for k in range(tiny_synthetic.train.num_clients)]
    empty = 0
    for r, lab in enumerate(exp.replicas.labels):
        T = int(dict(lab.extra)["eta_every"])
        rule, held = alt_rule(lab.theta, T, filter)
        W, b = np.zeros((60, 10)), np.zeros(10)
        for t in range(rounds):
            W_before = W
            W, b, F, a = no.weighted_round(W, b, xs, ys, lab.seed, t, 6, cfg.learning_rate,
                                           cfg.l2_reg, cfg.batch_size,
                                           lambda F, n: rule(F, n, t))
            m = hist[t]
            assert int(m["num_selected"][r]) == int(np.sum(a > 0)), (lab.key(), t)
            assert int(m["eta_refreshed"][r]) == int(t % T == 0)
            assert int(m["empty_round"][r]) == int(np.sum(a > 0) == 0)
            assert float(m["eta"][r]) == pytest.approx(held["eta"], rel=1e-5)
            if np.sum(a > 0) == 0:
                empty += 1
                assert W is W_before
        p = jax.device_get(state.params)["Dense_0"]
        np.testing.assert_allclose(np.asarray(p["kernel"][r]), W, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(p["bias"][r]), b, atol=2e-5, rtol=1e-4)
    assert empty > 0     # some rounds had no client above the held eta


def test_empty_round_leaves_w_unchanged_bit_for_bit(tiny_synthetic):
    cfg = tiny_config(algorithm="deltafl_alt", thetas=(0.2,), eta_every=(4,), l2_reg=1e-3)
    exp = build_experiment(cfg, tiny_synthetic)
    state, keys = exp.initial_state(), exp.keys()
    seen = 0
    for t in range(9):
        before = jax.tree.map(np.asarray, state.params)
        state, m = exp.round_fn(state, exp.round_data(t), keys)
        if int(m["empty_round"][0]):
            seen += 1
            assert leaves_equal(before, state.params)
    assert seen > 0


def test_run_outputs_labels_and_load_model(tmp_path, capsys):
    out = tmp_path / "alt"
    code, err, _ = run_runner([f"--flagfile={os.path.join(HERE, 'tiny.flags')}",
                               f"--output_dir={out}", "--algorithm=deltafl_alt",
                               "--thetas=0.5", "--eta_every=1,3"], capsys)
    assert code == 0, err
    with open(out / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert {(r["theta"], r["eta_every"], r["seed"]) for r in recs} == {
        (0.5, 1.0, 1), (0.5, 1.0, 2), (0.5, 3.0, 1), (0.5, 3.0, 2)}
    with np.load(out / "rounds.npz") as r:
        assert r["empty_round"].shape == (6, 4) and r["eta_refreshed"][:, 0].all()
    model = load_model(str(out), theta=0.5, eta_every=3, seed=2)
    assert model.labels["eta_every"] == 3.0
    code, err, _ = run_runner([f"--flagfile={os.path.join(HERE, 'tiny.flags')}",
                               f"--output_dir={tmp_path / 'bad'}", "--algorithm=deltafl_alt",
                               "--eta_every=0"], capsys)
    assert code == 2 and "eta_every" in err
