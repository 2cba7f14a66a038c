"""FedNova against NumPy written from the authors' code (JYWa/FedNova at 47b4e09,
``distoptim/FedNova.py``: the optimizer's ``step`` counts the local normalising vector a_k and
accumulates cum_grad = w_t - w_k; ``average`` takes tau_eff = sum_k p_k a_k and
w <- w_t - sum_k p_k (tau_eff / a_k) cum_grad_k, or steps a global momentum buffer ``gmf``).

:class:`AuthorsClient` and :func:`authors_average` follow that code line by line in float64;
they share nothing with the module but the random draws of deltafl_jax.sampling.plan (who is sampled,
the minibatch order)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import linear_rows, run_rounds_history, run_runner, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.algorithms import ClientFeedback, registry
from deltafl_jax.algorithms.deltafl import DeltaFLHyper
from deltafl_jax.algorithms.fednova import FedNovaOptions, NovaOutput, fednova
from deltafl_jax.algorithms.protocol import RoundContext
from deltafl_jax.engine import ClientJob
from deltafl_jax.optimizers.client import ClientOptimizer
from deltafl_jax.sampling.plan import client_permutations
from deltafl_jax.sampling.samplers import sample_clients
from numpy_reference import grad_mean_xent

HYPER = DeltaFLHyper(theta=np.float32(1.0))


class AuthorsClient:
    """One worker's FedNova optimizer of the authors' code, for one round (float64): SGD with
    momentum `momentum` (0: none, no dampening, no Nesterov) and weight decay `wd`."""

    def __init__(self, params, lr, momentum=0.0, wd=0.0):
        self.p = {k: np.array(v, np.float64) for k, v in params.items()}
        self.lr, self.momentum, self.wd = lr, momentum, wd
        self.buf, self.cum_grad = {}, {}
        self.local_counter, self.local_normalizing_vec, self.local_steps = 0.0, 0.0, 0

    def step(self, grads):
        for k, g in grads.items():
            d_p = np.asarray(g, np.float64) + self.wd * self.p[k]
            if self.momentum != 0:
                if k not in self.buf:
                    self.buf[k] = d_p.copy()
                else:
                    self.buf[k] = self.momentum * self.buf[k] + d_p
                d_p = self.buf[k]
            self.cum_grad[k] = self.cum_grad.get(k, 0.0) + self.lr * d_p
            self.p[k] = self.p[k] - self.lr * d_p
        if self.momentum != 0:
            self.local_counter = self.local_counter * self.momentum + 1
            self.local_normalizing_vec += self.local_counter
        else:
            self.local_normalizing_vec += 1
        self.local_steps += 1


def authors_average(old, workers, ratios):
    """``FedNova.average`` over the workers (all-reduce = sum): tau_eff = sum ratio_k a_k,
    w <- old - sum_k ratio_k (tau_eff / a_k) cum_grad_k."""
    tau_eff = sum(r * w.local_normalizing_vec for r, w in zip(ratios, workers))
    total = {k: sum(r * (tau_eff / w.local_normalizing_vec) * w.cum_grad[k]
                    for r, w in zip(ratios, workers)) for k in old}
    return {k: np.asarray(old[k], np.float64) - total[k] for k in old}, tau_eff


# ---------------------------------------------------------------- the pure functions


PARAMS = {"w": np.array([[1.0, -2.0], [0.5, 3.0]], np.float32),
          "b": np.array([0.25, -1.0], np.float32)}


def quadratic_grad(k):
    """Client k's gradient of sum_leaf (c_k / 2)||w - target_k||^2: c_k (w - target_k)."""
    c = 0.5 + 0.3 * k

    def grad(p, xp):
        return {n: c * (p[n] - xp.full(p[n].shape, 0.4 * k - 1.0, p[n].dtype)
                        - (0.1 * k if n == "w" else -0.2)) for n in p}
    return grad


