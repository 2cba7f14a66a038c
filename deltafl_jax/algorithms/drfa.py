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

``--drfa_variant=fedtorch`` is the authors' FedTorch code as the reference notes describe it:
m clients drawn uniformly without replacement (the run's sampler), their updates (and
snapshots) summed with weights lambda_k N / m (not renormalised), gamma decayed by 0.9 every
round, and lambda floored at 1e-3 (then renormalised) after its projection. With gamma = 0
lambda never moves: the paper's DRFA then steps as FedAvg on the clients it draws (uniformly,
with replacement).

f_i is each client's loss on its whole training data (the paper: a stochastic estimate); the
served model is w_t. There is no private version.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.afl import project_simplex
from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import Option, Sweep, check_options
from deltafl_jax.algorithms.protocol import FederatedAlgorithm, average_delta
from deltafl_jax.algorithms.spec import AlgorithmSpec
from deltafl_jax.engine.client import (ClientUpdate, LocalState, difference, local_init,
                                       optimizer_step)

VARIANTS = ("paper", "fedtorch")
SNAPSHOT_STREAM = 0xD8FA     # folded into the round key for u
FEDTORCH_DECAY, FEDTORCH_FLOOR = 0.9, 1e-3
DEFAULT_LAMBDA_LR = (0.001, 0.01, 0.1)

VARIANT = Option(default="paper", choices=VARIANTS,
                 help="paper: Algorithm 1 (clients drawn by lambda, plain mean); fedtorch: the "
                 "authors' code (uniform draws, weights lambda_k N/m, gamma x 0.9 a round, "
                 "lambda >= 1e-3)")


class DRFAHyper(NamedTuple):
    """lambda_lr: [] gamma >= 0, the step size of the ascent on lambda."""

    lambda_lr: float


@dataclasses.dataclass(frozen=True)
class DRFAOptions:
    """``drfa_variant``: the paper's algorithm or the authors' code (module docstring)."""

    drfa_variant: str = VARIANT.field()


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


def _init(server_state, client_state, params, hyper, job):
    return DRFAStep(local=local_init(server_state, client_state, params, hyper, job),
                    done=jnp.int32(0), at=snapshot_step(job.key, job.steps), snapshot=params)


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


snapshot_update = ClientUpdate(init=_init, step=_step, final=_final)


def drfa(num_clients: int, options: DRFAOptions = DRFAOptions()) -> FederatedAlgorithm:
    """DRFA over `num_clients` training clients (module docstring)."""
    check_options(options)
    paper = options.drfa_variant == "paper"
    N = int(num_clients)

    def init(params, hyper):
        del params, hyper
        return DRFAState(lam=jnp.full((N,), 1.0 / N, jnp.float32), rounds=jnp.int32(0))

    def client_weights(state, losses, sizes, hyper, key, clients):
        del losses, hyper, key
        m = sizes.shape[0]
        return jnp.ones((m,), jnp.float32) if paper else state.lam[clients] * (N / m)

    def combine(feedback, tree, params):
        """sum of c_k x_k over the finite updates: the mean (paper) or with c_k = a_k."""
        ok = feedback.job_finite
        c = jnp.where(ok, feedback.weights, 0.0)
        if paper:
            c = c / jnp.maximum(jnp.sum(c), 1e-30)
        return jax.tree.map(lambda w, x: jnp.tensordot(c, jnp.where(
            ok.reshape(ok.shape + (1,) * (x.ndim - 1)), x, 0.0), axes=1).astype(w.dtype),
            params, tree)

    def probe(state, params, feedback, hyper):
        del state, hyper
        offsets, _ = feedback.client_outputs
        return jax.tree.map(jnp.add, params, combine(feedback, offsets, params))

    def server_update(state, params, feedback, hyper):
        delta = (average_delta(params, feedback) if paper
                 else jax.tree.map(lambda w, d: d.astype(w.dtype), params, feedback.delta_sum))
        _, steps = feedback.client_outputs
        trained = feedback.job_trained
        tau = jnp.sum(jnp.where(trained, steps, 0)) / jnp.maximum(jnp.sum(trained), 1)
        m = feedback.probe_losses.shape[0]
        v = jnp.zeros((N,), jnp.float32).at[feedback.probe_clients].add(
            (N / m) * feedback.probe_losses)
        gamma = hyper.lambda_lr * (1.0 if paper else FEDTORCH_DECAY ** state.rounds)
        lam = project_simplex(state.lam + tau * gamma * v)
        if not paper:
            lam = jnp.maximum(lam, FEDTORCH_FLOOR)
            lam = lam / jnp.sum(lam)
        return delta, DRFAState(lam=lam, rounds=state.rounds + 1), {
            "drfa_lambda_max": jnp.max(lam), "drfa_probe_loss_mean": jnp.mean(
                feedback.probe_losses)}

    return FederatedAlgorithm(
        name="drfa", init=init, client_weights=client_weights, server_update=server_update,
        uses_losses=False, client_update=snapshot_update, probe=probe,
        sampling=(lambda state: state.lam) if paper else None)


SPEC = AlgorithmSpec(
    name="drfa", display_name="DRFA",
    help="DRFA: clients drawn by lambda, snapshot-average losses of a uniform sample drive "
    "lambda's projected ascent (Deng et al. 2020)",
    factory=lambda config, data, options: drfa(data.train.num_clients, options),
    hyper=DRFAHyper, options_type=DRFAOptions,
    sweep=Sweep(flag="drfa_lambda_lr", field="lambda_lr", default=DEFAULT_LAMBDA_LR,
                minimum=0.0, symbol="γ", help="drfa: step sizes gamma >= 0 of the ascent on "
                "the mixing weights lambda, swept"),
    leaderboard=Board(grid={"drfa_lambda_lr": DEFAULT_LAMBDA_LR},
                      quick={"drfa_lambda_lr": (0.01, 0.1)}))
