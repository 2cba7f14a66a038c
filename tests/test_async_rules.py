"""The buffered rules beyond FedBuff's (deltafl_jax/algorithms/buffered/fedscale.py,
deltafl_jax/algorithms/buffered/deltafl_buffered.py) against NumPy written from their sources:
FedScale's form against an event simulation written from FedScale's aggregator (the model
average with 1/sqrt(1 + tau), the freed slot refilled before the step, clients drawn among
all online ones); buffered Delta-FL against test_fedbuff's event simulation with the tail
weights of the losses at the base versions, and at its two limits: theta = 1 is FedBuff bit
for bit, and K = C with no staleness is the synchronous Delta-FL round."""

import heapq

import jax
import numpy as np
import optax
import pytest

from numpy_reference import grad_mean_xent
from test_fedbuff import CLASSES, EPOCHS, FEATURES, SIZES, dataset, numpy_fedbuff
from deltafl_jax import rounds
from deltafl_jax.algorithms.buffered import fedbuff, fedscale
from deltafl_jax.algorithms.deltafl import DeltaFLHyper, DeltaFLOptions, deltafl
from deltafl_jax.algorithms.buffered.deltafl_buffered import tail_rule
from deltafl_jax.asynchronous.run import BufferedRun
from deltafl_jax.asynchronous.step import current_params, init_buffered_state
from deltafl_jax.engine import LocalSGDConfig
from deltafl_jax.models import build_model
from deltafl_jax.replicas.labels import Replicas
from deltafl_jax.sampling import Cohort
from deltafl_jax.sampling import plan as plan_lib
from deltafl_jax.asynchronous.scheduler import AsyncSettings
from deltafl_jax.sampling.plan import RoundData

LRS, BATCH, SEED = (0.3, 0.1), 16, 2


def replicas_of(thetas=(1.0, 1.0), lrs=LRS):
    return Replicas(group=np.zeros(len(lrs), np.int32),
                    hyper=DeltaFLHyper(theta=np.asarray(thetas, np.float32)),
                    l2=np.zeros(len(lrs), np.float32),
                    schedules=tuple(optax.constant_schedule(lr) for lr in lrs), labels=())


def initial(R=2):
    """w_0 of every replica: a random kernel (the clients' losses differ), zero bias."""
    return {"Dense_0": {"kernel": np.random.default_rng(6).normal(
        size=(R, FEATURES, CLASSES)).astype(np.float32) * 0.3,
                        "bias": np.zeros((R, CLASSES), np.float32)}}


def drive(rule, seconds, C, K, steps, replicas, w0=None):
    """`steps` server steps of `rule` through BufferedRun (one seed, every client online):
    (served params, [steps] ServerStep, [steps] metrics)."""
    data = dataset()
    model = build_model("linear", data)
    run = BufferedRun(model, replicas, LocalSGDConfig(batch_size=BATCH, lanes=2), rule=rule,
                      seeds=(SEED,), settings=AsyncSettings(C, K, None),
                      offsets=data.train.offsets,
                      work=plan_lib.LocalWork(batch_size=BATCH, local_epochs=EPOCHS),
                      seconds=lambda ids: np.asarray(seconds)[ids])
    w0 = initial(replicas.size) if w0 is None else w0
    state = jax.jit(init_buffered_state, static_argnums=1)(w0, run.schedulers[0].V)
    keys = jax.jit(jax.vmap(jax.random.key))(np.zeros(replicas.size, np.uint32))
    got, metrics = [], []
    for v in range(steps):
        plan, inputs, step = run.next_step(v)
        state, m = run.step_fn(state, RoundData(data.train.x, data.train.y, plan), inputs, keys)
        got.append(step[0])
        metrics.append(jax.device_get(m))
    return jax.device_get(jax.jit(current_params)(state))["Dense_0"], got, metrics


def client_arrays():
    data = dataset()
    return ([data.train.client(k)[0].astype(np.float64) for k in range(len(SIZES))],
            [data.train.client(k)[1] for k in range(len(SIZES))])


