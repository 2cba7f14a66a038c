"""Personalised evaluation: each (replica, client) job adapts the model the client was served on
its own adaptation data, then evaluates it on its own held-out data, in one jitted loop.

TFF's personalisation evaluation and Motley's fine-tuning baseline evaluate a federated model
on each client after k local steps on that client's data. Here a job (r, i) is:

1. start from the model served to client i by replica r: the served global model, or a
   training client's personal model (the algorithm's ``client_model``, from its own state);
2. ``train_steps[i]`` adaptation steps (``--finetune_steps``) of the algorithm's
   ``adapt_step`` (plain fine-tuning with the client optimizer by default; Ditto: its proximal
   step towards the served global model) on minibatches of B of the client's adaptation
   examples (fresh permutations laid end to end, as local SGD's ``--local_steps``);
3. ``eval_steps[i]`` = ceil(h_i / B) evaluation steps over its h_i held-out examples, which sum
   the adapted model's losses and errors.

The jobs are dealt to lanes as local SGD's are (:class:`~deltafl_jax.engine.lanes.
LaneTimeline`): every step of a lane is either an adaptation step or an evaluation step, each
behind a ``lax.cond`` taken when some lane needs it. No job keeps its model: only the two sums
per job leave the loop, so per-client models cost nothing beyond the lanes' states. Nothing
here is jitted: :mod:`deltafl_jax.run.personal` jits it once per population.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from deltafl_jax.engine.client import AdaptState, ClientJob, fine_tune_step
from deltafl_jax.engine.lanes import LaneTimeline, per_lane
from deltafl_jax.engine.mesh import SINGLE, DeviceAxis
from deltafl_jax.engine.train import ClientInputs, minibatch_grad_fn
from deltafl_jax.engine.trees import gather_rows, select_tree
from deltafl_jax.models import Model


class AdaptPlan(NamedTuple):
    """Index streams of one block of K clients into the block's example buffer (the same for
    every replica).

    ids: [K] int32: the clients (indices into their split; for seen clients, into the training
      clients, whose own state gives their personal models).
    real: [K] bool: a real client (padding slots do nothing).
    adapt_idx: [La] int32, adapt_start / adapt_len: [K] int32: each client's adaptation
      stream (positions of its adaptation examples, in fresh permutations laid end to end).
    held_idx: [Lh] int32, held_start / held_len: [K] int32: each client's held-out examples.
    train_steps / eval_steps: [K] int32: adaptation and evaluation steps.
    """

    ids: Any
    real: Any
    adapt_idx: Any
    adapt_start: Any
    adapt_len: Any
    held_idx: Any
    held_start: Any
    held_len: Any
    train_steps: Any
    eval_steps: Any


class AdaptConfig(NamedTuple):
    """Static choices of the personalised evaluation.

    batch_size: B. lanes / lane_mode: as local SGD's. optimizer: (learning_rate, l2) -> the
    client optimizer. adapt_step: the algorithm's (None: plain fine-tuning). client_model:
    the algorithm's (None: the served global model), used when `seen`. seen: the clients are
    training clients (their own state is read). train: some job adapts (False: evaluation
    steps only, nothing else is traced).
    """

    batch_size: int
    lanes: int
    lane_mode: str = "vmap"
    axis: DeviceAxis = SINGLE
    optimizer: Optional[Callable[[Any, Any], optax.GradientTransformation]] = None
    adapt_step: Optional[Callable] = None
    client_model: Optional[Callable] = None
    seen: bool = False
    train: bool = True
    branchless: bool = False


class AdaptCarry(NamedTuple):
    trip: jax.Array       # [] int32
    state: Any            # [c, ...] AdaptState of the lanes
    loss: jax.Array       # [c] the lanes' running sums over held-out examples
    err: jax.Array        # [c]
    loss_out: jax.Array   # [J] each finished job's sums
    err_out: jax.Array    # [J]
    real: jax.Array       # [] int32 examples adapted on or evaluated


def adapt_and_evaluate(model: Model, params, *, X, Y, plan: AdaptPlan, hyper, learning_rate,
                       l2, cfg: AdaptConfig, clients: Optional[ClientInputs] = None):
    """(loss_sum, error_sum), each [R, K] float32, over every client's held-out examples, of
    the model each replica served it, after its adaptation steps (module docstring).

    Args:
      params: pytree, leading dim R: the served global models.
      X, Y: the block's examples; plan: its :class:`AdaptPlan` (device arrays).
      hyper: the algorithm's hyper-parameters, leaves [R]; learning_rate, l2: [R] of the
        adaptation steps.
      clients: the algorithm's state [R, ...] and the training clients' own states
        [R, N, ...] (``ids`` unused: the plan's ids are the clients), for `cfg.seen`.
    """
    R = jax.tree.leaves(params)[0].shape[0]
    K = plan.ids.shape[0]
    J, B, c = R * K, cfg.batch_size, cfg.lanes
    replica = jnp.repeat(jnp.arange(R, dtype=jnp.int32), K)
    slot = jnp.tile(jnp.arange(K, dtype=jnp.int32), R)
    n_train = jnp.where(plan.real, plan.train_steps, 0)[slot]
    steps = jnp.where(plan.real[slot], n_train + plan.eval_steps[slot], 0).astype(jnp.int32)
    timeline = LaneTimeline(steps, c, cfg.axis)
    clients = clients if clients is not None else ClientInputs((), (), None)
    adapt = cfg.adapt_step or fine_tune_step
    offs = jnp.arange(B, dtype=jnp.int32)

    def job(r, n):
        return ClientJob(optimizer=cfg.optimizer(learning_rate[r], l2[r]),
                         learning_rate=learning_rate[r], l2=l2[r], steps=n)

    def start_one(r, i):
        """AdaptState of job (r, i): from its served model."""
        w = gather_rows(params, r)
        start = w
        if cfg.seen and cfg.client_model is not None:
            own = jax.tree.map(lambda a: a[r, plan.ids[i]], clients.client_state)
            start = cfg.client_model(gather_rows(clients.server_state, r), own, w,
                                     gather_rows(hyper, r))
        opt = (cfg.optimizer(learning_rate[r], l2[r]).init(start) if cfg.train else ())
        return AdaptState(params=start, opt_state=opt, anchor=w)

    def train_one(state, x, y, valid, r, n):
        grad_fn = minibatch_grad_fn(model, x, y, valid)
        return adapt(state, grad_fn, gather_rows(hyper, r), job(r, n))

    def eval_one(p, x, y, valid):
        loss, err = model.losses_and_errors(p, x, y)
        return (jnp.sum(jnp.where(valid, loss, 0.0)), jnp.sum(jnp.where(valid, err, 0.0)))

    run_train = per_lane(train_one, c, cfg.lane_mode)
    run_eval = per_lane(eval_one, c, cfg.lane_mode)

    def when(lanes, fn, operand):
        return fn(operand) if cfg.branchless else lax.cond(jnp.any(lanes), fn, lambda o: o,
                                                           operand)

    def body(carry: AdaptCarry) -> AdaptCarry:
        t = carry.trip[None, None]
        js, s, active, fresh, done = (a[:, 0] for a in timeline.at(t))
        r, i = replica[js], slot[js]
        training = active & (s < n_train[js])
        u = s - n_train[js]
        pos = jnp.where(training[:, None],
                        plan.adapt_start[i][:, None] + s[:, None] * B + offs,
                        plan.held_start[i][:, None] + u[:, None] * B + offs)
        limit = jnp.where(training, plan.adapt_len[i], plan.held_len[i])
        within = jnp.where(training[:, None], s[:, None] * B, u[:, None] * B) + offs
        valid = active[:, None] & (within < limit[:, None])
        stream = jnp.where(training[:, None],
                           plan.adapt_idx[jnp.where(valid & training[:, None], pos, 0)],
                           plan.held_idx[jnp.where(valid & ~training[:, None], pos, 0)])
        x, y = jnp.take(X, stream, axis=0), jnp.take(Y, stream, axis=0)
        state = when(fresh, lambda st: select_tree(fresh, jax.vmap(start_one)(r, i), st),
                     carry.state)
        loss = jnp.where(fresh, 0.0, carry.loss)
        err = jnp.where(fresh, 0.0, carry.err)
        if cfg.train:
            state = when(training, lambda st: select_tree(
                training, run_train(st, x, y, valid, r, n_train[js]), st), state)
        evaluating = active & ~training
        ls, es = when(evaluating, lambda _: run_eval(state.params, x, y,
                                                     valid & evaluating[:, None]),
                      (jnp.zeros((c,), jnp.float32), jnp.zeros((c,), jnp.float32)))
        loss, err = loss + ls, err + es
        out = jnp.where(done, js, J)
        return AdaptCarry(trip=carry.trip + 1, state=state, loss=loss, err=err,
                          loss_out=carry.loss_out.at[out].set(loss, mode="drop"),
                          err_out=carry.err_out.at[out].set(err, mode="drop"),
                          real=carry.real + jnp.sum(valid))

    js0 = timeline.job_of(jnp.zeros((c,), jnp.int32))
    zeros_c = jnp.zeros((c,), jnp.float32)
    init = AdaptCarry(trip=jnp.int32(0), state=jax.vmap(start_one)(replica[js0], slot[js0]),
                      loss=zeros_c, err=zeros_c, loss_out=jnp.zeros((J,), jnp.float32),
                      err_out=jnp.zeros((J,), jnp.float32), real=jnp.int32(0))
    out = lax.while_loop(lambda cr: cr.trip < timeline.deal.trips, body, init)
    axis = cfg.axis
    return (axis.sum(out.loss_out).reshape(R, K), axis.sum(out.err_out).reshape(R, K))
