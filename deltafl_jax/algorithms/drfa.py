"""DRFA (Deng, Kamani, Mahdavi, *Distributionally Robust Federated Averaging*, NeurIPS 2020,
Algorithm 1): min_w max_{lambda in the simplex} sum_i lambda_i f_i(w) by periodic averaging.

The server keeps the mixing weights lambda over the N training clients (uniform at first).
Round s, for each replica:

1. it draws m clients with replacement with probabilities lambda (``sampling``: the host
   reads lambda after the previous round and plans each replica's own clients);
2. each drawn client runs its K_k local steps of the client optimizer from w_t, and keeps the
   snapshot of its model after t'_k = 1 + floor(u K_k) of them, u ~ U[0, 1) drawn once per
   round and replica from the round key (with ``--local_steps=E`` every client keeps the model
   of the same step t' in {1..E}, the paper's random snapshot step);
3. w_{t+1} = w_t + (1/m) sum (w_k - w_t), the plain mean over the drawn clients (an unbiased
   estimate of the lambda-weighted step, since they were drawn by lambda);
4. a second, uniform sample U of m clients (``probe``) reports f_i at the snapshot average
   w' = w_t + (1/m) sum (snapshot_k - w_t), with the L2 term as every F_k here;
5. lambda <- Proj_simplex(lambda + tau gamma v), v_i = (N/m) f_i(w') for i in U (0 elsewhere),
   tau the mean local steps of the drawn clients (E), gamma = ``--drfa_lambda_lr``.

``--drfa_variant=fedtorch`` is the authors' FedTorch code, its centred version (one process
simulating the server and the clients: ``fedtorch/comms/trainings/federated/centered/drfa.py``
with ``fedtorch/comms/algorithms/federated/centered/{misc,fedavg}.py``; its distributed version,
one process per client with the server also a client, shares one k among the clients, starts
lambda at 0 and raises every lambda_i <= 1e-3):

* lambda starts at n_k / n, the clients' shares of the training examples;
* m clients are drawn uniformly without replacement (the run's sampler);
* each draws its own k uniform in {1..K_k - 1} (torch's ``randint(1, K)``) and keeps the model
  *before* its step k, i.e. after t'_k = k - 1 in {0..K_k - 2} steps (t'_k = 0, the snapshot
  w_t, where K_k <= 2; FedTorch cannot draw k for K = 1);
* w_{t+1} = w_t + sum_k lambda_k (N / m) (w_k - w_t) (not renormalised);
* the snapshot average is the plain mean w' = (1/m) sum_k snapshot_k, over every drawn
  client, those with lambda_k = 0 included (they train: ``all_sampled_work``);
* gamma is multiplied by 0.9 before every round, the first included (round s uses
  gamma 0.9^s, s = 1, 2, ...), and lambda <- Proj_simplex(lambda + tau gamma_s v) as above;
* after the projection the first lambda_i <= 1e-3 (in client order), only that one, is set to
  1e-3 and lambda renormalised.

It keeps two choices of this engine where FedTorch differs: f_i is the client's loss on its
whole data with the L2 term (FedTorch: one minibatch, without weight decay), and tau is the
mean local steps of the drawn clients (FedTorch: its --local_step, the same with
``--local_steps=E``). With gamma = 0 lambda never moves (in the FedTorch variant unless a
share n_k / n is <= 1e-3): the paper's DRFA then steps as FedAvg on the clients it draws
(uniformly, with replacement); the FedTorch variant as FedAvg weighted by n_k N / (n m).

f_i is each client's loss on its whole training data (the paper: a stochastic estimate); the
served model is w_t. There is no private version.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.algorithms.afl import project_simplex
from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import Sweep, check_options
from deltafl_jax.algorithms.protocol import FederatedAlgorithm, RoundContext, average_delta
from deltafl_jax.algorithms.spec import AlgorithmSpec, Reporting
from deltafl_jax.declared import setting
from deltafl_jax.engine.client import (ClientUpdate, LocalState, difference, local_init,
                                       optimizer_step)

VARIANTS = ("paper", "fedtorch")
SNAPSHOT_STREAM = 0xD8FA     # folded into the round key (FedTorch: the client's key) for u
FEDTORCH_DECAY, FEDTORCH_FLOOR = 0.9, 1e-3
DEFAULT_LAMBDA_LR = (0.001, 0.01, 0.1)

class DRFAHyper(NamedTuple):
    """lambda_lr: [] gamma >= 0, the step size of the ascent on lambda."""

    lambda_lr: float


@dataclasses.dataclass(frozen=True)
class DRFAOptions:
    """``drfa_variant``: the paper's algorithm or the authors' code (module docstring)."""

    drfa_variant: str = setting(
        "paper", "paper: Algorithm 1 (clients drawn by lambda, plain mean); fedtorch: the "
        "authors' centred FedTorch code (lambda from n_k/n, uniform draws, updates weighted "
        "lambda_k N/m, the plain mean of snapshots after 0..K-2 steps drawn per client, gamma x "
        "0.9 before every round, the first lambda_i <= 1e-3 raised to 1e-3)", choices=VARIANTS)


class DRFAState(NamedTuple):
    """lam: [N] the mixing weights; rounds: [] int32, rounds done (the code's decay)."""

    lam: jax.Array
    rounds: jax.Array


class DRFAStep(NamedTuple):
    """A client's step state: its local training, steps done, the snapshot step t' and the
    snapshot (the model after t' steps)."""

    local: LocalState
    done: jax.Array
    at: jax.Array
    snapshot: object


def snapshot_step(key, steps):
    """t' = 1 + floor(u K) in {1..K}, u ~ U[0, 1) from the replica's round key."""
    u = jax.random.uniform(jax.random.fold_in(key, SNAPSHOT_STREAM))
    k = jnp.maximum(steps, 1)
    return jnp.minimum(1 + jnp.floor(u * k.astype(jnp.float32)).astype(jnp.int32), k)


def fedtorch_snapshot_step(key, client, steps):
    """t' = k - 1 for FedTorch's k uniform in {1..K-1}: floor(u (K - 1)) in {0..K-2} (0 where
    K <= 2), u ~ U[0, 1) drawn per client from ``fold_in(round key, client)``."""
    client_key = jax.random.fold_in(key, jnp.maximum(client, 0))
    u = jax.random.uniform(jax.random.fold_in(client_key, SNAPSHOT_STREAM))
    span = jnp.maximum(steps - 1, 1)
    return jnp.minimum(jnp.floor(u * span.astype(jnp.float32)).astype(jnp.int32), span - 1)


def _init_at(at):
    """A client update's init that keeps the snapshot after ``at(job)`` steps (w_t if 0)."""

    def init(server_state, client_state, params, hyper, job):
        return DRFAStep(local=local_init(server_state, client_state, params, hyper, job),
                        done=jnp.int32(0), at=at(job), snapshot=params)
    return init


def _step(state, grad_fn, hyper, job):
    w = state.local.params
    _, grads = grad_fn(w)
    w, opt = optimizer_step(w, state.local.opt_state, grads, job.optimizer)
    done = state.done + 1
    snapshot = jax.tree.map(lambda s, x: jnp.where(done == state.at, x, s), state.snapshot, w)
    return DRFAStep(local=LocalState(w, opt), done=done, at=state.at, snapshot=snapshot)


def _final(state, client_state, params, hyper, job):
    """(the state unchanged, w_K - w_t, (snapshot - w_t, K))."""
    del hyper
    return (client_state, difference(state.local.params, params),
            (difference(state.snapshot, params), job.steps))


snapshot_update = ClientUpdate(init=_init_at(lambda job: snapshot_step(job.key, job.steps)),
                               step=_step, final=_final)
fedtorch_snapshot_update = ClientUpdate(
    init=_init_at(lambda job: fedtorch_snapshot_step(job.key, job.client, job.steps)),
    step=_step, final=_final)


def raise_first_small(lam):
    """FedTorch's centred guard against zero probabilities: the first lambda_i <= 1e-3 (in
    client order), only that one, is set to 1e-3 and lambda renormalised; unchanged if none."""
    low = lam <= FEDTORCH_FLOOR
    raised = lam.at[jnp.argmax(low)].set(FEDTORCH_FLOOR)
    return jnp.where(jnp.any(low), raised / jnp.sum(raised), lam)


def _weighted_sum(c, ok, tree, params):
    """sum_k c_k x_k over the finite updates (x_k of the others, possibly NaN, masked)."""
    return jax.tree.map(lambda w, x: jnp.tensordot(c, jnp.where(
        ok.reshape(ok.shape + (1,) * (x.ndim - 1)), x, 0.0), axes=1).astype(w.dtype),
        params, tree)


def drfa(train_sizes, options: DRFAOptions = DRFAOptions()) -> FederatedAlgorithm:
    """DRFA over the training clients of sizes `train_sizes` (module docstring)."""
    check_options(options)
    paper = options.drfa_variant == "paper"
    sizes = np.asarray(train_sizes, np.float64)
    N = int(sizes.size)
    lam0 = (jnp.full((N,), 1.0 / N, jnp.float32) if paper
            else jnp.asarray(sizes / sizes.sum(), jnp.float32))

    def init(params, hyper):
        del params, hyper
        return DRFAState(lam=lam0, rounds=jnp.int32(0))

    def client_weights(ctx: RoundContext) -> jax.Array:
        m = ctx.sizes.shape[0]
        return jnp.ones((m,), jnp.float32) if paper else ctx.state.lam[ctx.clients] * (N / m)

    def probe(state, params, feedback, hyper):
        """w' = w_t + the plain mean of (snapshot_k - w_t) over the finite updates."""
        del state, hyper
        offsets, _ = feedback.client_outputs
        ok = feedback.job_finite
        c = jnp.where(ok, feedback.weights if paper else 1.0, 0.0)
        c = c / jnp.maximum(jnp.sum(c), 1e-30)
        return jax.tree.map(jnp.add, params, _weighted_sum(c, ok, offsets, params))

    def server_update(state, params, feedback, hyper):
        delta = (average_delta(params, feedback) if paper
                 else jax.tree.map(lambda w, d: d.astype(w.dtype), params, feedback.delta_sum))
        _, steps = feedback.client_outputs
        trained = feedback.job_trained
        tau = jnp.sum(jnp.where(trained, steps, 0)) / jnp.maximum(jnp.sum(trained), 1)
        m = feedback.probe_losses.shape[0]
        v = jnp.zeros((N,), jnp.float32).at[feedback.probe_clients].add(
            (N / m) * feedback.probe_losses)
        gamma = hyper.lambda_lr * (1.0 if paper else FEDTORCH_DECAY ** (state.rounds + 1))
        lam = project_simplex(state.lam + tau * gamma * v)
        if not paper:
            lam = raise_first_small(lam)
        return delta, DRFAState(lam=lam, rounds=state.rounds + 1), {
            "drfa_lambda_max": jnp.max(lam), "drfa_probe_loss_mean": jnp.mean(
                feedback.probe_losses)}

    return FederatedAlgorithm(
        name="drfa", init=init, client_weights=client_weights, server_update=server_update,
        uses_losses=False, client_update=snapshot_update if paper else fedtorch_snapshot_update,
        probe=probe, all_sampled_work=not paper,
        sampling=(lambda state: state.lam) if paper else None)


SPEC = AlgorithmSpec(
    name="drfa", display_name="DRFA",
    help="DRFA: clients drawn by lambda, snapshot-average losses of a uniform sample drive "
    "lambda's projected ascent (Deng et al. 2020)",
    factory=lambda config, data, options: drfa(data.train.sizes, options),
    hyper=DRFAHyper, options_type=DRFAOptions,
    sweep=Sweep(flag="drfa_lambda_lr", field="lambda_lr", default=DEFAULT_LAMBDA_LR,
                minimum=0.0, symbol="γ", help="drfa: step sizes gamma >= 0 of the ascent on "
                "the mixing weights lambda, swept"),
    reporting=Reporting(leaderboard=Board(grid={"drfa_lambda_lr": DEFAULT_LAMBDA_LR},
                                          quick={"drfa_lambda_lr": (0.01, 0.1)})))
