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

An algorithm with per-client work (:class:`ClientHooks`, fedjax's ``for_each_client``: SCAFFOLD's
control variates) gets three hooks: ``init`` when a lane starts a job (from the server state and
the client's own state, a context the job keeps, e.g. c - c_i), ``step`` on every local step
(a correction of the minibatch gradient), and ``final`` when the job ends (the client's new
state and an output, kept per job and returned besides the sums). Without hooks none of this is
traced, and the program is the plain one.

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
from deltafl_jax.privacy import clip_factor

Params = Any


def sgd_with_weight_decay(learning_rate, l2):
    """The paper's local step w <- (1 - lr l2) w - lr grad, as an optax transform."""
    return optax.chain(optax.add_decayed_weights(l2), optax.sgd(learning_rate))


class ClientHooks(NamedTuple):
    """Per-client work of an algorithm, each function for ONE job (the lanes vmap them).

    init(server_state, client_state, hyper) -> ctx: when a lane starts a job; server_state is
      the replica's algorithm state, client_state the client's own (() if it has none)
      (None: the context is None).
    step(grads, params, ctx, hyper) -> grads: on every local step, before the optimizer
      (None: the plain gradient).
    final(ctx, client_state, delta, steps, learning_rate, hyper) -> (client_state', output):
      when the job ends; delta = w_k - w_t, steps its local steps (None: nothing kept).
    """

    init: Optional[Callable] = None
    step: Optional[Callable] = None
    final: Optional[Callable] = None


class ClientInputs(NamedTuple):
    """What the hooks read, for every replica.

    server_state: pytree, leaves [R, ...]: the algorithm's state.
    client_state: pytree, leaves [R, N, ...]: every training client's own state (() if none).
    ids: [R, m] int32: the sampled clients (indices into the N training clients).
    """

    server_state: Any
    client_state: Any
    ids: jax.Array


class LocalSGDConfig(NamedTuple):
    """Static choices of LocalUpdate.

    batch_size: B. lanes: c, jobs run side by side. lane_mode: "vmap" or "unroll".
    local_penalty: the algorithm's term added to the local objective, (params, anchor, hyper)
      -> scalar (None: plain F_k).
    unroll: K, minibatch steps per loop trip (unrolled in the loop body).
    branchless: run a lane's restart and a finished job's bookkeeping on every step as
      masked selects and masked sums, instead of behind a ``lax.cond`` taken only on the
      steps that need them (a cond costs a device-to-host sync on some accelerators; on
      XLA:CPU the cond is cheaper, bench/README.md).
    """

    batch_size: int
    lanes: int
    lane_mode: str = "vmap"
    local_penalty: Optional[Callable] = None
    axis: DeviceAxis = SINGLE
    unroll: int = 1
    branchless: bool = False
    client_hooks: Optional[ClientHooks] = None
    clip: Optional[float] = None   # C: each job's update clipped to L2 norm C (client-level DP)


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
    job_state: Any = None              # [R, m, ...] the clients' new states (client hooks)
    job_output: Any = None             # [R, m, ...] the jobs' outputs (client hooks)
    job_clipped: Any = None            # [R, m] bool: the update was clipped (cfg.clip)


class Jobs(NamedTuple):
    """The J = R * m jobs of a round, replica-major."""

    replica: jax.Array  # [J] int32
    slot: jax.Array     # [J] int32, index among the m sampled clients
    weight: jax.Array   # [J] a_j
    steps: jax.Array    # [J] int32 local steps (0: not trained)


class LaneCarry(NamedTuple):
    """The while-loop state; c lanes, R replicas, J jobs. Where each lane stands is not in
    the carry: it follows from the trip number and the lanes' job schedule
    (:class:`LaneSchedule`)."""

    trip: jax.Array        # [] int32, loop trips done (each runs `unroll` steps)
    params: Params         # [c, ...] the lanes' local models
    opt_state: Any         # [c, ...] their optimizer states
    delta_sum: Params      # [R, ...]
    weight_sum: jax.Array  # [R]
    sqnorm: jax.Array      # [J]
    finite: jax.Array      # [J] bool
    real: jax.Array        # [] int32 examples trained
    ctx: Any = None        # [c, ...] the lanes' job contexts (client hooks)
    job_state: Any = None  # [J, ...] finished jobs' new client states (client hooks)
    job_output: Any = None # [J, ...] finished jobs' outputs (client hooks)
    clipped: Any = None    # [J] bool: the job's update was longer than cfg.clip


class LaneSchedule(NamedTuple):
    """Where every lane stands at steps t0 .. t0 + K - 1 (arrays [c, K], x indices [c, K, B]).

    job: the lane's job (clipped to a valid id); replica: its replica; fresh: the step is the
    job's first; done: the step is the job's last;
    ex / valid: the examples the step reads and which of them are real.
    """

    job: jax.Array
    replica: jax.Array
    fresh: jax.Array
    done: jax.Array
    ex: jax.Array
    valid: jax.Array


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
    """One minibatch step of one lane: (p, opt_state, anchor, ctx, x, y, valid, hyper) ->
    (p, st)."""
    correct = cfg.client_hooks.step if cfg.client_hooks is not None else None

    def local_objective(p, anchor, x, y, valid, hyper):
        loss = model.losses(p, x, y)
        obj = jnp.sum(jnp.where(valid, loss, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
        if cfg.local_penalty is not None:
            obj = obj + cfg.local_penalty(p, anchor, hyper)
        return obj

    def lane_step(p, opt_state, anchor, ctx, x, y, valid, hyper):
        grads = jax.grad(local_objective)(p, anchor, x, y, valid, hyper)
        if correct is not None:
            grads = correct(grads, p, ctx, hyper)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    return per_lane(lane_step, cfg.lanes, cfg.lane_mode)


class _LaneProgram:
    """The pieces of one round's training loop, with the round's constants bound.

    Lane l runs its jobs back to back from step 0: job q of the lane covers steps
    [start[l, q], start[l, q + 1]). A loop trip runs K = ``cfg.unroll`` consecutive steps,
    unrolled: it first works out the K steps' jobs and example indices at once
    (:meth:`schedule`), then runs the K SGD steps, each followed by the bookkeeping of lanes
    that finish a job there (one ``lax.cond``, taken only on those steps).
    """

    def __init__(self, model, params, X, Y, plan, replica_group, jobs, learning_rate, l2,
                 hyper, cfg, clients: Optional[ClientInputs] = None, clip=None):
        self.params, self.X, self.Y, self.plan = params, X, Y, plan
        self.group, self.jobs, self.lr, self.l2, self.hyper = (replica_group, jobs,
                                                               learning_rate, l2, hyper)
        self.c, self.B, self.J, self.K = (cfg.lanes, cfg.batch_size, jobs.steps.shape[0],
                                          max(1, cfg.unroll))
        axis = cfg.axis   # this device's c of the D x c global lanes
        self.deal = device_share(deal_jobs(jobs.steps, self.c * axis.count), axis.index(),
                                 self.c) if axis.count > 1 else deal_jobs(jobs.steps, self.c)
        lane_steps = jnp.where(self.deal.jobs < self.J,
                               jobs.steps[jnp.minimum(self.deal.jobs, self.J - 1)], 0)
        self.start = jnp.concatenate([jnp.zeros((self.c, 1), jnp.int32),
                                      jnp.cumsum(lane_steps, axis=1, dtype=jnp.int32)], axis=1)
        self.optimizer = optax.inject_hyperparams(sgd_with_weight_decay)(learning_rate=0.0,
                                                                         l2=0.0)
        self.run_step = _lane_step_fn(model, cfg, self.optimizer)
        self.penalized = cfg.local_penalty is not None
        self.branchless = cfg.branchless
        self.hooks, self.clients = cfg.client_hooks, clients
        self.clip = cfg.clip
        self.clip_r = clip   # [R] a traced clip per replica (adaptive clipping), or None

    def when(self, lanes, fn, operand):
        """fn(operand) if any lane needs it, else operand; fn is the identity on the other
        lanes, so the branchless form (always fn) gives the same values."""
        if self.branchless:
            return fn(operand)
        return lax.cond(jnp.any(lanes), fn, lambda op: op, operand)

    def fresh_opt_state(self, w0, r):
        st = jax.vmap(self.optimizer.init)(w0)
        return _set_hyperparams(st, self.lr[r], self.l2[r])

    def _lane_job(self, q):
        """Job ids [c, ...] of the lanes' q-th jobs (clipped to valid ids) and their replica."""
        Q = self.deal.jobs.shape[1]
        lane = jnp.arange(self.c).reshape((self.c,) + (1,) * (q.ndim - 1))
        js = jnp.minimum(self.deal.jobs[lane, jnp.minimum(q, Q - 1)], self.J - 1)
        return js, self.jobs.replica[js]

    def schedule(self, t0) -> LaneSchedule:
        """The lanes' jobs and minibatches at steps t0 .. t0 + K - 1. Step s of a job reads
        epoch e, batch b = divmod(s, batches_per_epoch) of its client's shuffled stream
        (see :mod:`deltafl_jax.plan`)."""
        plan, B = self.plan, self.B
        t = t0 + jnp.arange(self.K, dtype=jnp.int32)[None, :]                  # [1, K]
        q = jnp.sum(self.start[:, None, 1:] <= t[..., None], axis=-1)          # [c, K]
        active = q < self.deal.length[:, None]
        js, r = self._lane_job(q)
        s = t - jnp.take_along_axis(self.start, jnp.minimum(q, self.start.shape[1] - 1), 1)
        done = active & (s == self.jobs.steps[js] - 1)
        g, i = self.group[r], self.jobs.slot[js]
        nb, sl = plan.batches_per_epoch[g, i], plan.seg_len[g, i]
        e, b = s // nb, s % nb
        within = b[..., None] * B + jnp.arange(B, dtype=jnp.int32)
        valid = (within < sl[..., None]) & active[..., None]
        where_ = plan.train_start[g, i][..., None] + (e * sl)[..., None] + within
        ex = plan.train_idx[g[..., None], jnp.where(valid, where_, 0)]
        return LaneSchedule(job=js, replica=r, fresh=active & (s == 0), done=done, ex=ex,
                            valid=valid)

    def finish(self, carry, js, r, done):
        """Finished jobs add a_j (w_j - w_t) to their replica's sum when finite. Only the sums
        go through the ``lax.cond``: a lane model passed through it would be copied on every
        step that the cond skips."""
        c, J = self.c, self.J

        def taken(acc):
            delta_sum, weight_sum, sqnorm, finite, job_state, job_output, clipped = acc
            delta = jax.tree.map(lambda a, w: a - w, carry.params, gather_rows(self.params, r))
            slot = jnp.where(done, js, J)
            if self.clip is not None:   # client-level DP: clip before the update is summed
                delta, long_ = self.clipped_updates(delta, r)
                clipped = clipped.at[slot].set(long_, mode="drop")
            ok = jax.vmap(tree_all_finite)(delta) & done
            coef = jnp.where(ok, self.jobs.weight[js], 0.0)

            def add(total, d):
                d = jnp.where(ok.reshape((c,) + (1,) * (d.ndim - 1)), d, 0.0)
                return total.at[r].add(coef.reshape((c,) + (1,) * (d.ndim - 1)) * d)

            if job_state is not None or job_output is not None:
                job_state, job_output = self.client_final(carry.ctx, js, r, delta, slot,
                                                          job_state, job_output)
            return (jax.tree.map(add, delta_sum, delta), weight_sum.at[r].add(coef),
                    sqnorm.at[slot].set(jax.vmap(tree_sqnorm)(delta), mode="drop"),
                    finite.at[slot].set(ok, mode="drop"), job_state, job_output, clipped)

        acc = (carry.delta_sum, carry.weight_sum, carry.sqnorm, carry.finite, carry.job_state,
               carry.job_output, carry.clipped)
        acc = self.when(done, taken, acc)
        return carry._replace(delta_sum=acc[0], weight_sum=acc[1], sqnorm=acc[2],
                              finite=acc[3], job_state=acc[4], job_output=acc[5],
                              clipped=acc[6])

    def clipped_updates(self, delta, r):
        """The lanes' updates scaled to L2 norm <= C (their replica's C when the clip is per
        replica), and which were longer ([c] bool)."""
        sq = jax.vmap(tree_sqnorm)(delta)
        clip = self.clip if self.clip_r is None else self.clip_r[r]
        f = clip_factor(sq, clip)
        scaled = jax.tree.map(
            lambda d: d * f.reshape((self.c,) + (1,) * (d.ndim - 1)).astype(d.dtype), delta)
        return scaled, sq > clip * clip

    # ---------------------------------------------------------------- per-client work (hooks)

    def client_rows(self, js, r):
        """The own state [c, ...] of the lanes' jobs' clients."""
        cid = self.clients.ids[r, self.jobs.slot[js]]
        return jax.tree.map(lambda a: a[r, cid], self.clients.client_state)

    def contexts(self, js, r):
        """hooks.init for the lanes' jobs js (replicas r): the contexts [c, ...]."""
        return jax.vmap(self.hooks.init)(gather_rows(self.clients.server_state, r),
                                         self.client_rows(js, r), gather_rows(self.hyper, r))

    def final_args(self, ctx, js, r, delta):
        return (ctx, self.client_rows(js, r), delta, self.jobs.steps[js], self.lr[r],
                gather_rows(self.hyper, r))

    def client_final(self, ctx, js, r, delta, slot, job_state, job_output):
        """hooks.final of the lanes whose job ends (slot < J; the others are dropped)."""
        new_state, output = jax.vmap(self.hooks.final)(*self.final_args(ctx, js, r, delta))

        def put(buf, v):
            return buf.at[slot].set(v.astype(buf.dtype), mode="drop")
        return jax.tree.map(put, job_state, new_state), jax.tree.map(put, job_output, output)

    def job_buffers(self, ctx, js, r):
        """Zeros [J, ...] for hooks.final's two results (None without a final hook)."""
        if self.hooks is None or self.hooks.final is None:
            return None, None
        shapes = jax.eval_shape(jax.vmap(self.hooks.final),
                                *self.final_args(ctx, js, r, gather_rows(self.params, r)))
        return jax.tree.map(lambda s: jnp.zeros((self.J,) + s.shape[1:], s.dtype), shapes)

    def restart(self, carry, fresh, js, r):
        """Lanes starting a job restart from w_t of its replica, with a fresh optimizer (and
        the job's context, with client hooks)."""
        def taken(lane):
            params, opt_state, ctx = lane
            w0 = gather_rows(self.params, r)
            if self.hooks is not None and self.hooks.init is not None:
                ctx = select_tree(fresh, self.contexts(js, r), ctx)
            return (select_tree(fresh, w0, params),
                    select_tree(fresh, self.fresh_opt_state(w0, r), opt_state), ctx)

        params, opt_state, ctx = self.when(fresh, taken,
                                           (carry.params, carry.opt_state, carry.ctx))
        return carry._replace(params=params, opt_state=opt_state, ctx=ctx)

    def step(self, carry, sch: LaneSchedule, x, y, k: int) -> LaneCarry:
        """Step k of the trip. A lane with no job left steps on garbage: its model is never
        read again (it is restarted before any next job, and it has none)."""
        r, done = sch.replica[:, k], sch.done[:, k]
        carry = self.restart(carry, sch.fresh[:, k], sch.job[:, k], r)
        # w_t of the lane's job, for the algorithm's local penalty (FedProx's anchor).
        anchor = gather_rows(self.params, r) if self.penalized else carry.params
        params, opt_state = self.run_step(carry.params, carry.opt_state, anchor, carry.ctx,
                                          x[:, k], y[:, k], sch.valid[:, k],
                                          gather_rows(self.hyper, r))
        return self.finish(carry._replace(params=params, opt_state=opt_state), sch.job[:, k],
                           r, done)

    def body(self, carry: LaneCarry) -> LaneCarry:
        sch = self.schedule(carry.trip * self.K)
        x, y = jnp.take(self.X, sch.ex, axis=0), jnp.take(self.Y, sch.ex, axis=0)
        for k in range(self.K):
            carry = self.step(carry, sch, x, y, k)
        return carry._replace(trip=carry.trip + 1, real=carry.real + jnp.sum(sch.valid))

    def init(self) -> LaneCarry:
        """Every lane starts at w_t of its first job's replica."""
        R = self.lr.shape[0]
        js0, r0 = self._lane_job(jnp.zeros((self.c,), jnp.int32))
        w0 = gather_rows(self.params, r0)
        ctx = (self.contexts(js0, r0) if self.hooks is not None and self.hooks.init is not None
               else None)
        job_state, job_output = self.job_buffers(ctx, js0, r0)
        return LaneCarry(
            trip=jnp.int32(0), params=w0, opt_state=self.fresh_opt_state(w0, r0),
            delta_sum=jax.tree.map(jnp.zeros_like, self.params),
            weight_sum=jnp.zeros((R,), jnp.float32), sqnorm=jnp.zeros((self.J,), jnp.float32),
            finite=jnp.zeros((self.J,), bool), real=jnp.int32(0), ctx=ctx,
            job_state=job_state, job_output=job_output,
            clipped=jnp.zeros((self.J,), bool) if self.clip is not None else None)


def train_jobs(model: Model, params, *, X, Y, plan, replica_group, job_weight, learning_rate,
               l2, hyper, cfg: LocalSGDConfig, clients: Optional[ClientInputs] = None,
               clip=None) -> TrainResult:
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
      clients: what ``cfg.client_hooks`` read (required with hooks).
      clip: [R] each replica's clip, traced (adaptive clipping), instead of ``cfg.clip``
        (which must then be set).

    ``trips`` counts minibatch steps of the busiest lane (the critical path); the loop runs
    ceil(trips / cfg.unroll) trips, and ``padded_examples`` counts trips * lanes * batch (the
    last loop trip may run up to unroll - 1 more steps with every lane idle).
    """
    R, m = job_weight.shape
    jobs = make_jobs(plan, replica_group, job_weight)
    if (cfg.client_hooks is None) != (clients is None):
        raise ValueError("client hooks and their inputs go together")
    prog = _LaneProgram(model, params, X, Y, plan, replica_group, jobs, learning_rate, l2,
                        hyper, cfg, clients, clip)
    trips = prog.deal.trips
    loop_trips = (trips + prog.K - 1) // prog.K
    out = lax.while_loop(lambda cr: cr.trip < loop_trips, prog.body, prog.init())
    axis = cfg.axis   # one reduction of the devices' partial sums, after the loop

    def per_job(tree):   # [J, ...] partial per device -> [R, m, ...]
        return jax.tree.map(lambda a: a.reshape((R, m) + a.shape[1:]), axis.sum(tree))

    return TrainResult(delta_sum=axis.sum(out.delta_sum), weight_sum=axis.sum(out.weight_sum),
                       job_sqnorm=axis.sum(out.sqnorm).reshape(R, m),
                       job_finite=axis.sum(out.finite.astype(jnp.int32)).reshape(R, m) > 0,
                       job_trained=(jobs.steps > 0).reshape(R, m),
                       real_examples=axis.sum(out.real),
                       padded_examples=axis.sum(trips * cfg.lanes * cfg.batch_size),
                       trips=axis.max(trips), device_trips=axis.spread(trips),
                       device_jobs=axis.spread(jnp.sum(prog.deal.length)),
                       device_examples=axis.spread(out.real),
                       job_state=None if out.job_state is None else per_job(out.job_state),
                       job_output=None if out.job_output is None else per_job(out.job_output),
                       job_clipped=None if out.clipped is None else
                       per_job(out.clipped.astype(jnp.int32)) > 0)
