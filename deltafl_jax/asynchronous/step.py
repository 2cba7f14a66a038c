"""The server step of buffered asynchronous aggregation on the device, for any
:class:`~deltafl_jax.asynchronous.rule.BufferedRule` (FedBuff, Nguyen et al., AISTATS 2022,
Algorithm 1, and its kin).

The host's :class:`~deltafl_jax.asynchronous.scheduler.AsyncScheduler` decides, on a virtual
clock, which K updates fill each buffer and from which model version each client started.
One server step here trains those K jobs in lanes, each from its own base version w_{tau_k}
(read from the ring of versions the device keeps), with the rule's job weights a_k (by
default s(tau_k)), and applies the rule's Delta through the server optimizer (g = -Delta,
:mod:`deltafl_jax.optimizers.server`; by default w + Delta) from the current version; the
new version is written into the ring. A replica none of whose K updates is finite keeps its
model and its server optimizer's state (the new version is the current one again).

A rule that ``uses_losses`` gets F_k(w_{tau_k}) first, each buffered client's mean loss on
its whole training split at its own base version plus (l2/2) ||w_{tau_k}||^2, the
synchronous round's F_k(w_t) (:mod:`deltafl_jax.rounds`) with w_t replaced by the job's
base: each (replica, job) is evaluated as a stream of its own, the job's examples alone
(:func:`job_streams`), so the evaluation costs what a synchronous round's does, plus at most
one chunk of padding per job.

The state (:class:`BufferedState`) keeps, per replica, V versions (leaves [R, V, ...]) and
the slot of the current one; replicas of one seed share the seed's scheduler (the plan's
group), so the step's inputs (:class:`BufferedInputs`) carry a leading group axis G.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from deltafl_jax import engine
from deltafl_jax.asynchronous.rule import BufferedRule, StepContext, polynomial
from deltafl_jax.optimizers.server import init_states, server_step
from deltafl_jax.replicas.labels import Replicas
from deltafl_jax.asynchronous.scheduler import ServerStep
from deltafl_jax.sampling.plan import RoundData


class BufferedState(flax.struct.PyTreeNode):
    """Every replica's versions.

    ring: pytree, leaves [R, V, ...]: the model versions kept (slot -> version on the host).
    current: [R] int32: the slot of each replica's current version.
    version: [] int32: server steps taken.
    server_opt_state: the server optimizer's state, leaves [R, ...]; () for w + Delta.
    """

    ring: Any
    current: jax.Array
    version: jax.Array
    server_opt_state: Any = ()


class BufferedInputs(NamedTuple):
    """One server step of every group (seed), from its scheduler's
    :class:`~deltafl_jax.asynchronous.scheduler.ServerStep`.

    slots: [G, K] int32 the ring slot of each update's base version; weights: [G, K] float32
    s(tau_k); staleness: [G, K] int32 tau_k; new_slot: [G] int32 where the new version goes.
    """

    slots: Any
    weights: Any
    staleness: Any
    new_slot: Any


def step_inputs(steps: Sequence[ServerStep],
                staleness: Callable[[Any], np.ndarray] = polynomial) -> BufferedInputs:
    """The step of each group, from its scheduler's :class:`ServerStep` (one per seed), with
    the rule's staleness weight s(tau) (FedBuff's :func:`polynomial` by default)."""
    return BufferedInputs(
        slots=np.stack([s.slots for s in steps]).astype(np.int32),
        weights=np.stack([staleness(s.staleness) for s in steps]).astype(np.float32),
        staleness=np.stack([s.staleness for s in steps]).astype(np.int32),
        new_slot=np.asarray([s.new_slot for s in steps], np.int32))


def init_buffered_state(params, ring: int, server_tx: Optional[optax.GradientTransformation]
                        = None, server_lr=None) -> BufferedState:
    """w_0 of every replica (leaves [R, ...]) in slot 0 of a ring of `ring` versions (the
    other slots zero until written), with the server optimizer's state."""
    R = jax.tree.leaves(params)[0].shape[0]
    versions = jax.tree.map(
        lambda p: jnp.zeros((p.shape[0], ring) + p.shape[1:], p.dtype).at[:, 0].set(p), params)
    lr = np.ones((R,), np.float32) if server_lr is None else server_lr
    return BufferedState(ring=versions, current=jnp.zeros((R,), jnp.int32),
                         version=jnp.int32(0),
                         server_opt_state=init_states(server_tx, params, lr))