def numpy_fedscale(xs, ys, seconds, w0, lr, steps, C, K, seed):
    """FedScale's buffered aggregation written from its aggregator and executor: C jobs in
    flight; each job's client drawn uniformly among all N clients, busy ones included, by the
    scheduler's documented draw default_rng([seed, serial, 0xA5C1]); completions by (end,
    client, serial); every completion refills its slot at once from the current version,
    before the step when it fills the buffer; K updates make a step to
    sum s_k w_k / sum s_k, s = 1/sqrt(1 + tau). Returns the versions, each step's clients
    and bases, the jobs drawn while their client was busy and the jobs that started from
    the version before the step their completion triggered."""
    versions, jobs, buffer, out = [w0], [], [], {"clients": [], "bases": []}
    serial, busy_draws, before_step = 0, 0, 0

    def draw(clock):
        nonlocal serial, busy_draws
        c = int(np.random.default_rng([seed, serial, 0xA5C1]).integers(len(seconds)))
        busy_draws += any(j[1] == c for j in jobs)
        heapq.heappush(jobs, (clock + float(seconds[c]), c, serial, len(versions) - 1))
        serial += 1

    for _ in range(C):
        draw(0.0)
    while len(versions) <= steps:
        end, c, _, base = heapq.heappop(jobs)
        W, b = versions[base]
        for _ in range(EPOCHS):
            gW, gb = grad_mean_xent(W, b, xs[c], ys[c])
            W, b = W - lr * gW, b - lr * gb
        buffer.append((1.0 / np.sqrt(len(versions) - base), W, b, c, base))
        draw(end)
        if len(buffer) == K:
            before_step += 1
            s = np.asarray([u[0] for u in buffer])
            versions.append((sum(u[0] * u[1] for u in buffer) / s.sum(),
                             sum(u[0] * u[2] for u in buffer) / s.sum()))
            out["clients"].append([u[3] for u in buffer])
            out["bases"].append([u[4] for u in buffer])
            buffer = []
    return versions, out, busy_draws, before_step


