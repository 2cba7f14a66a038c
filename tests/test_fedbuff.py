"""FedBuff's server step (deltafl_jax/algorithms/buffered/fedbuff.py) driven by the asynchronous
scheduler, against a NumPy event simulation written from the paper (Nguyen et al. 2022,
Algorithm 1): every client always online, C = N, fixed per-client speeds read from a file,
K = 3, staleness weights 1/sqrt(1 + tau), several server steps."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from numpy_reference import client_loss, exact_weights, grad_mean_xent
from deltafl_jax.algorithms.buffered import fedbuff
from deltafl_jax.algorithms.buffered.fedasync import build_fedasync_step
from deltafl_jax.asynchronous.step import (build_buffered_step, current_params,
                                           init_buffered_state, step_inputs)
from deltafl_jax.data import ClientData, FederatedDataset
from deltafl_jax.engine import LocalSGDConfig
from deltafl_jax.models import build_model
from deltafl_jax.replicas.labels import Replicas
from deltafl_jax.sampling import plan as plan_lib
from deltafl_jax.sampling import Cohort
from deltafl_jax.asynchronous.scheduler import AsyncScheduler, ServerStep
from deltafl_jax.sampling.plan import RoundData

SIZES = (6, 9, 12, 7, 10, 8)
FEATURES, CLASSES, K, EPOCHS, BATCH, STEPS = 4, 3, 3, 2, 16, 7
LRS = (0.3, 0.1)      # two replicas of one seed, each its own client learning rate


def dataset():
    rng = np.random.default_rng(4)
    centers = rng.normal(size=(CLASSES, FEATURES)) * 2.0

    def split(sizes):
        y = np.concatenate([rng.integers(0, CLASSES, n) for n in sizes]).astype(np.int32)
        x = (centers[y] + rng.normal(size=(len(y), FEATURES))).astype(np.float32)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return ClientData(x, y, offsets, np.arange(len(sizes)))

    return FederatedDataset("tiny", split(SIZES), split((5, 5)), num_classes=CLASSES)


def numpy_fedbuff(xs, ys, seconds, w0, lr, steps, K=K, alpha=None, rho=0.0, theta=None):
    """Algorithm 1 with a heap of (end, client, base, start): each client trains EPOCHS
    full-batch steps from its base version; K updates make a step
    w <- w + (1/K) sum_k s(tau_k) Delta_k. With `alpha` (FedAsync, K = 1): the update's
    model x_new is mixed in, w <- (1 - alpha s) w + alpha s x_new, and the worker's gradient
    gains rho (x - x_tau) (Xie et al.'s regularised local objective). With `theta` (buffered
    Delta-FL): w <- w + sum_k pi_k s(tau_k) Delta_k, pi the tail weights at theta of the
    losses F_k(w_{tau_k}) with equal weights (numpy_reference.exact_weights). Returns the
    versions and each step's bases."""
    versions = [w0]
    heap = [(float(d), c, 0) for c, d in enumerate(seconds)]
    heapq.heapify(heap)
    buffer, bases = [], []
    while len(versions) <= steps:
        end, c, base = heapq.heappop(heap)
        W, b = versions[base]
        W0, b0 = W, b
        loss = client_loss(W0, b0, xs[c], ys[c], 0.0)
        for _ in range(EPOCHS):
            gW, gb = grad_mean_xent(W, b, xs[c], ys[c])
            W, b = W - lr * (gW + rho * (W - W0)), b - lr * (gb + rho * (b - b0))
        tau = len(versions) - 1 - base
        buffer.append((1.0 / np.sqrt(1.0 + tau), W - W0, b - b0, base, loss))
        if alpha is not None:
            a = alpha / np.sqrt(1.0 + tau)
            Wc, bc = versions[-1]
            versions.append(((1 - a) * Wc + a * W, (1 - a) * bc + a * b))
            bases.append([base])
            buffer = []
        elif len(buffer) == K:
            pi = (np.full(K, 1.0 / K) if theta is None else
                  exact_weights(np.asarray([u[4] for u in buffer]), np.ones(K), theta))
            W, b = versions[-1]
            versions.append((W + sum(p * u[0] * u[1] for p, u in zip(pi, buffer)),
                             b + sum(p * u[0] * u[2] for p, u in zip(pi, buffer))))
            bases.append([u[3] for u in buffer])
            buffer = []
        heapq.heappush(heap, (end + float(seconds[c]), c, len(versions) - 1))
    return versions, bases