def versions_at(ring, slots):
    """Each replica's version in ring slot slots[r] (ring leaves [R, V, ...], slots [R])."""
    return jax.tree.map(lambda a: jax.vmap(lambda x, s: x[s])(a, slots), ring)


def current_params(state: BufferedState):
    """The current version of every replica (leaves [R, ...]): the model served."""
    return versions_at(state.ring, state.current)


def kept_rows(keep, new, old):
    """new where keep [R], else old, leaf by leaf (leaves [R, ...])."""
    return jax.tree.map(lambda n, o: jnp.where(keep.reshape(keep.shape + (1,) * (n.ndim - 1)),
                                               n, o), new, old)


def job_streams(idx, seg, length, K: int):
    """Each group's evaluation stream (idx, seg [G, L], length [G]: the plan's, the K jobs'
    examples one client after another) cut into one stream per (group, job): idx [G K, L]
    with job k's examples first, in stream order; seg [G K, L] (k on them, K past them);
    length [G K] job k's examples."""
    G, L = idx.shape
    live = jnp.arange(L)[None, :] < length[:, None]                          # [G, L]
    jobs = jnp.arange(K, dtype=seg.dtype)
    mine = (seg[:, None, :] == jobs[None, :, None]) & live[:, None, :]         # [G, K, L]
    order = jnp.argsort(~mine, axis=-1, stable=True)
    idx_k = jnp.take_along_axis(jnp.broadcast_to(idx[:, None, :], mine.shape), order, -1)
    seg_k = jnp.where(jnp.take_along_axis(mine, order, -1), jobs[None, :, None], K)
    return (idx_k.reshape(G * K, L), seg_k.astype(seg.dtype).reshape(G * K, L),
            jnp.sum(mine, -1).astype(length.dtype).reshape(G * K))


def base_losses(model, ring, data: RoundData, slots, group, l2, chunk: int, lanes: int,
                axis) -> jax.Array:
    """[R, K] F_k(w_{tau_k}): job k's mean loss on its examples at its base version (ring
    slot slots[r, k]) plus (l2/2) ||w_{tau_k}||^2; each (replica, job) one stream
    (:func:`job_streams`)."""
    R, K = slots.shape
    plan = data.plan
    idx, seg, length = job_streams(plan.eval_idx, plan.eval_seg, plan.eval_len, K)
    bases = jax.tree.map(lambda a: jax.vmap(lambda x, s: x[s])(a, slots), ring)  # [R, K, ...]
    flat = jax.tree.map(lambda a: a.reshape((R * K,) + a.shape[2:]), bases)
    streams = (group[:, None] * K + jnp.arange(K, dtype=group.dtype)[None, :]).reshape(R * K)
    ev = engine.evaluate_streams(model, flat, data.x, data.y,
                                 engine.EvalStreams(idx, seg, length, K), streams,
                                 engine.EvalLayout(chunk, lanes, axis))
    own = jnp.diagonal(ev.loss_sum.reshape(R, K, K), axis1=1, axis2=2)          # [R, K]
    sqnorm = jax.vmap(engine.tree_sqnorm)(flat).reshape(R, K)
    sizes = plan.sizes[group]
    return own / jnp.where(sizes > 0, sizes, 1) + 0.5 * l2[:, None] * sqnorm


class StepShape(NamedTuple):
    """The step's fixed parts: local work, server optimizer, evaluation chunk and lanes."""

    local: engine.LocalSGDConfig
    server_tx: Optional[optax.GradientTransformation] = None
    eval_chunk: int = 8
    eval_lanes: Optional[int] = None


