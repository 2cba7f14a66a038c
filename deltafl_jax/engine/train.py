"""LocalUpdate (Algorithm 2, lines 7-8) for every kept (replica, client) job, in one jitted loop.

Jobs are the (replica, client) pairs whose aggregation weight is positive (or every sampled
client, for an algorithm whose clients all work: ``JobChoice.runs``); a job that
the filter dropped costs nothing. :func:`deltafl_jax.engine.lanes.deal_jobs` deals the jobs to
``lanes`` lanes; each lane runs its jobs back to back, one minibatch step per trip of a
``lax.while_loop`` that stops when the busiest lane is done. A finished job keeps a_j u_j
(0 if not finite) in its row of its device's [lanes x Q, ...] slot table; after the loop each
replica's sum, which the server update then averages, adds its jobs one at a time in the order
in which they would finish were the replica dealt alone to the lanes
(:func:`~deltafl_jax.engine.lanes.finish_order`,
:func:`~deltafl_jax.engine.lanes.device_ordered_sum`): the sum of a replica depends on its own
jobs only, neither on the other replicas of its program nor on the number of devices.

What a client does is its algorithm's :class:`~deltafl_jax.engine.client.ClientUpdate`
(fedjax's ``for_each_client``): when a lane starts a job it calls ``init`` (from w_t of the
job's replica, or from the job's own base version among its replica's kept versions under
buffered asynchronous aggregation: :attr:`JobChoice.base`; the algorithm's state and the
client's own state) and carries the returned step state; each step calls ``step`` with
the step's minibatch gradient function; when the job ends ``final`` gives the client's new
state, its update u_j (w_j - w_t for the averaging methods) and an output, kept per job and
returned besides the sums. The default,
:data:`~deltafl_jax.engine.client.LOCAL_SGD`, is the papers' local SGD: with the default
client optimizer the step is w <- (1 - gamma lambda) w - gamma grad (App. C.2.2). The client
optimizer is built inside the step from the job's replica's learning rate and lambda of the
round (traced values), so one program serves every replica.

Nothing here is jitted: the caller jits the round once (see :mod:`deltafl_jax.rounds`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

import jax
import jax.numpy as jnp
import optax
from jax import lax

from deltafl_jax.engine.client import LOCAL_SGD, ClientJob, ClientUpdate
from deltafl_jax.engine.lanes import (LaneTimeline, device_ordered_sum, finish_order, per_lane,
                                      slot_blocks, slot_tables)
from deltafl_jax.engine.mesh import SINGLE, DeviceAxis
from deltafl_jax.engine.trees import gather_rows, select_tree, tree_all_finite, tree_sqnorm
from deltafl_jax.models import Model
from deltafl_jax.optimizers.client import ClientOptimizer
from deltafl_jax.privacy.dp import clip_factor

Params = Any


class ClientInputs(NamedTuple):
    """What the client updates read, for every replica.

    server_state: pytree, leaves [R, ...]: the algorithm's state.
    client_state: pytree, leaves [R, N, ...]: every training client's own state (() if none).
    ids: [R, m] int32: the sampled clients (indices into the N training clients).
    """

    server_state: Any
    client_state: Any
    ids: Optional[jax.Array]


class LocalSGDConfig(NamedTuple):
    """Static choices of LocalUpdate.

    batch_size: B. lanes: c, jobs run side by side. lane_mode: "vmap" or "unroll".
    client_update: the algorithm's :class:`ClientUpdate` (default: local SGD).
    optimizer: (learning_rate, l2) -> the client optimizer, an optax transformation
      (:meth:`deltafl_jax.optimizers.client.ClientOptimizer.transformation`).
    augment: ``(x [B, ...], key) -> x``, a random transformation of each step's raw minibatch
      (``--augment``, :mod:`deltafl_jax.models.augment`) with the step's key
      ``fold_in(fold_in(round key, client), local step)``; None: the minibatch as stored.
    unroll: K, minibatch steps per loop trip (unrolled in the loop body).
    order_lanes: the lanes by which each replica's sum is ordered (its jobs' order of
      finishing were it dealt alone to that many lanes, :func:`finish_order`); None: ``lanes``.
      The same for every device count, so that the sums do not depend on it.
    branchless: run a lane's restart and a finished job's bookkeeping on every step as
      masked selects and masked sums, instead of behind a ``lax.cond`` taken only on the
      steps that need them (a cond costs a device-to-host sync on some accelerators; on
      XLA:CPU the cond is cheaper, bench/README.md).
    """

    batch_size: int
    lanes: int
    lane_mode: str = "vmap"
    axis: DeviceAxis = SINGLE
    unroll: int = 1
    branchless: bool = False
    order_lanes: Optional[int] = None
    clip: Optional[float] = None   # C: each job's update clipped to L2 norm C (client-level DP)
    client_update: ClientUpdate = LOCAL_SGD
    optimizer: Callable[[Any, Any], optax.GradientTransformation] = \
        ClientOptimizer().transformation
    augment: Optional[Callable] = None


class RoundData(Protocol):
    """The round's training data as the engine reads it (a
    :class:`deltafl_jax.sampling.plan.RoundData`)."""

    @property
    def x(self) -> jax.Array: ...      # [N, ...] the device-resident training inputs

    @property
    def y(self) -> jax.Array: ...      # [N] their labels

    @property
    def plan(self) -> Any: ...         # the round's RoundPlan (device arrays, [G, ...])


class ReplicaRound(NamedTuple):
    """Each replica's values for this round (R replicas; traced, so one program serves all)."""

    group: jax.Array                 # [R] int32, the group (seed) of each replica
    learning_rate: jax.Array         # [R] the client learning rate gamma of the round
    l2: jax.Array                    # [R] lambda
    hyper: Any                       # the algorithm's hyper pytree, leaves [R]
    keys: Optional[jax.Array] = None  # [R] round keys (ClientJob.key); None: a fixed key
    clip: Optional[jax.Array] = None  # [R] each replica's clip C (adaptive clipping), else
    #                                   None: the static ``LocalSGDConfig.clip``


