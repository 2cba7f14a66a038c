"""Personalised evaluation (--client_holdout, --finetune_steps): the held-out split, the adapted
evaluation of unseen devices and of seen clients' personal models against NumPy loops written
from the documented rule (TFF's personalisation evaluation: k plain SGD steps on the client's own
minibatches, then its held-out error), the sampled form, the worst-10% mean, serving a training
client's personal model, and the refusals."""

import math

import jax
import numpy as np
import pytest

from conftest import client_lists, linear_rows, run_rounds_history, run_runner, tiny_config
from deltafl_jax import build_experiment, load_model
from deltafl_jax.evaluation.holdout import HOLDOUT_STREAM, held_counts, hold_out
from deltafl_jax.evaluation.metrics import worst_mean
from deltafl_jax.run.personal import PERSONAL_STREAM
from numpy_reference import grad_mean_xent, scores, softmax_xent

L2, LR, B = 1e-3, 0.05, 8


def test_holdout_keeps_a_fraction_of_every_client_apart(tiny_synthetic):
    data = hold_out(tiny_synthetic, 0.3, seed=7)
    for name, whole, kept, held in (
            ("train", tiny_synthetic.train, data.train, data.holdout.train_held),
            ("test", tiny_synthetic.test, data.holdout.test_adapt, data.holdout.test_held)):
        n = whole.sizes
        want = np.minimum(np.maximum(1, np.rint(0.3 * n)), n - 1)
        np.testing.assert_array_equal(held.sizes, want)
        np.testing.assert_array_equal(kept.sizes + held.sizes, n)
        split = 0 if name == "train" else 1
        for k in range(whole.num_clients):
            x, _ = whole.client(k)
            rng = np.random.default_rng([7, HOLDOUT_STREAM, split, k])
            mask = np.zeros(len(x), bool)
            mask[rng.choice(len(x), size=int(want[k]), replace=False)] = True
            np.testing.assert_array_equal(held.client(k)[0], x[mask])     # order kept
            np.testing.assert_array_equal(kept.client(k)[0], x[~mask])
    assert data.test is tiny_synthetic.test          # the papers' test metrics: every example
    assert hold_out(tiny_synthetic, 0.0, seed=7) is tiny_synthetic
    # round half to even: 1.5 -> 2, 2.5 -> 2; at least one, at most n - 1
    np.testing.assert_array_equal(held_counts([2, 3, 5, 10, 100], 0.5), [1, 2, 2, 5, 50])