def _context(model, rule, shape, state, data, inputs, group, l2, hyper) -> StepContext:
    """The rule's :class:`StepContext` before training (losses at the bases if it asks)."""
    sizes = data.plan.sizes[group]
    slots = inputs.slots[group]
    ctx = StepContext(state=state, slots=slots, staleness=inputs.staleness[group],
                      stale_weights=jnp.where(sizes > 0, inputs.weights[group], 0.0),
                      sizes=sizes, hyper=hyper)
    if not rule.uses_losses:
        return ctx
    lanes = shape.eval_lanes or shape.local.lanes
    return ctx._replace(losses=base_losses(model, state.ring, data, slots, group, l2,
                                           shape.eval_chunk, lanes, shape.local.axis))


def _written(state, params, opt_state, new_slot, t):
    ring = jax.tree.map(lambda a, p: jax.vmap(lambda x, s, v: x.at[s].set(v))(a, new_slot, p),
                        state.ring, params)
    return BufferedState(ring=ring, current=new_slot, version=t + 1, server_opt_state=opt_state)


def build_buffered_step(model, replicas: Replicas, local: engine.LocalSGDConfig,
                        server_tx: Optional[optax.GradientTransformation] = None, *,
                        rule: BufferedRule, eval_chunk: int = 8,
                        eval_lanes: Optional[int] = None):
    """The server step of `rule` for `replicas`, an unjitted pure function

        step_fn(state, data, inputs, key) -> (state, metrics)

    with `data` a :class:`~deltafl_jax.sampling.plan.RoundData` whose plan holds the K buffered
    jobs of each group in its K slots (in the scheduler's order), `inputs` the
    :class:`BufferedInputs`, `key` the replicas' root keys (the step's keys fold in the new
    version's number). `eval_chunk`, `eval_lanes`: the evaluation of a rule that uses the
    losses (None lanes: the training's)."""
    group = jnp.asarray(replicas.group, jnp.int32)
    hyper_np = jax.tree.map(lambda v: np.asarray(v, np.float32), replicas.hyper)
    l2_np = np.asarray(replicas.l2, np.float32)
    schedules = replicas.schedules
    if rule.client_update is not None:
        local = local._replace(client_update=rule.client_update)
    shape = StepShape(local, server_tx, eval_chunk, eval_lanes)

    def step_fn(state: BufferedState, data: RoundData, inputs: BufferedInputs, key
                ) -> Tuple[BufferedState, Dict[str, Any]]:
        t = state.version
        lr = jnp.stack([jnp.asarray(s(t), jnp.float32) for s in schedules])
        keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(key)
        hyper, l2 = jax.tree.map(jnp.asarray, hyper_np), jnp.asarray(l2_np)
        ctx = _context(model, rule, shape, state, data, inputs, group, l2, hyper)
        weights, rule_metrics = rule.weights(ctx)
        tr = engine.train_jobs(model, state.ring, data,
                               engine.ReplicaRound(group, lr, l2, hyper, keys),
                               engine.JobChoice(weights, base=ctx.slots), local,
                               engine.ClientInputs((), (), data.plan.clients[group]))
        delta = rule.aggregate(ctx._replace(job_weights=weights, delta_sum=tr.delta_sum,
                                            weight_sum=tr.weight_sum,
                                            kept=tr.job_trained & tr.job_finite))
        current = current_params(state)
        reached = tr.weight_sum > 0
        delta = kept_rows(reached, delta, jax.tree.map(jnp.zeros_like, delta))
        params, opt_state = server_step(server_tx, current, delta, state.server_opt_state)
        params = kept_rows(reached, params, current)
        opt_state = kept_rows(reached, opt_state, state.server_opt_state)
        metrics = {"staleness_mean": jnp.mean(ctx.staleness.astype(jnp.float32), 1),
                   "num_rejected": jnp.sum(tr.job_trained & ~tr.job_finite, axis=1),
                   "learning_rate": lr, "train_real_examples": tr.real_examples,
                   "train_trips": tr.trips, "device_train_trips": tr.device_trips,
                   "device_train_jobs": tr.device_jobs,
                   "server_step_norm": jnp.sqrt(jax.vmap(engine.tree_sqnorm)(
                       jax.tree.map(jnp.subtract, params, current))), **rule_metrics}
        return _written(state, params, opt_state, inputs.new_slot[group], t), metrics

    return step_fn