class JobChoice(NamedTuple):
    """Which (replica, sampled client) jobs train this round, with what weight, from where."""

    weight: jax.Array                # [R, m] aggregation weight a_{r,i}; 0: does not train
    runs: Optional[jax.Array] = None  # [R, m] bool, the jobs that train (None: weight > 0);
    #   a job that trains with weight 0 adds nothing to the sums, its client's state is updated
    base: Optional[jax.Array] = None  # [R, m] int32, each job's starting model among V
    #   versions per replica, params then having leaves [R, V, ...] (buffered asynchronous
    #   aggregation); None: every job starts from its replica's params [R, ...]


class TrainResult(NamedTuple):
    delta_sum: Params        # [R, ...] sum over finished, finite jobs of a_j u_j
    weight_sum: jax.Array    # [R] sum of a_j over the same jobs
    job_sqnorm: jax.Array    # [R, m] ||u_j||^2 of each finished job (0 if not trained)
    job_finite: jax.Array    # [R, m] bool: the job finished and its update is finite
    job_trained: jax.Array   # [R, m] bool: the job ran
    real_examples: jax.Array    # scalar: examples that went through local SGD
    padded_examples: jax.Array  # scalar: example slots computed (trips * lanes * batch)
    trips: jax.Array            # scalar: loop iterations (the busiest device's)
    device_trips: Optional[jax.Array] = None     # [D] each device's loop iterations
    device_jobs: Optional[jax.Array] = None      # [D] each device's jobs
    device_examples: Optional[jax.Array] = None  # [D] each device's trained examples
    job_state: Any = None              # [R, m, ...] the clients' new states (empty: none)
    job_output: Any = None             # [R, m, ...] the jobs' outputs (empty: none)
    job_clipped: Any = None            # [R, m] bool: the update was clipped (cfg.clip)
    tables: Any = None   # (update, weight): this device's slot tables after the loop [D, S, k]


class Jobs(NamedTuple):
    """The J = R * m jobs of a round, replica-major."""

    replica: jax.Array  # [J] int32
    slot: jax.Array     # [J] int32, index among the m sampled clients
    weight: jax.Array   # [J] a_j
    steps: jax.Array    # [J] int32 local steps (0: not trained)


class LaneCarry(NamedTuple):
    """The while-loop state; c lanes, R replicas, J jobs, S = this device's slots
    (:class:`LaneTimeline`). Where each lane stands is not in the carry: it follows from the
    trip number and the lanes' job schedule (:class:`LaneSchedule`)."""

    trip: jax.Array        # [] int32, loop trips done (each runs `unroll` steps)
    step: Any              # [c, ...] the lanes' step states (the client update's own)
    update: Params         # [D, S, k] a_j u_j of each finished, finite job (else 0), by slot
    weight: jax.Array      # [D, S, 1] a_j of the same jobs (D blocks per row: slot_tables)
    sqnorm: jax.Array      # [J]
    finite: jax.Array      # [J] bool
    real: jax.Array        # [] int32 examples trained
    job_state: Any = None  # [J, ...] finished jobs' new client states
    job_output: Any = None # [J, ...] finished jobs' outputs
    clipped: Any = None    # [J] bool: the job's update was longer than cfg.clip