@pytest.mark.parametrize("alpha, rho", [(None, 0.0), (0.6, 0.0), pytest.param(
    0.6, 0.5, marks=pytest.mark.slow)])   # rho: another compiled step, CI's second step
def test_fedbuff_matches_numpy_event_simulation(tmp_path, alpha, rho):
    """FedBuff with K = 3, and FedAsync (alpha: K = 1, mixing alpha s(tau); rho: the
    worker's proximal term (rho/2)||x - x_tau||^2)."""
    k = K if alpha is None else 1
    data = dataset()
    model = build_model("linear", data)
    path = tmp_path / "speeds.txt"
    np.savetxt(path, np.random.default_rng(5).lognormal(0.0, 0.8, size=len(SIZES)))
    seconds = np.loadtxt(path)
    sch = AsyncScheduler(num_clients=len(SIZES), concurrency=len(SIZES), buffer_size=k,
                         max_staleness=None, seconds=lambda ids: seconds[ids], seed=2)
    replicas = Replicas(group=np.zeros(2, np.int32), hyper=(), l2=np.zeros(2, np.float32),
                        schedules=tuple(optax.constant_schedule(lr) for lr in LRS), labels=())
    w0 = {"Dense_0": {"kernel": np.random.default_rng(6).normal(
        size=(2, FEATURES, CLASSES)).astype(np.float32) * 0.3,
                      "bias": np.zeros((2, CLASSES), np.float32)}}
    state = jax.jit(init_buffered_state, static_argnums=1)(w0, sch.V)
    local = LocalSGDConfig(batch_size=BATCH, lanes=2)
    step_fn = jax.jit(build_buffered_step(model, replicas, local, rule=fedbuff.RULE)
                      if alpha is None else
                      build_fedasync_step(model, replicas, local, alpha, rho=rho))
    work = plan_lib.LocalWork(batch_size=BATCH, local_epochs=EPOCHS)
    offsets = data.train.offsets
    caps = plan_lib.capacities(np.diff(offsets), k, work, eval_chunk=8, with_replacement=True)
    keys = jax.jit(jax.vmap(jax.random.key))(np.zeros(2, np.uint32))
    got_bases = []
    for v in range(STEPS):
        step = sch.next_step()
        got_bases.append(step.base.tolist())
        cohort = Cohort(step.clients.astype(np.int32), np.ones(k, bool), np.ones(k))
        plan = plan_lib.make_round_plan([2], v, offsets, k, work, caps, cohorts=[cohort])
        rd = RoundData(x=data.train.x, y=data.train.y, plan=plan)
        state, metrics = step_fn(state, rd, step_inputs([step]), keys)
    xs = [data.train.client(k)[0].astype(np.float64) for k in range(len(SIZES))]
    ys = [data.train.client(k)[1] for k in range(len(SIZES))]
    served = jax.device_get(jax.jit(current_params)(state))["Dense_0"]
    for r, lr in enumerate(LRS):
        start = (w0["Dense_0"]["kernel"][r].astype(np.float64), np.zeros(CLASSES))
        versions, bases = numpy_fedbuff(xs, ys, seconds, start, lr, STEPS, k, alpha, rho)
        assert got_bases == bases
        np.testing.assert_allclose(served["kernel"][r], versions[-1][0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(served["bias"][r], versions[-1][1], atol=1e-5, rtol=1e-5)
    assert max(v - min(b) for v, b in enumerate(got_bases)) > 0     # stale updates
    assert int(state.version) == STEPS


def test_buffered_run_resumes_bit_for_bit(tmp_path):
    """Six server steps straight equal three, a save of the schedulers' state and of the
    device state, a fresh run restored from them, and three more (C < N, S = 1, clients
    online with probability 0.7: drops, stale updates and idle slots all occur)."""
    from deltafl_jax.asynchronous.run import BufferedRun
    from deltafl_jax.asynchronous.step import BufferedState
    from deltafl_jax.asynchronous.scheduler import AsyncSettings
    from deltafl_jax.sampling.availability import Bernoulli
    data = dataset()
    model = build_model("linear", data)
    seconds = np.random.default_rng(8).lognormal(0.0, 1.0, size=len(SIZES))
    replicas = Replicas(group=np.asarray([0, 1, 1], np.int32), hyper=(),
                        l2=np.zeros(3, np.float32),
                        schedules=tuple(optax.constant_schedule(lr) for lr in (0.3, 0.3, 0.1)),
                        labels=())
    keys = jax.jit(jax.vmap(jax.random.key))(np.asarray([3, 4, 4], np.uint32))
    start = jax.jit(lambda keys, V: init_buffered_state(jax.vmap(model.init)(keys), V),
                    static_argnums=1)   # one program, not one per operation run eagerly

    def fresh():
        run = BufferedRun(model, replicas, LocalSGDConfig(batch_size=4, lanes=2),
                          rule=fedbuff.RULE, seeds=(3, 4), settings=AsyncSettings(4, 2, 1),
                          offsets=data.train.offsets,
                          work=plan_lib.LocalWork(batch_size=4, local_epochs=1),
                          seconds=lambda ids: seconds[ids],
                          availability=Bernoulli(np.full(len(SIZES), 0.7)))
        return run, start(keys, run.schedulers[0].V)

    def go(run, state, n):
        times = []
        for _ in range(n):
            state, metrics = run.step(state, data.train.x, data.train.y, keys)
            times.append(np.concatenate([metrics["virtual_time"],
                                         metrics["dropped_updates"], metrics["staleness_mean"]]))
        return state, times

    run, state = fresh()
    whole, times = go(run, state, 6)
    run, state = fresh()
    state, first = go(run, state, 3)
    np.savez(tmp_path / "host.npz", **run.state())
    saved = jax.device_get(state)
    run, _ = fresh()
    with np.load(tmp_path / "host.npz") as host:
        run.restore(dict(host))
    resumed, second = go(run, BufferedState(**{k: getattr(saved, k) for k in
                                               ("ring", "current", "version",
                                                "server_opt_state")}), 3)
    np.testing.assert_array_equal(np.stack(first + second), np.stack(times))
    assert np.stack(times)[:, 3:6].sum() > 0 and np.stack(times)[:, 6:].max() > 0
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_step_without_a_finite_update_keeps_the_model():
    """A replica whose every buffered update is NaN (learning rate NaN) writes its current
    version again, under FedBuff and FedAsync alike, also when the update's base is another
    version than the current one (FedAsync's mix reads both); the other replica moves."""
    data = dataset()
    model = build_model("linear", data)
    replicas = Replicas(group=np.zeros(2, np.int32), hyper=(), l2=np.zeros(2, np.float32),
                        schedules=(optax.constant_schedule(0.1),
                                   optax.constant_schedule(float("nan"))), labels=())
    keys = jax.jit(jax.vmap(jax.random.key))(np.zeros(2, np.uint32))

    @jax.jit   # one program, not one per operation run eagerly
    def start(keys):
        """Version 0 in slot 0, version 1 in slot 1, the current one; and version 1."""
        w0 = jax.tree.map(lambda p: p + 0.1, jax.vmap(model.init)(keys))
        state = init_buffered_state(w0, 3)
        state = state.replace(current=jnp.ones(2, jnp.int32), ring=jax.tree.map(
            lambda a: a.at[:, 1].set(a[:, 0] * 2.0), state.ring))
        return state, current_params(state)

    work = plan_lib.LocalWork(batch_size=BATCH, local_epochs=1)
    caps = plan_lib.capacities(np.asarray(SIZES), 1, work, eval_chunk=8)
    plan = plan_lib.make_round_plan([0], 0, data.train.offsets, 1, work, caps,
                                    cohorts=[Cohort(np.asarray([2], np.int32),
                                                    np.ones(1, bool), np.ones(1))])
    inputs = step_inputs([ServerStep(2, 1.0, np.asarray([2]), np.asarray([0]),
                                     np.asarray([1]), np.asarray([0]), np.zeros(1),
                                     np.ones(1), np.asarray([0], np.int32), 1, 2, 0)])
    local = LocalSGDConfig(batch_size=BATCH, lanes=1)
    for fn in (build_buffered_step(model, replicas, local, rule=fedbuff.RULE),
               build_fedasync_step(model, replicas, local, 0.5)):
        state, w1 = start(keys)
        state, metrics = jax.jit(fn)(state, RoundData(data.train.x, data.train.y, plan),
                                     inputs, keys)
        served = jax.jit(current_params)(state)
        for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(w1)):
            np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[1])
            assert not np.allclose(np.asarray(a)[0], np.asarray(b)[0])
        assert int(np.asarray(metrics["num_rejected"])[1]) == 1


