"""SCAFFOLD (option II) against a NumPy loop written from Algorithm 1 of Karimireddy et al.
(:class:`Scaffold` below, float64, sharing with the engine only the random draws of
deltafl_jax.sampling.plan): partial participation, several local steps, 3 rounds; the clients' control
variates written back, on both lane layouts; its first round is FedAvg's."""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import run_rounds_history, run_runner, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.sampling.plan import client_permutations, sample_clients
from numpy_reference import grad_mean_xent

ROUNDS, M, EPOCHS = 3, 6, 2


class Scaffold:
    """Algorithm 1 of the SCAFFOLD paper with option II, for one replica.

    weighting "unweighted" is the paper as written: Delta x = mean over S of Delta y_i and
    c <- c + (|S|/N) mean over S of Delta c_i. "weighted": Delta x weighted by n_i and
    c <- c + sum_{i in S} (n_i / n) Delta c_i (c stays the n-weighted mean of the c_i).
    """

    def __init__(self, xs, ys, weighting, shape_W, shape_b):
        self.xs, self.ys, self.weighting = xs, ys, weighting
        self.N = len(xs)
        self.n = np.array([len(y) for y in ys], np.float64)
        self.c = [np.zeros(shape_W), np.zeros(shape_b)]
        self.ci = [[np.zeros(shape_W), np.zeros(shape_b)] for _ in range(self.N)]

    def local(self, x0, k, seed, t, lr, l2, batch, epochs):
        """y_i <- y_i - lr (g_i(y_i) - c_i + c) [- lr l2 y_i], K steps; returns (y, K)."""
        x, y = self.xs[k], self.ys[k]
        order = client_permutations(seed, t, int(k), len(y), epochs)
        W, b = x0
        K = 0
        nk = len(y)
        for e in range(epochs):
            for s in range(0, nk, batch):
                idx = order[e * nk:(e + 1) * nk][s:s + batch]
                gW, gb = grad_mean_xent(W, b, x[idx], y[idx])
                W = W - lr * (gW + l2 * W - self.ci[k][0] + self.c[0])
                b = b - lr * (gb + l2 * b - self.ci[k][1] + self.c[1])
                K += 1
        return [W, b], K

    def round(self, params, seed, t, m, lr, l2, batch, epochs, eta_g):
        chosen = sample_clients(seed, t, self.N, m)
        dys, dcs, new_ci = [], [], {}
        for k in chosen:
            y, K = self.local(params, k, seed, t, lr, l2, batch, epochs)
            cplus = [ci - c + (x - yi) / (K * lr)
                     for ci, c, x, yi in zip(self.ci[k], self.c, params, y)]
            dys.append([yi - x for yi, x in zip(y, params)])
            dcs.append([cp - ci for cp, ci in zip(cplus, self.ci[k])])
            new_ci[int(k)] = cplus
        a = self.n[chosen] if self.weighting == "weighted" else np.ones(len(chosen))
        dx = [sum(ak * d[j] for ak, d in zip(a, dys)) / a.sum() for j in range(2)]
        if self.weighting == "weighted":
            alpha = self.n[chosen] / self.n.sum()
            dc = [sum(al * d[j] for al, d in zip(alpha, dcs)) for j in range(2)]
        else:   # (|S| / N) * mean over S, as Algorithm 1 writes it
            dc = [len(chosen) / self.N * (sum(d[j] for d in dcs) / len(chosen))
                  for j in range(2)]
        params = [x + eta_g * d for x, d in zip(params, dx)]
        self.c = [c + d for c, d in zip(self.c, dc)]
        for k, cplus in new_ci.items():
            self.ci[k] = cplus
        return params


def rows(tree, *index):
    """[W, b] of a {'Dense_0': {'kernel', 'bias'}} tree at `index` (replica, client)."""
    p = jax.device_get(tree)["Dense_0"]
    return [np.asarray(p["kernel"][index], np.float64), np.asarray(p["bias"][index], np.float64)]


@pytest.mark.parametrize("weighting,etas,lanes", [("weighted", (1.0, 0.7), 3),
                                                 ("unweighted", (1.0,), 1)])