class LaneSchedule(NamedTuple):
    """Where every lane stands at steps t0 .. t0 + K - 1 (arrays [c, K], x indices [c, K, B]).

    job: the lane's job (clipped to a valid id); replica: its replica; fresh: the step is the
    job's first; done: the step is the job's last; local_step: the step's index within its job;
    ex / valid: the examples the step reads and which of them are real.
    """

    job: jax.Array
    replica: jax.Array
    fresh: jax.Array
    done: jax.Array
    ex: jax.Array
    valid: jax.Array
    local_step: Optional[jax.Array] = None


def make_jobs(plan, replica_group, job_weight, runs=None) -> Jobs:
    """The round's jobs; job (r, i) trains when job_weight[r, i] > 0, or where `runs` [R, m]
    is set when given (an algorithm whose every sampled client works)."""
    R, m = job_weight.shape
    weight = job_weight.reshape(R * m)
    runs = weight > 0 if runs is None else runs.reshape(R * m)
    replica = jnp.repeat(jnp.arange(R, dtype=jnp.int32), m)
    slot = jnp.tile(jnp.arange(m, dtype=jnp.int32), R)
    steps = jnp.where(runs, plan.steps[replica_group[replica], slot], 0).astype(jnp.int32)
    return Jobs(replica=replica, slot=slot, weight=weight, steps=steps)