def run_client(update, k, steps, lr, optimizer, l2):
    """The module's client update for `steps` local steps on client k's quadratic."""
    opt = ClientOptimizer(name=optimizer, momentum=0.6).transformation(lr, l2)
    job = ClientJob(optimizer=opt, learning_rate=np.float32(lr), l2=np.float32(l2),
                    steps=np.int32(steps))
    params = jax.tree.map(jnp.asarray, PARAMS)
    grad = quadratic_grad(k)
    state = update.init((), (), params, HYPER, job)
    for _ in range(steps):
        state = update.step(state, lambda p: (0.0, grad(p, jnp)), HYPER, job)
    return update.final(state, (), params, HYPER, job)


def reference_client(k, steps, lr, momentum, l2):
    worker = AuthorsClient(PARAMS, lr, momentum, l2)
    grad = quadratic_grad(k)
    for _ in range(steps):
        worker.step(grad(worker.p, np))
    return worker


@pytest.mark.parametrize("optimizer,momentum", [("sgd", 0.0), ("momentum", 0.6)])
def test_client_and_server_update_equal_the_authors_code(optimizer, momentum):
    """Four clients of sizes n_k and local epochs e_k (tau_k = e_k ceil(n_k / B), B = 10:
    unequal) through the client update's init/step/final and the server update, against the
    authors' step and average; a fifth client whose update is not finite changes nothing."""
    sizes = np.array([10, 35, 20, 48], np.int32)
    epochs = np.array([2, 1, 3, 1])
    taus = epochs * -(-sizes // 10)                              # [2, 4, 6, 5]
    lr, l2 = 0.1, 0.01
    algo = fednova(momentum, FedNovaOptions())
    outs = [run_client(algo.client_update, k, int(t), lr, optimizer, l2)
            for k, t in enumerate(taus)]
    workers = [reference_client(k, int(t), lr, momentum, l2) for k, t in enumerate(taus)]
    for (_, _, out), w, t in zip(outs, workers, taus):
        assert int(out.steps) == t == w.local_steps
        np.testing.assert_allclose(float(out.norm), w.local_normalizing_vec, rtol=1e-6)
    # a fifth client: sampled, trained, update not finite
    sizes5 = np.append(sizes, 30).astype(np.int32)
    weights = np.asarray(algo.client_weights(RoundContext((), None, jnp.asarray(sizes5), HYPER,
                                                          None, None)))
    np.testing.assert_allclose(weights, sizes5 / sizes5.sum(), rtol=1e-6)
    finite = np.array([True] * 4 + [False])
    updates = [u for _, u, _ in outs]
    delta_sum = {n: sum(weights[k] * np.asarray(updates[k][n], np.float64) for k in range(4))
                 .astype(np.float32) for n in PARAMS}
    fb = ClientFeedback(
        losses=np.full(5, np.nan, np.float32), sizes=sizes5, weights=weights.astype(np.float32),
        delta_sum=delta_sum, weight_sum=np.float32(weights[:4].sum()),
        job_sqnorm=np.zeros(5, np.float32), job_finite=finite, job_trained=np.ones(5, bool),
        learning_rate=np.float32(lr), clients=np.arange(5, dtype=np.int32),
        client_outputs=NovaOutput(
            steps=np.append([int(o.steps) for _, _, o in outs], 9).astype(np.int32),
            norm=np.append([float(o.norm) for _, _, o in outs], 7.0).astype(np.float32)))
    delta, _, metrics = algo.server_update((), PARAMS, fb, HYPER)
    want, tau_eff = authors_average(PARAMS, workers, sizes / sizes.sum())
    for n in PARAMS:
        np.testing.assert_allclose(PARAMS[n] + np.asarray(delta[n]), want[n], rtol=1e-5,
                                   atol=1e-6)
    np.testing.assert_allclose(float(metrics["tau_eff"]), tau_eff, rtol=1e-6)
    assert float(metrics["local_steps_mean"]) == taus.mean()
    if optimizer == "sgd":
        assert tau_eff == pytest.approx(float(np.sum(sizes * taus) / sizes.sum()))


def test_equal_steps_give_fedavg_closed_form():
    """Every tau_k equal: a_k = tau for all k, tau_eff = tau and Delta = sum_k p_k (w_k - w_t)
    / sum_k p_k (FedAvg's average)."""
    lr, tau = 0.1, 4
    algo = fednova(0.0, FedNovaOptions(weighting="unweighted"))
    outs = [run_client(algo.client_update, k, tau, lr, "sgd", 0.0) for k in range(3)]
    workers = [reference_client(k, tau, lr, 0.0, 0.0) for k in range(3)]
    weights = np.full(3, 1 / 3, np.float32)
    fb = ClientFeedback(
        losses=np.full(3, np.nan, np.float32), sizes=np.array([5, 9, 14], np.int32),
        weights=weights, delta_sum={n: sum(weights[k] * np.asarray(outs[k][1][n])
                                           for k in range(3)) for n in PARAMS},
        weight_sum=np.float32(weights.sum()), job_sqnorm=np.zeros(3, np.float32),
        job_finite=np.ones(3, bool), job_trained=np.ones(3, bool),
        learning_rate=np.float32(lr), clients=np.arange(3, dtype=np.int32),
        client_outputs=NovaOutput(steps=np.full(3, tau, np.int32),
                                        norm=np.array([o.norm for _, _, o in outs])))
    delta, _, metrics = algo.server_update((), PARAMS, fb, HYPER)
    assert float(metrics["tau_eff"]) == tau
    for n in PARAMS:
        fedavg = np.mean([w.p[n] - PARAMS[n] for w in workers], axis=0)
        np.testing.assert_allclose(np.asarray(delta[n]), fedavg, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- rounds end to end

ROUNDS, M, EPOCHS = 3, 6, 2


def fedavg_average(old, workers, ratios):
    """FedAvg's step: the ratio-weighted mean of the local models (and a nominal tau_eff)."""
    return {k: sum(r * w.p[k] for r, w in zip(ratios, workers)) for k in old}, 0.0


def reference_rounds(data, seed, lr, l2, batch, momentum, gmf, rounds, local_steps=None,
                     average=authors_average, kept=None):
    """`rounds` rounds of sampled FedNova on the softmax regression of the engine's linear
    model: the authors' local optimizer on each sampled client's minibatches (the engine's
    order), its average with p_k = n_k / sum_S n, and its global momentum buffer when gmf > 0
    (buf = cum / lr, then gmf buf + cum / lr; w <- w - lr buf). `kept(t)`: (the clients a
    round's deadline kept, the local steps each completed) in place of the sampled cohort's
    planned epochs; p_k is then renormalised over the kept clients."""
    train = data.train
    xs = [train.client(k)[0].astype(np.float64) for k in range(train.num_clients)]
    ys = [train.client(k)[1] for k in range(train.num_clients)]
    d, c = xs[0].shape[1], data.num_classes
    params, buf = {"W": np.zeros((d, c)), "b": np.zeros(c)}, None
    for t in range(rounds):
        chosen, done = (sample_clients(seed, t, train.num_clients, M), None) if kept is None \
            else kept(t)
        workers, n = [], []
        for i, k in enumerate(chosen):
            x, y = xs[k], ys[k]
            nk, nb = len(y), -(-len(y) // batch)
            planned = local_steps if local_steps is not None else EPOCHS * nb
            steps = planned if done is None else int(done[i])
            order = client_permutations(seed, t, int(k), nk, -(-planned // nb))
            w = AuthorsClient(params, lr, momentum, l2)
            for s in range(steps):
                e, b = divmod(s, nb)
                idx = order[e * nk:(e + 1) * nk][b * batch:(b + 1) * batch]
                gW, gb = grad_mean_xent(w.p["W"], w.p["b"], x[idx], y[idx])
                w.step({"W": gW, "b": gb})
            workers.append(w)
            n.append(nk)
        ratios = np.asarray(n, np.float64) / np.sum(n)
        new, tau_eff = average(params, workers, ratios)
        if gmf:
            cum = {k: params[k] - new[k] for k in params}
            buf = ({k: cum[k] / lr for k in cum} if buf is None
                   else {k: gmf * buf[k] + cum[k] / lr for k in cum})
            new = {k: params[k] - lr * buf[k] for k in params}
        params = new
    return params, tau_eff, [w.local_steps for w in workers]


@pytest.mark.parametrize("optimizer,gmf,lanes", [("sgd", 0.0, 3), ("momentum", 0.5, 1)])
def test_rounds_equal_the_authors_code(tiny_synthetic, optimizer, gmf, lanes):
    """3 rounds, 6 of 12 clients of 50..80 examples, 2 local epochs at B = 8 (7..10 batches
    an epoch: unequal tau_k), two seeds; plain SGD, and client momentum with the code's global
    momentum (--server_optimizer=momentum at --server_lr=1), within 1e-5."""
    server = (dict(server_optimizer="momentum", server_momentum=gmf, server_lr=(1.0,))
              if gmf else {})
    cfg = tiny_config(algorithm="fednova", thetas=(), seeds=(1, 2), l2_reg=1e-3,
                      clients_per_round=M, local_epochs=EPOCHS, batch_size=8,
                      clients_per_step=lanes, client_optimizer=optimizer,
                      client_momentum=0.5, **server)
    exp = build_experiment(cfg, tiny_synthetic)
    state, hist = run_rounds_history(exp, ROUNDS)
    momentum = 0.5 if optimizer == "momentum" else 0.0
    for r, lab in enumerate(exp.replicas.labels):
        want, tau_eff, steps = reference_rounds(tiny_synthetic, lab.seed, cfg.learning_rate,
                                                cfg.l2_reg, cfg.batch_size, momentum, gmf,
                                                ROUNDS)
        assert len(set(steps)) > 1                                      # unequal tau_k
        W, b = linear_rows(state.params, r)
        np.testing.assert_allclose(W, want["W"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b, want["b"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(hist[-1]["tau_eff"])[r], tau_eff, rtol=1e-5)


def test_equal_local_steps_run_is_fedavg(tiny_synthetic):
    """With --local_steps every tau_k is equal, and FedNova's rounds are FedAvg's: the
    n_k-weighted mean of the local SGD models (NumPy), to float32 rounding."""
    cfg = tiny_config(algorithm="fednova", thetas=(), seeds=(1,), clients_per_round=M,
                      local_steps=5, batch_size=8)
    state = run_rounds_history(build_experiment(cfg, tiny_synthetic), 2)[0]
    fedavg = reference_rounds(tiny_synthetic, 1, cfg.learning_rate, 0.0, 8, 0.0, 0.0, 2,
                              local_steps=5, average=fedavg_average)[0]
    for got, want in zip(linear_rows(state.params, 0), (fedavg["W"], fedavg["b"])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("partial", [False, True], ids=["dropped", "cut_short"])
def test_a_deadline_that_drops_clients_renormalises_over_the_kept(tiny_synthetic, partial):
    """A round deadline (lognormal speeds) that drops some of the 6 sampled clients, or with
    --partial_work cuts their local epochs short: FedNova averages the kept clients'
    normalised updates, each by its own completed steps tau_k (a_k = tau_k), with
    p_k = n_k / sum n over the kept clients alone and tau_eff = sum_kept p_k a_k: the
    authors' step and average (NumPy) on the clients and steps the clock kept, within 1e-5."""
    base = dict(algorithm="fednova", thetas=(), seeds=(1, 2), l2_reg=1e-3,
                clients_per_round=M, local_epochs=EPOCHS, batch_size=8, clients_per_step=3,
                client_speed="lognormal")
    probe = build_experiment(tiny_config(**base), tiny_synthetic)
    sizes, speeds = tiny_synthetic.train.sizes, probe.clock.speeds
    ids = np.arange(sizes.size)
    full = speeds.per_example_s(ids) * EPOCHS * sizes + 2 * 4 * 61 * 10 / \
        speeds.bandwidth_Bps(ids)   # the linear model's W [60, 10] and b [10] in float32
    cfg = tiny_config(**base, round_deadline=float(np.quantile(full, 0.35 if partial else 0.6)),
                      partial_work=partial)
    exp = build_experiment(cfg, tiny_synthetic)
    clock = build_experiment(cfg, tiny_synthetic)   # the same clock, read for the reference
    kept = []
    for t in range(ROUNDS):
        cohorts, steps = clock.kept_cohorts(t)
        clock.count_round(t)
        kept.append([(c.clients[:c.present.sum()], s[:c.present.sum()])
                     for c, s in zip(cohorts, steps)])
    planned = [EPOCHS * -(-sizes[c] // 8) for round_kept in kept for c, _ in round_kept]
    done = [s for round_kept in kept for _, s in round_kept]
    if partial:
        assert any(np.any(s < p) for s, p in zip(done, planned))   # epochs cut short
    else:
        assert min(s.size for s in done) < M                        # clients dropped
        assert all(np.all(s == p) for s, p in zip(done, planned))
    state, hist = run_rounds_history(exp, ROUNDS)
    for r, lab in enumerate(exp.replicas.labels):
        g = (1, 2).index(lab.seed)
        want, tau_eff, _ = reference_rounds(tiny_synthetic, lab.seed, cfg.learning_rate,
                                            cfg.l2_reg, 8, 0.0, 0.0, ROUNDS,
                                            kept=lambda t: kept[t][g])
        W, b = linear_rows(state.params, r)
        np.testing.assert_allclose(W, want["W"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b, want["b"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(hist[-1]["tau_eff"])[r], tau_eff, rtol=1e-5)


# ---------------------------------------------------------------- flags and the spec


@pytest.mark.parametrize("flags,says", [
    (["--thetas=0.5"], "--algorithm=fednova trains every sampled client"),
    (["--client_optimizer=adam"], "--client_optimizer=adam"),
    (["--client_optimizer=adagrad"], "--client_optimizer=adagrad"),
    (["--dp_clip=1.0", "--weighting=unweighted"], "--algorithm=fednova has no private version"),
])
def test_refused_in_one_line(tmp_path, capsys, flags, says):
    out = tmp_path / "o"
    code, err, _ = run_runner(["--dataset=synthetic", "--algorithm=fednova",
                               f"--output_dir={out}"] + flags, capsys)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_spec():
    spec = registry.get("fednova")
    assert spec.display_name == "FedNova" and "fednova" in registry.names()
    assert spec.option_flags() == ("weighting",) and not spec.own_server_step
    cfg = tiny_config(algorithm="fednova", thetas=(), client_optimizer="momentum",
                      client_momentum=0.7)
    assert spec.sweep_values(cfg) == (1.0,)
    algo = spec.make(cfg, None)
    assert algo.private is None and not algo.uses_losses    # --dp_clip is refused
    # the factory reads the client momentum: a_k of 2 steps is 1 + (1 + 0.7)
    job = ClientJob(optimizer=ClientOptimizer("momentum", 0.7).transformation(0.1, 0.0),
                    learning_rate=np.float32(0.1), l2=np.float32(0.0), steps=np.int32(2))
    params = jax.tree.map(jnp.asarray, PARAMS)
    state = algo.client_update.init((), (), params, HYPER, job)
    for _ in range(2):
        state = algo.client_update.step(
            state, lambda p: (0.0, jax.tree.map(jnp.ones_like, p)), HYPER, job)
    assert float(algo.client_update.final(state, (), params, HYPER, job)[2].norm) == \
        pytest.approx(2.7)