DEVICES_SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax, numpy as np, optax
sys.path.insert(0, sys.argv[1])
from test_fedbuff import SIZES, dataset
from deltafl_jax.algorithms.buffered.fedbuff import RULE
from deltafl_jax.asynchronous.run import BufferedRun
from deltafl_jax.asynchronous.step import current_params, init_buffered_state
from deltafl_jax.engine import LocalSGDConfig
from deltafl_jax.engine.mesh import make_mesh
from deltafl_jax.models import build_model
from deltafl_jax.replicas.labels import Replicas
from deltafl_jax.sampling import plan as plan_lib
from deltafl_jax.asynchronous.scheduler import AsyncSettings
data = dataset()
model = build_model("linear", data)
seconds = np.random.default_rng(9).lognormal(0.0, 1.0, size=len(SIZES))
replicas = Replicas(group=np.asarray([0, 1], np.int32), hyper=(), l2=np.zeros(2, np.float32),
                    schedules=(optax.constant_schedule(0.2),) * 2, labels=())
keys = jax.vmap(jax.random.key)(np.asarray([1, 2], np.uint32))
out = {}
for d in (1, 2):
    run = BufferedRun(model, replicas, LocalSGDConfig(batch_size=4, lanes=2, order_lanes=2),
                      rule=RULE, seeds=(1, 2), settings=AsyncSettings(5, 3, 2), offsets=data.train.offsets,
                      work=plan_lib.LocalWork(batch_size=4, local_epochs=1),
                      seconds=lambda ids: seconds[ids], mesh=make_mesh(d) if d > 1 else None)
    state = init_buffered_state(jax.vmap(model.init)(keys), run.schedulers[0].V)
    trips = []
    for _ in range(5):
        state, m = run.step(state, data.train.x, data.train.y, keys)
        trips.append(np.asarray(m["device_train_trips"]).tolist())
    out[d] = {"params": [np.asarray(x).ravel().tolist()
                         for x in jax.tree.leaves(current_params(state))], "trips": trips}
