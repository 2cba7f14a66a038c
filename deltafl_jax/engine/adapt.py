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


class AdaptBlock(NamedTuple):
    """One block of K clients: its examples and their index streams."""

    x: Any            # [n, ...] the block's examples (adaptation and held-out)
    y: Any            # [n] their labels
    plan: AdaptPlan   # the streams into x, y (device arrays)


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


class _AdaptProgram:
    """The loop's pieces with the block's constants bound (J = R K jobs, c lanes)."""

    def __init__(self, model, params, block: AdaptBlock, hyper, learning_rate, l2, cfg, clients):
        plan = block.plan
        self.model, self.params, self.X, self.Y, self.plan = (model, params, block.x, block.y,
                                                              plan)
        self.hyper, self.lr, self.l2, self.cfg = hyper, learning_rate, l2, cfg
        self.clients = clients if clients is not None else ClientInputs((), (), None)
        R = jax.tree.leaves(params)[0].shape[0]
        K = plan.ids.shape[0]
        self.R, self.K, self.J, self.B, self.c = R, K, R * K, cfg.batch_size, cfg.lanes
        self.replica = jnp.repeat(jnp.arange(R, dtype=jnp.int32), K)
        self.slot = jnp.tile(jnp.arange(K, dtype=jnp.int32), R)
        self.n_train = jnp.where(plan.real, plan.train_steps, 0)[self.slot]
        steps = jnp.where(plan.real[self.slot], self.n_train + plan.eval_steps[self.slot], 0)
        self.timeline = LaneTimeline(steps.astype(jnp.int32), self.c, cfg.axis)
        self.adapt = cfg.adapt_step or fine_tune_step
        self.run_train = per_lane(self._train_one, self.c, cfg.lane_mode)
        self.run_eval = per_lane(self._eval_one, self.c, cfg.lane_mode)

    def _job(self, r, n):
        return ClientJob(optimizer=self.cfg.optimizer(self.lr[r], self.l2[r]),
                         learning_rate=self.lr[r], l2=self.l2[r], steps=n)

    def start_one(self, r, i):
        """AdaptState of job (r, i): from the model served to the client."""
        w = gather_rows(self.params, r)
        start = w
        if self.cfg.seen and self.cfg.client_model is not None:
            own = jax.tree.map(lambda a: a[r, self.plan.ids[i]], self.clients.client_state)
            start = self.cfg.client_model(gather_rows(self.clients.server_state, r), own, w,
                                          gather_rows(self.hyper, r))
        opt = self._job(r, 0).optimizer.init(start) if self.cfg.train else ()
        return AdaptState(params=start, opt_state=opt, anchor=w)

    def _train_one(self, state, x, y, valid, r, n):
        grad_fn = minibatch_grad_fn(self.model, x, y, valid)
        return self.adapt(state, grad_fn, gather_rows(self.hyper, r), self._job(r, n))

    def _eval_one(self, p, x, y, valid):
        loss, err = self.model.losses_and_errors(p, x, y)
        return (jnp.sum(jnp.where(valid, loss, 0.0)), jnp.sum(jnp.where(valid, err, 0.0)))

    def when(self, lanes, fn, operand):
        if self.cfg.branchless:
            return fn(operand)
        return lax.cond(jnp.any(lanes), fn, lambda o: o, operand)

    def batch(self, js, s, active):
        """The lanes' minibatches at this step: adaptation examples while s < train steps,
        then held-out ones. (training [c], x [c, B, ...], y [c, B], valid [c, B])."""
        plan, B = self.plan, self.B
        i = self.slot[js]
        offs = jnp.arange(B, dtype=jnp.int32)
        training = active & (s < self.n_train[js])
        u = jnp.where(training, s, s - self.n_train[js])[:, None] * B + offs   # in the stream
        limit = jnp.where(training, plan.adapt_len[i], plan.held_len[i])
        valid = active[:, None] & (u < limit[:, None])
        adapting = valid & training[:, None]
        stream = jnp.where(training[:, None],
                           plan.adapt_idx[jnp.where(adapting, plan.adapt_start[i][:, None] + u, 0)],
                           plan.held_idx[jnp.where(valid & ~adapting,
                                                   plan.held_start[i][:, None] + u, 0)])
        return training, jnp.take(self.X, stream, axis=0), jnp.take(self.Y, stream, axis=0), valid

    def body(self, carry: AdaptCarry) -> AdaptCarry:
        js, s, active, fresh, done = (a[:, 0] for a in self.timeline.at(carry.trip[None, None]))
        r, i = self.replica[js], self.slot[js]
        training, x, y, valid = self.batch(js, s, active)
        state = self.when(fresh, lambda st: select_tree(
            fresh, jax.vmap(self.start_one)(r, i), st), carry.state)
        if self.cfg.train:
            state = self.when(training, lambda st: select_tree(
                training, self.run_train(st, x, y, valid, r, self.n_train[js]), st), state)
        evaluating = active & ~training
        zeros = jnp.zeros((self.c,), jnp.float32)
        ls, es = self.when(evaluating, lambda _: self.run_eval(
            state.params, x, y, valid & evaluating[:, None]), (zeros, zeros))
        loss = jnp.where(fresh, 0.0, carry.loss) + ls
        err = jnp.where(fresh, 0.0, carry.err) + es
        out = jnp.where(done, js, self.J)
        return AdaptCarry(trip=carry.trip + 1, state=state, loss=loss, err=err,
                          loss_out=carry.loss_out.at[out].set(loss, mode="drop"),
                          err_out=carry.err_out.at[out].set(err, mode="drop"),
                          real=carry.real + jnp.sum(valid))

    def init(self) -> AdaptCarry:
        js0 = self.timeline.job_of(jnp.zeros((self.c,), jnp.int32))
        zeros_c, zeros_j = jnp.zeros((self.c,), jnp.float32), jnp.zeros((self.J,), jnp.float32)
        return AdaptCarry(trip=jnp.int32(0),
                          state=jax.vmap(self.start_one)(self.replica[js0], self.slot[js0]),
                          loss=zeros_c, err=zeros_c, loss_out=zeros_j, err_out=zeros_j,
                          real=jnp.int32(0))


def adapt_and_evaluate(model: Model, params, block: AdaptBlock, hyper, learning_rate, l2,
                       cfg: AdaptConfig, clients: Optional[ClientInputs] = None):
    """(loss_sum, error_sum), each [R, K] float32, over every client's held-out examples, of
    the model each replica served it, after its adaptation steps (module docstring).

    Args:
      params: pytree, leading dim R: the served global models.
      block: the block's examples and its :class:`AdaptPlan` (:class:`AdaptBlock`).
      hyper: the algorithm's hyper-parameters, leaves [R]; learning_rate, l2: [R] of the
        adaptation steps.
      clients: the algorithm's state [R, ...] and the training clients' own states
        [R, N, ...] (``ids`` unused: the plan's ids are the clients), for `cfg.seen`.
    """
    prog = _AdaptProgram(model, params, block, hyper, learning_rate, l2, cfg, clients)
    out = lax.while_loop(lambda cr: cr.trip < prog.timeline.deal.trips, prog.body, prog.init())
    axis = cfg.axis
    return (axis.sum(out.loss_out).reshape(prog.R, prog.K),
            axis.sum(out.err_out).reshape(prog.R, prog.K))
