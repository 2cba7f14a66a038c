"""LocalUpdate (Algorithm 2, lines 7-8) for every kept (replica, client) job, in one jitted loop.

Jobs are the (replica, client) pairs whose aggregation weight is positive; a job that the
filter dropped costs nothing. :func:`deltafl_jax.engine.lanes.deal_jobs` deals the jobs to
``lanes`` lanes; each lane runs its jobs back to back (resetting to w_t at each job start),
one minibatch step per trip of a ``lax.while_loop`` that stops when the busiest lane is done.
Finished jobs add a_j (w_j - w_t) to their replica's sum (if finite), which the server update
then averages.

The local step is w <- (1 - gamma lambda) w - gamma grad (paper, App. C.2.2), an optax chain
built ONCE with ``optax.inject_hyperparams``: the learning rate and lambda of the job's replica
are optimizer state, set when a lane starts a job.

Nothing here is jitted: the caller jits the round once (see :mod:`deltafl_jax.rounds`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from deltafl_jax.engine.lanes import deal_jobs, device_share, per_lane
from deltafl_jax.engine.mesh import SINGLE, DeviceAxis
from deltafl_jax.engine.trees import gather_rows, select_tree, tree_all_finite, tree_sqnorm
from deltafl_jax.models import Model

Params = Any


def sgd_with_weight_decay(learning_rate, l2):
    """The paper's local step w <- (1 - lr l2) w - lr grad, as an optax transform."""
    return optax.chain(optax.add_decayed_weights(l2), optax.sgd(learning_rate))


class LocalSGDConfig(NamedTuple):
    """Static choices of LocalUpdate.

    batch_size: B. lanes: c, jobs run side by side. lane_mode: "vmap" or "unroll".
    local_penalty: the algorithm's term added to the local objective, (params, anchor, hyper)
      -> scalar (None: plain F_k).
    """

    batch_size: int
    lanes: int
    lane_mode: str = "vmap"
    local_penalty: Optional[Callable] = None
    axis: DeviceAxis = SINGLE


class TrainResult(NamedTuple):
    delta_sum: Params        # [R, ...] sum over finished, finite jobs of a_j (w_j - w_r)
    weight_sum: jax.Array    # [R] sum of a_j over the same jobs
    job_sqnorm: jax.Array    # [R, m] ||w_j - w_r||^2 of each finished job (0 if not trained)
    job_finite: jax.Array    # [R, m] bool: the job finished and its update is finite
    job_trained: jax.Array   # [R, m] bool: the job ran
    real_examples: jax.Array    # scalar: examples that went through local SGD
    padded_examples: jax.Array  # scalar: example slots computed (trips * lanes * batch)
    trips: jax.Array            # scalar: loop iterations (the busiest device's)
    device_trips: jax.Array = None     # [D] each device's loop iterations
    device_jobs: jax.Array = None      # [D] each device's jobs
    device_examples: jax.Array = None  # [D] each device's trained examples


class Jobs(NamedTuple):
    """The J = R * m jobs of a round, replica-major."""

    replica: jax.Array  # [J] int32
    slot: jax.Array     # [J] int32, index among the m sampled clients
    weight: jax.Array   # [J] a_j
    steps: jax.Array    # [J] int32 local steps (0: not trained)


class LaneCarry(NamedTuple):
    """The while-loop state; c lanes, R replicas, J jobs."""

    trip: jax.Array        # [] int32
    slot: jax.Array        # [c] int32, position in the lane's job list
    step: jax.Array        # [c] int32, step within the current job
    params: Params         # [c, ...] the lanes' local models
    opt_state: Any         # [c, ...] their optimizer states
    anchor: Params         # [c, ...] w_t of the current job's replica
    delta_sum: Params      # [R, ...]
    weight_sum: jax.Array  # [R]
    sqnorm: jax.Array      # [J]
    finite: jax.Array      # [J] bool
    real: jax.Array        # [] int32 examples trained


def make_jobs(plan, replica_group, job_weight) -> Jobs:
    R, m = job_weight.shape
    weight = job_weight.reshape(R * m)
    replica = jnp.repeat(jnp.arange(R, dtype=jnp.int32), m)
    slot = jnp.tile(jnp.arange(m, dtype=jnp.int32), R)
    steps = jnp.where(weight > 0, plan.steps[replica_group[replica], slot], 0).astype(jnp.int32)
    return Jobs(replica=replica, slot=slot, weight=weight, steps=steps)