@pytest.mark.slow   # one or two compiled server steps each: CI's second step
def test_fedscale_form_matches_its_event_simulation():
    """C = 4 of 6 clients, K = 2, lognormal job times, 8 steps: the clients and bases of
    every step and the served models equal FedScale's NumPy simulation (1e-5); clients were
    drawn while busy, and freed slots were refilled before the step."""
    seconds = np.random.default_rng(5).lognormal(0.0, 0.8, size=len(SIZES))
    C, K, steps = 4, 2, 8
    served, got, _ = drive(fedscale.RULE, seconds, C, K, steps, replicas_of())
    xs, ys = client_arrays()
    w0 = initial()["Dense_0"]
    for r, lr in enumerate(LRS):
        start = (w0["kernel"][r].astype(np.float64), np.zeros(CLASSES))
        versions, out, busy, before = numpy_fedscale(xs, ys, seconds, start, lr, steps, C, K,
                                                     SEED)
        assert [s.clients.tolist() for s in got] == out["clients"]
        assert [s.base.tolist() for s in got] == out["bases"]
        np.testing.assert_allclose(served["kernel"][r], versions[-1][0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(served["bias"][r], versions[-1][1], atol=1e-5, rtol=1e-5)
    assert busy > 0 and before == steps
    assert max(s.staleness.max() for s in got) > 0


@pytest.mark.slow   # one or two compiled server steps each: CI's second step
def test_buffered_deltafl_matches_numpy_and_theta_one_is_fedbuff():
    """C = N = 6, K = 3, 7 steps with stale updates: at theta = 0.5 and 0.8 the served
    models equal the NumPy event simulation whose steps aggregate sum_k pi_k s(tau_k)
    Delta_k with the tail weights of the losses at the base versions (1e-5), and some
    updates were filtered out; at theta = 1 the rule's models equal FedBuff's bit for bit."""
    seconds = np.random.default_rng(5).lognormal(0.0, 0.8, size=len(SIZES))
    thetas, lrs = (0.5, 0.8, 1.0), (0.3, 0.3, 0.3)
    served, got, metrics = drive(tail_rule("exact", thetas), seconds, 6, 3, 7,
                                 replicas_of(thetas, lrs))
    xs, ys = client_arrays()
    w0 = initial(3)["Dense_0"]
    for r, theta in enumerate(thetas[:2]):
        start = (w0["kernel"][r].astype(np.float64), np.zeros(CLASSES))
        versions, bases = numpy_fedbuff(xs, ys, seconds, start, lrs[r], 7, 3, theta=theta)
        assert [s.base.tolist() for s in got] == bases
        np.testing.assert_allclose(served["kernel"][r], versions[-1][0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(served["bias"][r], versions[-1][1], atol=1e-5, rtol=1e-5)
    kept = np.stack([m["kept_updates"] for m in metrics])
    assert kept[:, 0].min() < 3 and np.all(kept[:, 2] == 3)
    assert max(s.staleness.max() for s in got) > 0
    plain, _, _ = drive(fedbuff.RULE, seconds, 6, 3, 7, replicas_of(thetas, lrs))
    for leaf in ("kernel", "bias"):
        np.testing.assert_array_equal(served[leaf][2], plain[leaf][2])


@pytest.mark.slow   # one or two compiled server steps each: CI's second step
def test_buffered_deltafl_with_k_equal_c_and_no_staleness_is_synchronous_deltafl():
    """K = C = 4, every job equally long: the first buffer is the 4 clients started at
    version 0, none stale; its step at theta = 0.6 (a boundary fraction) equals the
    synchronous Delta-FL round with --weighting=unweighted on that cohort, same plan and
    keys (1e-6), with the same eta."""
    data = dataset()
    model = build_model("linear", data)
    thetas = (0.6, 1.0)
    replicas = replicas_of(thetas, (0.3, 0.3))
    served, got, metrics = drive(tail_rule("exact", thetas), np.ones(len(SIZES)), 4, 4, 1,
                                 replicas)
    step = got[0]
    assert step.staleness.tolist() == [0, 0, 0, 0] and len(set(step.clients.tolist())) == 4
    algo = deltafl(DeltaFLOptions(weighting="unweighted"), thetas=thetas)
    local = LocalSGDConfig(batch_size=BATCH, lanes=2)
    round_fn = jax.jit(rounds.build_round_fn(model, algo, replicas, local, 8, 2, 4))
    w0 = initial()
    state = rounds.init_state(model, algo, replicas, [SEED]).replace(params=w0)
    work = plan_lib.LocalWork(batch_size=BATCH, local_epochs=EPOCHS)
    caps = plan_lib.capacities(np.asarray(SIZES), 4, work, 8, with_replacement=True)
    plan = plan_lib.make_round_plan([SEED], 0, data.train.offsets, 4, work, caps,
                                    cohorts=[Cohort(step.clients.astype(np.int32),
                                                             np.ones(4, bool), np.ones(4))])
    keys = jax.jit(jax.vmap(jax.random.key))(np.zeros(2, np.uint32))
    state, sync = round_fn(state, RoundData(data.train.x, data.train.y, plan), keys)
    want = jax.device_get(state.params)["Dense_0"]
    for leaf in ("kernel", "bias"):
        np.testing.assert_allclose(served[leaf], want[leaf], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(metrics[0]["eta"], np.asarray(sync["eta"]), rtol=1e-6)
    assert metrics[0]["kept_updates"].tolist() == [3, 4]


def test_the_rules_refuse_what_they_cannot_run():
    """A ConfigError naming the flag, before anything is built: --fedasync_rho below 0,
    FedScale's form at a theta other than 1, buffered Delta-FL at theta 0 or with a client
    sampler; buffered Delta-FL takes a theta sweep and the reference filter."""
    from conftest import tiny_config
    from deltafl_jax.algorithms import registry
    from deltafl_jax.errors import ConfigError
    refused = [
        (dict(algorithm="fedasync", thetas=(1.0,), fedasync_rho=-0.5), "--fedasync_rho"),
        (dict(algorithm="fedbuff_fedscale", thetas=(0.5,)), "--thetas"),
        (dict(algorithm="deltafl_buffered", thetas=(0.0,)), "--thetas"),
        (dict(algorithm="deltafl_buffered", client_sampling="poisson"), "--client_sampling")]
    for overrides, flag in refused:
        with pytest.raises(ConfigError, match=flag):   # the configuration or the spec's check
            config = tiny_config(concurrency=4, buffer_size=2, **overrides)
            registry.get(config.algorithm).check(config)
    ok = tiny_config(algorithm="deltafl_buffered", thetas=(1.0, 0.5), filter="reference",
                     concurrency=4, buffer_size=2)
    spec = registry.get("deltafl_buffered")
    spec.check(ok)
    assert spec.sweep_values(ok) == (1.0, 0.5)
    assert spec.asynchronous.make(ok, spec.options_for(ok)).uses_losses