def numpy_adapted(W, b, ax, ay, hx, hy, steps, seed, round_idx, population, client, lam=0.0,
                  anchor=None):
    """k SGD steps (w <- w - lr (grad + l2 w [+ lam (w - anchor)])) on the client's adaptation
    examples in the documented order, then (mean loss, error) on its held-out examples."""
    if steps:
        rng = np.random.default_rng([seed, round_idx, PERSONAL_STREAM, population, client])
        a = len(ay)
        order = np.concatenate([rng.permutation(a) for _ in range(-(-(steps * B) // a))])
        for s in range(steps):
            idx = order[s * B:(s + 1) * B]
            gW, gb = grad_mean_xent(W, b, ax[idx], ay[idx])
            if anchor is not None:
                gW, gb = gW + lam * (W - anchor[0]), gb + lam * (b - anchor[1])
            W, b = W - LR * (gW + L2 * W), b - LR * (gb + L2 * b)
    loss = softmax_xent(W, b, hx, hy).mean()
    err = (np.argmax(scores(W, b, hx), axis=1) != hy).mean()
    return loss, err


@pytest.fixture(scope="module")
def fedavg_run(tiny_synthetic):
    cfg = tiny_config(algorithm="fedavg", thetas=(), seeds=(3,), l2_reg=L2, num_rounds=2,
                      clients_per_step=3, client_holdout=0.3, finetune_steps=(0, 5))
    exp = build_experiment(cfg, tiny_synthetic)
    state = run_rounds_history(exp, 2)[0]
    return exp, state, exp.evaluate_personal(state, 2)


def test_unseen_devices_after_fine_tuning_match_numpy(fedavg_run):
    exp, state, pc = fedavg_run
    ho = exp.data.holdout
    W, b = linear_rows(exp.served_params(state), 0)
    axs, ays = client_lists(ho.test_adapt)
    hxs, hys = client_lists(ho.test_held)
    for steps, name in ((0, "unseen"), (5, "unseen_ft5")):
        for j in range(len(hys)):
            loss, err = numpy_adapted(W, b, axs[j], ays[j], hxs[j], hys[j], steps, 3, 2, 1, j)
            np.testing.assert_allclose(pc[f"{name}_loss"][0, j], loss, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(pc[f"{name}_error"][0, j], err, atol=1e-6)
    assert np.mean(pc["unseen_ft5_loss"]) < np.mean(pc["unseen_loss"])   # adaptation helps


def test_seen_clients_are_served_their_personal_models(tiny_synthetic):
    """Ditto: a seen client starts from its own v_k and adapts by proximal steps towards w;
    an unseen device starts from w."""
    lam = 0.5
    cfg = tiny_config(algorithm="ditto", thetas=(), seeds=(1,), l2_reg=L2, num_rounds=2,
                      clients_per_step=2, client_holdout=0.3, finetune_steps=(3,),
                      ditto_lambda=(lam,))
    exp = build_experiment(cfg, tiny_synthetic)
    state = run_rounds_history(exp, 2)[0]
    pc = exp.evaluate_personal(state, 2)
    ho = exp.data.holdout
    W, b = linear_rows(exp.served_params(state), 0)
    personal = jax.device_get(state.client_state.personal)["Dense_0"]
    axs, ays = client_lists(exp.data.train)
    hxs, hys = client_lists(ho.train_held)
    moved = 0.0
    for k in range(len(hys)):
        vW = np.asarray(personal["kernel"][0, k], np.float64)
        vb = np.asarray(personal["bias"][0, k], np.float64)
        moved = max(moved, float(np.abs(vW - W).max()))
        loss, err = numpy_adapted(vW, vb, axs[k], ays[k], hxs[k], hys[k], 3, 1, 2, 0, k,
                                  lam=lam, anchor=(W, b))
        np.testing.assert_allclose(pc["seen_ft3_loss"][0, k], loss, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pc["seen_ft3_error"][0, k], err, atol=1e-6)
    assert moved > 1e-3
    uxs, uys = client_lists(ho.test_adapt)
    vxs, vys = client_lists(ho.test_held)
    loss, err = numpy_adapted(W, b, uxs[0], uys[0], vxs[0], vys[0], 3, 1, 2, 1, 0, lam=lam,
                              anchor=(W, b))
    np.testing.assert_allclose(pc["unseen_ft3_loss"][0, 0], loss, rtol=1e-5, atol=1e-6)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_a_sampled_evaluation_gives_the_same_clients_values(tiny_synthetic, fedavg_run):
    exp, state, full = fedavg_run
    cfg = tiny_config(algorithm="fedavg", thetas=(), seeds=(3,), l2_reg=L2, num_rounds=2,
                      clients_per_step=3, client_holdout=0.3, finetune_steps=(0, 5),
                      eval_clients=5)
    sampled_exp = build_experiment(cfg, tiny_synthetic)
    pc = sampled_exp.evaluate_personal(state, 2)
    for population in ("seen", "unseen"):
        ids = pc[f"{population}_clients"]
        assert len(ids) == 5 and len(set(ids.tolist())) == 5
        for fam in (population, f"{population}_ft5"):
            np.testing.assert_array_equal(pc[f"{fam}_error"], full[f"{fam}_error"][:, ids])
    summary = sampled_exp.summarize({**sampled_exp.evaluate(exp.served_params(state), 2),
                                     **pc})
    assert summary["unseen_error_p90_lo"][0] <= summary["unseen_error_p90"][0] \
        <= summary["unseen_error_p90_hi"][0]
    np.testing.assert_allclose(summary["participation_gap_ft5"],
                               summary["unseen_ft5_error_mean"] - summary["seen_ft5_error_mean"])


def test_summaries_and_the_worst_ten_percent(fedavg_run):
    exp, state, pc = fedavg_run
    summary = exp.summarize({**exp.evaluate(exp.served_params(state), 2), **pc})
    e = pc["unseen_ft5_error"][0]
    np.testing.assert_allclose(summary["unseen_ft5_error_mean"][0], e.mean())
    srt = np.sort(e)[::-1]
    mass = 0.1 * len(e)                       # 1.2 clients of 12: the worst one and 0.2 more
    want = (srt[:math.floor(mass)].sum() + (mass - math.floor(mass)) * srt[math.floor(mass)])
    np.testing.assert_allclose(summary["unseen_ft5_error_worst10"][0], want / mass)
    np.testing.assert_allclose(summary["participation_gap"],
                               summary["unseen_error_mean"] - summary["seen_error_mean"])
    # By hand: 10 clients, the worst 10% is the largest value alone; 15 clients, 1.5 of them.
    np.testing.assert_allclose(worst_mean(np.arange(10.0)[None]), [9.0])
    np.testing.assert_allclose(worst_mean(np.arange(15.0)[None]), [(14 + 0.5 * 13) / 1.5])


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_training_clients_are_served_their_personal_models(tmp_path, capsys):
    out = tmp_path / "ditto"
    code, err, _ = run_runner(["--dataset=synthetic", "--synthetic_num_clients=12",
                               "--synthetic_max_examples=50", "--algorithm=ditto",
                               "--ditto_lambda=1", "--num_rounds=2", "--clients_per_round=3",
                               "--client_holdout=0.2", "--eval_every=2",
                               f"--output_dir={out}"], capsys)
    assert code in (0, None), err
    served = load_model(str(out), seed=1, ditto_lambda=1.0)
    one = served.for_client(4)
    assert served.personal is not None and "personal models" in repr(served)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(served.personal)):
        np.testing.assert_array_equal(a, b[4])
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(one.params),
                                                       jax.tree.leaves(served.params)))
    with pytest.raises(ValueError, match="not in 0..5"):
        served.for_client(6)
    # The report recomputes the personalised tables from clients.npz: they equal the run's own
    # final metrics (metrics.jsonl's last records).
    from deltafl_jax.report import load, write_report
    import json
    runs, _ = load([str(out)])
    report = write_report(runs, str(tmp_path / "report"))
    text = open(report["report"]).read()
    last = [json.loads(line) for line in open(out / "metrics.jsonl")][-1]
    for metric, title in (("seen_error_p90", "90th percentile of the held-out error (in %) of "
                           "seen"), ("unseen_error_worst10", "worst-10% mean of the held-out "
                                     "error (in %) of unseen")):
        section = text.split(title)[1].split("##")[0]
        assert f"{100 * last[metric]:.2f} ± 0.00" in section, (metric, section)
    code, err, _ = run_runner(["--dataset=synthetic", "--synthetic_num_clients=12",
                               "--algorithm=fedavg", "--num_rounds=1", "--clients_per_round=3",
                               f"--output_dir={tmp_path / 'fedavg'}"], capsys)
    assert code in (0, None), err
    glob = load_model(str(tmp_path / "fedavg"), seed=1)
    assert glob.personal is None and glob.for_client(3) is glob


@pytest.mark.parametrize("flags,says", [
    (["--finetune_steps=3"], "needs --client_holdout"),
    (["--client_holdout=1.0"], "--client_holdout must be"),
    (["--client_holdout=0.2", "--finetune_steps=-1"], "--finetune_steps must"),
    (["--client_holdout=0.2", "--finetune_lr=0"], "--finetune_lr must"),
    (["--client_holdout=0.2", "--synthetic_num_clients=200000"], "generated on demand"),
])
def test_bad_personal_flags_are_one_line(tmp_path, capsys, flags, says):
    out = tmp_path / "x"
    code, err, _ = run_runner(["--dataset=synthetic", "--algorithm=fedavg", "--num_rounds=1",
                               f"--output_dir={out}", *flags], capsys)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