print(json.dumps(out))
"""


@pytest.mark.slow   # a subprocess with two fake devices: CI's second step
def test_one_and_two_devices_agree():
    """Five server steps of two seeds on 1 and on 2 fake CPU devices (jobs dealt across
    both) give the same models within 1e-5."""
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", DEVICES_SCRIPT, here], capture_output=True,
                          text=True, cwd=os.path.dirname(here), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for a, b in zip(out["1"]["params"], out["2"]["params"]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert len(out["2"]["trips"][0]) == 2 and len(out["1"]["trips"][0]) == 1


def test_a_ring_that_cannot_fit_is_refused_in_one_line():
    """C = 6, K = 3, no staleness bound: V = 9 versions of two replicas' 4 x 3 + 3 floats
    (120 bytes each) need 1080 bytes."""
    from deltafl_jax.asynchronous.run import BufferedRun, version_bytes
    from deltafl_jax.errors import ConfigError
    from deltafl_jax.asynchronous.scheduler import AsyncSettings
    data = dataset()
    model = build_model("linear", data)
    replicas = Replicas(group=np.zeros(2, np.int32), hyper=(), l2=np.zeros(2, np.float32),
                        schedules=(optax.constant_schedule(0.1),) * 2, labels=())
    assert version_bytes(model, 2) == 2 * (FEATURES * CLASSES + CLASSES) * 4
    kw = dict(rule=fedbuff.RULE, seeds=(0,), settings=AsyncSettings(6, 3, None), offsets=data.train.offsets,
              work=plan_lib.LocalWork(batch_size=4), seconds=lambda ids: np.ones(len(ids)))
    with pytest.raises(ConfigError, match="the 9 model versions"):
        BufferedRun(model, replicas, LocalSGDConfig(batch_size=4, lanes=1),
                    memory_bytes=1079, **kw)
    BufferedRun(model, replicas, LocalSGDConfig(batch_size=4, lanes=1), memory_bytes=1080,
                **kw)