def test_three_rounds_equal_algorithm_1(tiny_synthetic, weighting, etas, lanes):
    """Both weightings, eta_g = 1 and 0.7 (a --server_lr sweep), on vmapped lanes and on one
    unbatched lane (the context and the per-job results through both lane layouts)."""
    cfg = tiny_config(algorithm="scaffold", thetas=(), seeds=(1, 2), l2_reg=1e-3,
                      clients_per_round=M, local_epochs=EPOCHS, batch_size=8,
                      clients_per_step=lanes, weighting=weighting, server_lr=etas)
    exp = build_experiment(cfg, tiny_synthetic)
    state = run_rounds_history(exp, ROUNDS)[0]
    train = tiny_synthetic.train
    xs = [train.client(k)[0].astype(np.float64) for k in range(train.num_clients)]
    ys = [train.client(k)[1] for k in range(train.num_clients)]
    W0 = np.zeros((xs[0].shape[1], tiny_synthetic.num_classes))
    assert M < train.num_clients                            # partial participation
    for r, lab in enumerate(exp.replicas.labels):
        eta = dict(lab.extra).get("server_lr", 1.0)
        ref = Scaffold(xs, ys, weighting, W0.shape, W0.shape[1:])
        params = [W0, np.zeros(W0.shape[1])]
        for t in range(ROUNDS):
            params = ref.round(params, lab.seed, t, M, cfg.learning_rate, cfg.l2_reg,
                               cfg.batch_size, EPOCHS, eta)
        for got, want in zip(rows(state.params, r), params):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        for got, want in zip(rows(state.algo_state.c, r), ref.c):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        for k in range(train.num_clients):
            for got, want in zip(rows(state.client_state, r, k), ref.ci[k]):
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        assert np.max(np.abs(ref.c[0])) > 1e-3              # the control variates moved


def test_first_round_is_fedavg(tiny_synthetic):
    """With c = c_k = 0 the corrected step adds exact zeros: FedAvg's round, bit for bit."""
    kw = dict(thetas=(), seeds=(1, 2), l2_reg=1e-3, local_epochs=EPOCHS, clients_per_step=3)
    fedavg, scaffold = (run_rounds_history(build_experiment(tiny_config(algorithm=a, **kw),
                                                            tiny_synthetic), 1)[0]
                        for a in ("fedavg", "scaffold"))
    for a, b in zip(jax.tree.leaves(fedavg.params), jax.tree.leaves(scaffold.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_scaffold_refuses_a_theta_other_than_one(tmp_path, capsys):
    code, err, _ = run_runner(["--dataset=synthetic", "--algorithm=scaffold", "--thetas=0.5",
                               f"--output_dir={tmp_path / 'o'}"], capsys)
    assert code == 2 and "--algorithm=scaffold" in err and len(err.strip().splitlines()) == 1


class _Device:
    """A device whose memory_stats() reports `limit` bytes (as GPUs and TPUs do)."""

    process_index = 0
    device_kind = "fake accelerator"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_start_up_counts_the_per_client_state_and_refuses_a_run_that_cannot_fit(
        tiny_synthetic):
    from deltafl_jax.errors import ConfigError
    from deltafl_jax.run.placement import check_memory
    cfg = tiny_config(algorithm="scaffold", thetas=(), seeds=(1, 2), server_optimizer="adam",
                      server_lr=(0.1,))
    exp = build_experiment(cfg, tiny_synthetic)
    fp = exp.program.footprint
    w = 60 * 10 + 10                                       # floats of one linear model
    R, N, m = 2, tiny_synthetic.train.num_clients, cfg.clients_per_round
    assert fp.clients == 4 * w * (R * N + 2 * R * m)       # c_k of N clients, per-job results
    # models, SCAFFOLD's c, Adam's m and v; Adam's count and learning rate, the active flags
    # and the round counter
    assert fp.state == 4 * R * w * 4 + 8 * R + R + 4
    assert f"per-client state {fp.clients / 2 ** 20:.1f} MB ({N} clients x {R} replicas, and" \
        in exp.view().facts.placement_line
    check_memory(fp, [_Device(2 * fp.total)])                  # fits: no error
    with pytest.raises(ConfigError, match="per-client state") as e:
        check_memory(dataclasses.replace(fp, clients=10 * fp.total), [_Device(2 * fp.total)])
    assert "\n" not in str(e.value) and "fake accelerator" in str(e.value)


class _HostDevice(_Device):
    """A device that reports no memory (XLA:CPU's host devices)."""

    device_kind = "cpu"

    def memory_stats(self):
        return None


def test_on_a_cpu_the_devices_and_the_host_built_state_must_fit_this_machine(monkeypatch):
    """XLA:CPU reports no device memory: the run is refused in one line, before anything is
    built, when its host devices' footprints plus the per-client state (built on the host
    first) pass 80% of this machine's memory, and named by its largest part."""
    from deltafl_jax.errors import ConfigError
    from deltafl_jax.run import placement
    from deltafl_jax.run.placement import Footprint, check_memory
    monkeypatch.setattr(placement, "host_memory", lambda: 1000)
    two = [_HostDevice(0), _HostDevice(0)]
    fits = Footprint(data=100, state=50, plan=10, lanes=10, clients=100, updates=10)
    check_memory(fits, two)                                    # 2 x 280 + 100 = 660 <= 800
    big = dataclasses.replace(fits, clients=200)               # 2 x 380 + 200 = 960 > 800
    with pytest.raises(ConfigError, match="per-client state") as e:
        check_memory(big, two)
    assert "\n" not in str(e.value) and "2 host device(s)" in str(e.value)
    check_memory(big, two[:1])                                 # 380 + 200 = 580 on one device