def _set_hyperparams(opt_state, learning_rate, l2):
    return opt_state._replace(hyperparams={"learning_rate": learning_rate, "l2": l2})


def _lane_step_fn(model: Model, cfg: LocalSGDConfig, optimizer):
    """One minibatch step of one lane: (p, opt_state, anchor, x, y, valid, hyper) -> (p, st)."""
    def local_objective(p, anchor, x, y, valid, hyper):
        loss = model.losses(p, x, y)
        obj = jnp.sum(jnp.where(valid, loss, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
        if cfg.local_penalty is not None:
            obj = obj + cfg.local_penalty(p, anchor, hyper)
        return obj

    def lane_step(p, opt_state, anchor, x, y, valid, hyper):
        grads = jax.grad(local_objective)(p, anchor, x, y, valid, hyper)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    return per_lane(lane_step, cfg.lanes, cfg.lane_mode)


class _LaneProgram:
    """The pieces of one round's training loop, with the round's constants bound."""

    def __init__(self, model, params, X, Y, plan, replica_group, jobs, learning_rate, l2,
                 hyper, cfg):
        self.params, self.X, self.Y, self.plan = params, X, Y, plan
        self.group, self.jobs, self.lr, self.l2, self.hyper = (replica_group, jobs,
                                                               learning_rate, l2, hyper)
        self.c, self.B, self.J = cfg.lanes, cfg.batch_size, jobs.steps.shape[0]
        axis = cfg.axis
        self.deal = device_share(deal_jobs(jobs.steps, self.c * axis.count), axis.index(),
                                 self.c) if axis.count > 1 else deal_jobs(jobs.steps, self.c)
        self.optimizer = optax.inject_hyperparams(sgd_with_weight_decay)(learning_rate=0.0,
                                                                         l2=0.0)
        self.run_step = _lane_step_fn(model, cfg, self.optimizer)

    def fresh_opt_state(self, w0, r):
        st = jax.vmap(self.optimizer.init)(w0)
        return _set_hyperparams(st, self.lr[r], self.l2[r])

    def current(self, carry):
        """Each lane's job (clipped to a valid id), its replica, and whether it is active."""
        Q = self.deal.jobs.shape[1]
        j = self.deal.jobs[jnp.arange(self.c), jnp.minimum(carry.slot, Q - 1)]
        js = jnp.minimum(j, self.J - 1)
        return js, self.jobs.replica[js], carry.slot < self.deal.length

    def reset(self, carry, r, fresh):
        """Lanes starting a job restart from w_t of its replica, with a fresh optimizer."""
        w0 = gather_rows(self.params, r)
        return carry._replace(
            params=select_tree(fresh, w0, carry.params),
            anchor=select_tree(fresh, w0, carry.anchor),
            opt_state=select_tree(fresh, self.fresh_opt_state(w0, r), carry.opt_state))

    def minibatch(self, carry, js, r, active):
        """Step s of a job reads epoch e, batch b = divmod(s, batches_per_epoch) of its
        client's shuffled stream (see :mod:`deltafl_jax.plan`)."""
        plan, B = self.plan, self.B
        g, i, s = self.group[r], self.jobs.slot[js], carry.step
        nb, sl = plan.batches_per_epoch[g, i], plan.seg_len[g, i]
        e, b = s // nb, s % nb
        within = b[:, None] * B + jnp.arange(B, dtype=jnp.int32)[None, :]
        valid = (within < sl[:, None]) & active[:, None]
        where_ = plan.train_start[g, i][:, None] + e[:, None] * sl[:, None] + within
        ex = plan.train_idx[g[:, None], jnp.where(valid, where_, 0)]
        return jnp.take(self.X, ex, axis=0), jnp.take(self.Y, ex, axis=0), valid

    def finish(self, carry, js, r, done):
        """Finished jobs add a_j (w_j - w_t) to their replica's sum when finite."""
        c, J = self.c, self.J
        delta = jax.tree.map(lambda a, w: a - w, carry.params, carry.anchor)
        ok = jax.vmap(tree_all_finite)(delta) & done
        coef = jnp.where(ok, self.jobs.weight[js], 0.0)

        def add(total, d):
            d = jnp.where(ok.reshape((c,) + (1,) * (d.ndim - 1)), d, 0.0)
            return total.at[r].add(coef.reshape((c,) + (1,) * (d.ndim - 1)) * d)

        slot = jnp.where(done, js, J)
        return carry._replace(
            delta_sum=jax.tree.map(add, carry.delta_sum, delta),
            weight_sum=carry.weight_sum.at[r].add(coef),
            sqnorm=carry.sqnorm.at[slot].set(jax.vmap(tree_sqnorm)(delta), mode="drop"),
            finite=carry.finite.at[slot].set(ok, mode="drop"))

    def body(self, carry: LaneCarry) -> LaneCarry:
        js, r, active = self.current(carry)
        fresh = active & (carry.step == 0)
        carry = lax.cond(jnp.any(fresh), lambda cr: self.reset(cr, r, fresh), lambda cr: cr,
                         carry)
        x, y, valid = self.minibatch(carry, js, r, active)
        new_p, new_opt = self.run_step(carry.params, carry.opt_state, carry.anchor, x, y, valid,
                                       gather_rows(self.hyper, r))
        carry = carry._replace(params=select_tree(active, new_p, carry.params),
                               opt_state=select_tree(active, new_opt, carry.opt_state))
        done = active & (carry.step == self.jobs.steps[js] - 1)
        carry = lax.cond(jnp.any(done), lambda cr: self.finish(cr, js, r, done), lambda cr: cr,
                         carry)
        return carry._replace(
            trip=carry.trip + 1, slot=jnp.where(done, carry.slot + 1, carry.slot),
            step=jnp.where(done, 0, jnp.where(active, carry.step + 1, carry.step)),
            real=carry.real + jnp.sum(valid))

    def init(self) -> LaneCarry:
        c, R = self.c, self.lr.shape[0]
        lane_params = jax.tree.map(lambda a: jnp.zeros((c,) + a.shape[1:], a.dtype),
                                   self.params)
        zero_lane = jnp.zeros((c,), jnp.int32)
        return LaneCarry(
            trip=jnp.int32(0), slot=zero_lane, step=zero_lane, params=lane_params,
            opt_state=self.fresh_opt_state(lane_params, zero_lane), anchor=lane_params,
            delta_sum=jax.tree.map(jnp.zeros_like, self.params),
            weight_sum=jnp.zeros((R,), jnp.float32), sqnorm=jnp.zeros((self.J,), jnp.float32),
            finite=jnp.zeros((self.J,), bool), real=jnp.int32(0))


def train_jobs(model: Model, params, X, Y, plan, replica_group, job_weight, learning_rate,
               l2, hyper, cfg: LocalSGDConfig) -> TrainResult:
    """LocalUpdate for every job (r, i) with job_weight[r, i] > 0, and the weighted sums.

    Args:
      params: pytree, leading dim R: w_t of each replica.
      X, Y: the device-resident training split.
      plan: the round's :class:`deltafl_jax.plan.RoundPlan` (device arrays, [G, ...]).
      replica_group: [R] group (seed) of each replica.
      job_weight: [R, m] aggregation weight a_{r,i}; 0 means the client does not train.
      learning_rate, l2: [R] per-replica values for this round.
      hyper: the algorithm's hyper pytree, leaves [R] (for its local penalty).
      cfg: static choices.
    """
    R, m = job_weight.shape
    jobs = make_jobs(plan, replica_group, job_weight)
    prog = _LaneProgram(model, params, X, Y, plan, replica_group, jobs, learning_rate, l2,
                        hyper, cfg)
    trips = prog.deal.trips
    out = lax.while_loop(lambda cr: cr.trip < trips, prog.body, prog.init())
    axis = cfg.axis   # one reduction of the devices' partial sums, after the loop
    return TrainResult(delta_sum=axis.sum(out.delta_sum), weight_sum=axis.sum(out.weight_sum),
                       job_sqnorm=axis.sum(out.sqnorm).reshape(R, m),
                       job_finite=axis.sum(out.finite.astype(jnp.int32)).reshape(R, m) > 0,
                       job_trained=(jobs.steps > 0).reshape(R, m), real_examples=axis.sum(out.real),
                       padded_examples=axis.sum(trips * cfg.lanes * cfg.batch_size),
                       trips=axis.max(trips), device_trips=axis.spread(trips),
                       device_jobs=axis.spread(jnp.sum(prog.deal.length)),
                       device_examples=axis.spread(out.real))