def masked_mean_loss(model: Model, params, x, y, valid):
    """The mean loss over the real examples of a minibatch (0 when none is real)."""
    loss = model.losses(params, x, y)
    return jnp.sum(jnp.where(valid, loss, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def minibatch_grad_fn(model: Model, x, y, valid):
    """grad_fn(p) -> (loss, gradient) of the masked minibatch mean loss at p."""
    return jax.value_and_grad(lambda p: masked_mean_loss(model, p, x, y, valid))


class _LaneProgram:
    """The pieces of one round's training loop, with the round's constants bound.

    Lane l runs its jobs back to back from step 0 (:class:`LaneTimeline`). A loop trip runs K = ``cfg.unroll`` consecutive steps,
    unrolled: it first works out the K steps' jobs and example indices at once
    (:meth:`schedule`), then runs the K steps, each followed by the bookkeeping of lanes
    that finish a job there (one ``lax.cond``, taken only on those steps).
    """

    def __init__(self, model, params, data: RoundData, replicas: ReplicaRound,
                 choice: JobChoice, cfg, clients: Optional[ClientInputs] = None):
        self.model = model
        # [R, m] each job's version in params' [R, V, ...] leaves, or None
        self.base = choice.base
        learning_rate, keys = replicas.learning_rate, replicas.keys
        jobs = make_jobs(data.plan, replicas.group, choice.weight, choice.runs)
        # [R] the replicas' round keys (ClientJob.key); a fixed key when none is given
        self.keys = (keys if keys is not None else
                     jax.random.split(jax.random.key(0), learning_rate.shape[0]))
        self.params, self.X, self.Y, self.plan = params, data.x, data.y, data.plan
        self.group, self.jobs, self.lr, self.l2, self.hyper = (replicas.group, jobs,
                                                               learning_rate, replicas.l2,
                                                               replicas.hyper)
        self.c, self.B, self.J, self.K = (cfg.lanes, cfg.batch_size, jobs.steps.shape[0],
                                          max(1, cfg.unroll))
        # this device's c of the D x c global lanes
        self.timeline = LaneTimeline(jobs.steps, self.c, cfg.axis)
        self.deal = self.timeline.deal
        self.update, self.optimizer = cfg.client_update, cfg.optimizer
        self.run_step = per_lane(self._lane_step, cfg.lanes, cfg.lane_mode)
        self.branchless = cfg.branchless
        self.clients = clients if clients is not None else ClientInputs((), (), None)
        self.clip = cfg.clip
        self.clip_r = replicas.clip   # [R] a traced clip per replica (adaptive clipping), or None
        self.augment = cfg.augment
        self.weight_like = jax.ShapeDtypeStruct(learning_rate.shape, jnp.float32)   # [R]
        # leaves [R, ...]: one model per replica (params without the versions' axis V)
        self.update_like = params if self.base is None else jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(p.shape[:1] + p.shape[2:], p.dtype), params)

    # ---------------------------------------------------------------- one lane's client work

    def _job(self, lr, l2, steps, key, client, size) -> ClientJob:
        return ClientJob(optimizer=self.optimizer(lr, l2), learning_rate=lr, l2=l2,
                         steps=steps, key=key, client=client, size=size)

    def _lane_init(self, server_state, client_state, w, hyper, *job):
        return self.update.init(server_state, client_state, w, hyper, self._job(*job))

    def _lane_step(self, state, x, y, valid, hyper, *job):
        grad_fn = minibatch_grad_fn(self.model, x, y, valid)
        return self.update.step(state, grad_fn, hyper, self._job(*job))

    def _lane_final(self, state, client_state, w, hyper, *job):
        return self.update.final(state, client_state, w, hyper, self._job(*job))

    def job_args(self, js, r):
        """(hyper, learning rate, l2, steps, round key, client id, n_k) of the lanes' jobs js
        (replicas r), [c] each."""
        slot = self.jobs.slot[js]
        client = (jnp.full(js.shape, -1, jnp.int32) if self.clients.ids is None
                  else self.clients.ids[r, slot])
        return (gather_rows(self.hyper, r), self.lr[r], self.l2[r], self.jobs.steps[js],
                self.keys[r], client, self.plan.sizes[self.group[r], slot])

    def client_rows(self, js, r):
        """The own state [c, ...] of the lanes' jobs' clients."""
        if not jax.tree.leaves(self.clients.client_state):
            return self.clients.client_state
        cid = self.clients.ids[r, self.jobs.slot[js]]
        return jax.tree.map(lambda a: a[r, cid], self.clients.client_state)

    def start_params(self, js, r):
        """The model each of the lanes' jobs js starts from [c, ...]: its replica's w_t, or
        with ``base`` the version base[r, slot] of its replica's versions."""
        if self.base is None:
            return gather_rows(self.params, r)
        v = self.base[r, self.jobs.slot[js]]
        return jax.tree.map(lambda a: a[r, v], self.params)

    def start_jobs(self, js, r):
        """The client update's init for the lanes' jobs js: step states [c, ...]."""
        return jax.vmap(self._lane_init)(gather_rows(self.clients.server_state, r),
                                         self.client_rows(js, r), self.start_params(js, r),
                                         *self.job_args(js, r))

    def end_jobs(self, step, js, r):
        """The client update's final for the lanes: (client states', updates, outputs)."""
        return jax.vmap(self._lane_final)(step, self.client_rows(js, r),
                                          self.start_params(js, r), *self.job_args(js, r))

    # ---------------------------------------------------------------- the loop

    def when(self, lanes, fn, operand):
        """fn(operand) if any lane needs it, else operand; fn is the identity on the other
        lanes, so the branchless form (always fn) gives the same values."""
        if self.branchless:
            return fn(operand)
        return lax.cond(jnp.any(lanes), fn, lambda op: op, operand)

    def schedule(self, t0) -> LaneSchedule:
        """The lanes' jobs and minibatches at steps t0 .. t0 + K - 1. Step s of a job reads
        epoch e, batch b = divmod(s, batches_per_epoch) of its client's shuffled stream
        (see :mod:`deltafl_jax.sampling.plan`)."""
        plan, B = self.plan, self.B
        t = t0 + jnp.arange(self.K, dtype=jnp.int32)[None, :]                  # [1, K]
        js, s, active, fresh, done = self.timeline.at(t)                       # [c, K]
        r = self.jobs.replica[js]
        g, i = self.group[r], self.jobs.slot[js]
        nb, sl = plan.batches_per_epoch[g, i], plan.seg_len[g, i]
        e, b = s // nb, s % nb
        within = b[..., None] * B + jnp.arange(B, dtype=jnp.int32)
        valid = (within < sl[..., None]) & active[..., None]
        where_ = plan.train_start[g, i][..., None] + (e * sl)[..., None] + within
        ex = plan.train_idx[g[..., None], jnp.where(valid, where_, 0)]
        return LaneSchedule(job=js, replica=r, fresh=fresh, done=done, ex=ex, valid=valid,
                            local_step=s)

    def augmented(self, x, sch: LaneSchedule):
        """x [c, K, B, ...] transformed by ``cfg.augment``, each step's minibatch with its key
        fold_in(fold_in(round key, client), local step): the same draws whichever lane or
        device runs the step."""
        slot = self.jobs.slot[sch.job]
        client = slot if self.clients.ids is None else self.clients.ids[sch.replica, slot]

        def key(r, cid, s):
            return jax.random.fold_in(jax.random.fold_in(self.keys[r], cid), s)

        keys = jax.vmap(jax.vmap(key))(sch.replica, client, sch.local_step)
        return jax.vmap(jax.vmap(self.augment))(x, keys)

    def finish(self, carry, js, r, done):
        """Finished jobs keep a_j u_j (0 when not finite) and a_j in their rows of the
        device's slot table, the rest by job. Only the buffers go through the ``lax.cond``: a
        lane's step state passed through it would be copied on every step that the cond
        skips."""
        c, J, tl = self.c, self.J, self.timeline

        def taken(acc):
            update, weight, sqnorm, finite, job_state, job_output, clipped = acc
            new_state, delta, output = self.end_jobs(carry.step, js, r)
            slot = jnp.where(done, js, J)
            row = jnp.where(done, tl.rows[js] - tl.first_row, tl.slots)
            if self.clip is not None:   # client-level DP: clip before the update is summed
                delta, long_ = self.clipped_updates(delta, r)
                clipped = clipped.at[slot].set(long_, mode="drop")
            ok = jax.vmap(tree_all_finite)(delta) & done
            coef = jnp.where(ok, self.jobs.weight[js], 0.0)

            def weighted(d):
                d = jnp.where(ok.reshape((c,) + (1,) * (d.ndim - 1)), d, 0.0)
                return coef.reshape((c,) + (1,) * (d.ndim - 1)) * d

            def put(buf, v):
                return buf.at[slot].set(v.astype(buf.dtype), mode="drop")

            def put_row(table, v):   # v [D, c, k]: the lanes' rows cut into D blocks
                return table.at[:, row].set(v.astype(table.dtype), mode="drop")

            return (jax.tree.map(put_row, update,
                                 slot_blocks(jax.tree.map(weighted, delta), tl.devices)),
                    put_row(weight, slot_blocks(coef, tl.devices)),
                    sqnorm.at[slot].set(jax.vmap(tree_sqnorm)(delta), mode="drop"),
                    finite.at[slot].set(ok, mode="drop"), jax.tree.map(put, job_state, new_state),
                    jax.tree.map(put, job_output, output), clipped)

        acc = (carry.update, carry.weight, carry.sqnorm, carry.finite, carry.job_state,
               carry.job_output, carry.clipped)
        acc = self.when(done, taken, acc)
        return carry._replace(update=acc[0], weight=acc[1], sqnorm=acc[2],
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

    def job_buffers(self, step, js, r):
        """Zeros [J, ...] for the client states and outputs that final returns (empty trees
        for an algorithm that keeps none)."""
        new_state, _, output = jax.eval_shape(self.end_jobs, step, js, r)
        return jax.tree.map(lambda s: jnp.zeros((self.J,) + s.shape[1:], s.dtype),
                            (new_state, output))

    def restart(self, carry, fresh, js, r):
        """Lanes starting a job take the client update's initial step state."""
        def taken(step):
            return select_tree(fresh, self.start_jobs(js, r), step)

        return carry._replace(step=self.when(fresh, taken, carry.step))

    def step(self, carry, sch: LaneSchedule, x, y, k: int) -> LaneCarry:
        """Step k of the trip. A lane with no job left steps on garbage: its state is never
        read again (it is restarted before any next job, and it has none)."""
        r, js = sch.replica[:, k], sch.job[:, k]
        carry = self.restart(carry, sch.fresh[:, k], js, r)
        step = self.run_step(carry.step, x[:, k], y[:, k], sch.valid[:, k],
                             *self.job_args(js, r))
        return self.finish(carry._replace(step=step), js, r, sch.done[:, k])

    def body(self, carry: LaneCarry) -> LaneCarry:
        sch = self.schedule(carry.trip * self.K)
        x, y = jnp.take(self.X, sch.ex, axis=0), jnp.take(self.Y, sch.ex, axis=0)
        if self.augment is not None:
            x = self.augmented(x, sch)
        for k in range(self.K):
            carry = self.step(carry, sch, x, y, k)
        return carry._replace(trip=carry.trip + 1, real=carry.real + jnp.sum(sch.valid))

    def init(self, tables=None) -> LaneCarry:
        """Every lane starts its first job; the slot tables are `tables` (update, weight)
        as they are, else zeros: a row is read only after a job of this round wrote it."""
        js0 = self.timeline.job_of(jnp.zeros((self.c,), jnp.int32))
        r0 = self.jobs.replica[js0]
        step = self.start_jobs(js0, r0)
        job_state, job_output = self.job_buffers(step, js0, r0)
        S = self.timeline.slots
        if tables is None:
            tables = (slot_tables(self.update_like, S, self.timeline.devices),
                      slot_tables(self.weight_like, S, self.timeline.devices))
        return LaneCarry(
            trip=jnp.int32(0), step=step, update=tables[0], weight=tables[1],
            sqnorm=jnp.zeros((self.J,), jnp.float32),
            finite=jnp.zeros((self.J,), bool), real=jnp.int32(0),
            job_state=job_state, job_output=job_output,
            clipped=jnp.zeros((self.J,), bool) if self.clip is not None else None)


def train_jobs(model: Model, params, data: RoundData, replicas: ReplicaRound,
               choice: JobChoice, cfg: LocalSGDConfig, clients: Optional[ClientInputs] = None,
               tables=None) -> TrainResult:
    """LocalUpdate for every job (r, i) with choice.weight[r, i] > 0 (or choice.runs[r, i]),
    and the weighted sums.

    Args:
      params: pytree, leading dim R: w_t of each replica (with ``choice.base``: leaves
        [R, V, ...], V versions per replica).
      data: the device-resident training split and the round's plan (:class:`RoundData`).
      replicas: each replica's group, learning rate, l2, hyper, round key and clip
        (:class:`ReplicaRound`).
      choice: the jobs that train, their weights and base versions (:class:`JobChoice`).
      cfg: static choices.
      clients: what the client update reads besides w_t (None: nothing).
      tables: the slot tables to fill, as ``TrainResult.tables`` returns them (None: zeros).

    ``trips`` counts minibatch steps of the busiest lane (the critical path); the loop runs
    ceil(trips / cfg.unroll) trips, and ``padded_examples`` counts trips * lanes * batch (the
    last loop trip may run up to unroll - 1 more steps with every lane idle).
    """
    R, m = choice.weight.shape
    prog = _LaneProgram(model, params, data, replicas, choice, cfg, clients)
    jobs = prog.jobs
    trips = prog.deal.trips
    loop_trips = (trips + prog.K - 1) // prog.K
    out = lax.while_loop(lambda cr: cr.trip < loop_trips, prog.body, prog.init(tables))
    axis = cfg.axis   # one reduction of the devices' partial sums, after the loop

    def per_job(tree):   # [J, ...] partial per device -> [R, m, ...]
        return jax.tree.map(lambda a: a.reshape((R, m) + a.shape[1:]), axis.sum(tree))

    # each replica's jobs in their order of finishing were it dealt alone to c lanes
    order = jax.vmap(lambda s: finish_order(s, cfg.order_lanes or cfg.lanes))(
        jobs.steps.reshape(R, m))
    rows = prog.timeline.rows[jnp.arange(R, dtype=jnp.int32)[:, None] * m + order]
    update, weight = device_ordered_sum((out.update, out.weight), rows, axis,
                                        (prog.update_like, prog.weight_like))
    return TrainResult(delta_sum=update, weight_sum=weight,
                       job_sqnorm=axis.sum(out.sqnorm).reshape(R, m),
                       job_finite=axis.sum(out.finite.astype(jnp.int32)).reshape(R, m) > 0,
                       job_trained=(jobs.steps > 0).reshape(R, m),
                       real_examples=axis.sum(out.real),
                       padded_examples=axis.sum(trips * cfg.lanes * cfg.batch_size),
                       trips=axis.max(trips), device_trips=axis.spread(trips),
                       device_jobs=axis.spread(jnp.sum(prog.deal.length)),
                       device_examples=axis.spread(out.real),
                       job_state=per_job(out.job_state), job_output=per_job(out.job_output),
                       job_clipped=None if out.clipped is None else
                       per_job(out.clipped.astype(jnp.int32)) > 0,
                       tables=(out.update, out.weight))
