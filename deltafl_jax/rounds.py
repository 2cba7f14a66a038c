"""One federated round for R replicas at once, as a pure function to jit once.

    round_fn(state, data, key) -> (state, metrics)

A replica is one model being trained: a (conformity level theta or other swept
hyper-parameter, seed) pair. ``state.params`` and ``state.algo_state`` carry a leading
replica axis [R, ...]. The round (Algorithm 2):

1. F_k(w_t) of every sampled client for every replica (:func:`engine.evaluate_streams`),
   plus (l2/2)||w_t||^2 when l2 > 0, as the reference code does; skipped for an algorithm
   that does not use the losses (``uses_losses=False``: FedAvg, FedProx), which then sees NaN;
2. ``algorithm.client_weights``, vmapped over replicas: the filter (eta, tail weights), or a
   baseline's weights; it gets the replica's round key (the seed's key folded with the round)
   and the sampled clients' ids;
3. LocalUpdate on the kept clients only (every sampled client for an algorithm with
   ``all_sampled_work``; :func:`engine.train_jobs`), each running the algorithm's client
   update (:mod:`deltafl_jax.engine.client`; its clients' own state is read before and written
   back after, for the clients whose update is finite);
4. ``algorithm.server_update``, vmapped over replicas: the aggregate Delta (the weighted average
   of the updates) and the algorithm's new state;
5. the server optimizer's step on the pseudo-gradient -Delta
   (:mod:`deltafl_jax.optimizers.server`; by default w + Delta, the plain average).
6. the check of the new state (:func:`state_nonfinite`): per replica and per part of the
   state (the model, the server optimizer's state, the algorithm's, the clients' own, DP's),
   whether it holds a NaN or an infinity, as round metrics ``nonfinite_<part>``
   (:mod:`deltafl_jax.run.divergence` reports and acts on them).

Replicas that share a seed share the sampled clients and the minibatch order (the plan of
group g = their seed), which makes theta-to-theta comparisons paired.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from deltafl_jax import engine
from deltafl_jax.algorithms.protocol import ClientFeedback, FederatedAlgorithm, RoundContext
from deltafl_jax.models import Model
from deltafl_jax.optimizers.server import init_states, server_step
from deltafl_jax.privacy.dp import (NOISE_STREAM, adaptive_clip, bandmf_privatize,
                                    poisson_weights)
from deltafl_jax.replicas.labels import Replicas
from deltafl_jax.sampling.plan import RoundData


class ServerState(flax.struct.PyTreeNode):
    """State of every replica.

    params: pytree, leaves [R, ...]: the global models w_t.
    algo_state: pytree, leaves [R, ...]: the algorithm's own state (empty for Delta-FL).
    round: [] int32: rounds completed.
    active: [R] bool: replicas still training (a replica stopped for divergence keeps its
      model and state, and its clients do no work); None = all.
    server_opt_state: the server optimizer's state, leaves [R, ...] (its injected learning
      rate: hyperparams["learning_rate"] [R]); () for the default step w + Delta.
    client_state: pytree, leaves [R, N, ...]: every training client's own state, for an
      algorithm that declares one (SCAFFOLD's c_i); () otherwise.
    dp: client-level DP's own state, a dict, None without one: "clip" [R] float32, each
      replica's clip under --dp_clip=adaptive; "noise": pytree like params, leaves
      [R, b - 1, ...], BandMF's last b - 1 noise vectors (deltafl_jax.privacy.dp).
    """

    params: Any
    algo_state: Any
    round: jax.Array
    active: Any = None
    server_opt_state: Any = ()
    client_state: Any = ()
    dp: Any = None


def init_state(model: Model, algorithm: FederatedAlgorithm, replicas: Replicas,
               seeds: Sequence[int],
               server_tx: Optional[optax.GradientTransformation] = None,
               num_clients: int = 0, clip: Optional[float] = None,
               bands: int = 0) -> ServerState:
    """w_0 of each replica from its seed (replicas with one seed start from one w_0), the
    algorithm's state, the server optimizer's state (each replica's own learning rate), and
    the per-client state of the `num_clients` training clients when the algorithm has one;
    `clip`: the initial clip of every replica under --dp_clip=adaptive; `bands`: BandMF's b
    (b - 1 zero noise vectors per replica)."""
    params = jax.jit(jax.vmap(model.init))(replica_keys(replicas, seeds))
    hyper = jax.tree.map(jnp.asarray, replicas.hyper)
    algo_state = jax.vmap(algorithm.init)(params, hyper)
    client_state = ()
    if algorithm.client_state_init is not None:
        if num_clients < 1:
            raise ValueError(f"{algorithm.name} keeps a state per client: give num_clients")
        def every_client(p, h):
            one = algorithm.client_state_init(p, h)
            return jax.tree.map(lambda a: jnp.broadcast_to(a, (num_clients,) + a.shape), one)
        client_state = jax.jit(jax.vmap(every_client))(params, hyper)
    return ServerState(params=params, algo_state=algo_state,
                       round=jax.device_put(np.int32(0)),
                       active=jax.device_put(np.ones((replicas.size,), bool)),
                       server_opt_state=init_states(server_tx, params,
                                                    replicas.server_lr),
                       client_state=client_state, dp=_dp_state(params, replicas.size, clip,
                                                               bands))


def _dp_state(params, R, clip, bands):
    dp = {}
    if clip is not None:
        dp["clip"] = jnp.full((R,), clip, jnp.float32)
    if bands > 1:
        dp["noise"] = jax.tree.map(
            lambda p: jnp.zeros((p.shape[0], bands - 1) + p.shape[1:], jnp.float32), params)
    return dp or None


def replica_keys(replicas: Replicas, seeds: Sequence[int]):
    """[R] typed root keys, one per replica's seed; the round folds in the round index."""
    seeds_r = np.asarray([int(seeds[g]) for g in replicas.group], np.uint32)
    return _root_keys(seeds_r)


# typed keys [R] from uint32 seeds [R], one compiled program per R
_root_keys = jax.jit(jax.vmap(jax.random.key))


def _losses(model, state, data, group, l2, m, layout: engine.EvalLayout):
    """F_k(w_t) [R, m] of the sampled clients, plus (l2/2)||w_t||^2, and the evaluation."""
    plan = data.plan
    ev = engine.evaluate_streams(model, state.params, data.x, data.y,
                                 engine.EvalStreams(plan.eval_idx, plan.eval_seg, plan.eval_len, m),
                                 group, layout)
    sizes = plan.sizes[group]                                   # [R, m]
    sqnorm = jax.vmap(engine.tree_sqnorm)(state.params)         # [R]
    return ev.loss_sum / sizes + 0.5 * (l2 * sqnorm)[:, None], sizes, ev


def _no_losses(data, group):
    """For an algorithm that does not use F_k(w_t): NaN losses, and no evaluation work."""
    sizes = data.plan.sizes[group]
    zero = jnp.int32(0)
    ev = engine.EvalResult(loss_sum=None, error_sum=None, real_examples=zero,
                           padded_examples=zero, trips=zero)
    return jnp.full(sizes.shape, jnp.nan, jnp.float32), sizes, ev


NONFINITE = "nonfinite_"   # the round metrics of the state check: nonfinite_<part> [R]
CLIENT_PART = "client_state"


def state_parts(state: ServerState) -> Dict[str, Any]:
    """The parts of a state that the round checks, by name, in order: ``params``,
    ``server_opt_state``, the algorithm's state and the clients' own state (split into its
    fields when the algorithm's state is a NamedTuple: ``algo_state.c``,
    ``client_state.personal``) and ``dp``. Parts without a floating-point leaf are left
    out."""
    parts = {"params": state.params, "server_opt_state": state.server_opt_state}
    for name in ("algo_state", CLIENT_PART):
        tree = getattr(state, name)
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):
            parts.update({f"{name}.{f}": v for f, v in zip(tree._fields, tree)})
        else:
            parts[name] = tree
    parts["dp"] = state.dp
    return {k: v for k, v in parts.items() if _float_leaves(v)}


def _float_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def finite_rows(tree, axes: int):
    """bool over the first `axes` axes of every leaf: no NaN or infinity in the rest of any
    floating-point leaf (one all-finite reduction per leaf)."""
    out = None
    for x in _float_leaves(tree):
        f = jnp.all(jnp.isfinite(x).reshape(x.shape[:axes] + (-1,)), axis=-1)
        out = f if out is None else out & f
    return out


def state_nonfinite(state: ServerState, clients, real) -> Dict[str, jax.Array]:
    """The round's check of the state it returns: ``nonfinite_<part>`` [R] int32 for every
    part of :func:`state_parts`: 1 where the replica's part holds a NaN or an infinity, else
    0; for a part of the clients' own state (leaves [R, N, ...]), the number of the round's
    clients (`clients` [R, m], the slots where `real` [R, m]) whose row is not finite. A
    client's row changes only when the round writes it back, so the check finds a row in the
    round it turns, at the cost of the round's m rows rather than all N. It adds outputs and
    changes no value the round computes."""
    out = {}
    for name, part in state_parts(state).items():
        if name.partition(".")[0] == CLIENT_PART:
            rows = jax.tree.map(lambda a: jax.vmap(lambda x, i: x[i])(a, clients), part)
            bad = real & ~finite_rows(rows, 2)
            out[NONFINITE + name] = jnp.sum(bad, axis=1, dtype=jnp.int32)
        else:
            out[NONFINITE + name] = (~finite_rows(part, 1)).astype(jnp.int32)
    return out


@jax.jit
def count_nonfinite_clients(state: ServerState) -> Dict[str, jax.Array]:
    """{part of the clients' own state: [R] int32 the training clients whose row of it is not
    finite}, over all N rows (a run's closing count; the round checks only its own rows)."""
    return {name: jnp.sum(~finite_rows(part, 2), axis=1, dtype=jnp.int32)
            for name, part in state_parts(state).items()
            if name.partition(".")[0] == CLIENT_PART}


def _per_replica_where(keep, new, old):
    """new where the replica is kept, else old (keep: [R]; leaves [R, ...])."""
    return jnp.where(keep.reshape(keep.shape + (1,) * (new.ndim - 1)), new, old)


def _round_metrics(weights, sizes, losses, lr, tr, ev, algo_metrics, uses_losses):
    sizes_f = sizes.astype(jnp.float32)
    sampled = ({"sampled_loss_mean": jnp.sum(sizes_f * losses, 1) / jnp.sum(sizes_f, 1)}
               if uses_losses else {})
    return {
        "num_selected": jnp.sum(weights > 0, axis=1),
        "num_rejected": jnp.sum(tr.job_trained & ~tr.job_finite, axis=1),
        **sampled,
        "kept_examples": jnp.sum(jnp.where(weights > 0, sizes, 0), axis=1),
        "learning_rate": lr,
        **algo_metrics,
        # Work done by the whole program this round (scalars).
        "eval_real_examples": ev.real_examples,
        "eval_padded_examples": ev.padded_examples,
        "train_real_examples": tr.real_examples,
        "train_padded_examples": tr.padded_examples,
        "train_trips": tr.trips,
        "eval_trips": ev.trips,
        # Per device [D] (one entry without a mesh): the balance of the dealt work.
        "device_train_trips": tr.device_trips,
        "device_train_jobs": tr.device_jobs,
        "device_train_examples": tr.device_examples,
        # Client-level DP: the updates longer than the clip norm, per replica.
        **({"dp_clipped": jnp.sum(tr.job_clipped, axis=1)} if tr.job_clipped is not None
           else {}),
    }


def _probed(model, algorithm, state, feedback, data, replicas: engine.ReplicaRound,
            layout: engine.EvalLayout):
    """The feedback with ``probe_losses`` [R, m'] and ``probe_clients``: the losses F_i of the
    round's second sample at the model each replica's ``algorithm.probe`` chooses (DRFA: the
    snapshot average), with (l2/2)||w||^2 as every F_k; the feedback as it is without a
    probe."""
    if algorithm.probe is None:
        return feedback
    probe, group, l2 = data.probe, replicas.group, replicas.l2
    at = jax.vmap(algorithm.probe)(state.algo_state, state.params, feedback, replicas.hyper)
    m = probe.clients.shape[1]
    ev = engine.evaluate_streams(model, at, data.x, data.y,
                                 engine.EvalStreams(probe.eval_idx, probe.eval_seg,
                                                    probe.eval_len, m), group, layout)
    sqnorm = jax.vmap(engine.tree_sqnorm)(at)
    return feedback._replace(
        probe_losses=ev.loss_sum / probe.sizes[group] + 0.5 * (l2 * sqnorm)[:, None],
        probe_clients=probe.clients[group])


def _feedback(tr, losses, sizes, weights, lr, clients) -> ClientFeedback:
    """What the server learns from the round's local work (:class:`ClientFeedback`)."""
    return ClientFeedback(losses=losses, sizes=sizes, weights=weights, delta_sum=tr.delta_sum,
                          weight_sum=tr.weight_sum, job_sqnorm=tr.job_sqnorm,
                          job_finite=tr.job_finite, job_trained=tr.job_trained,
                          learning_rate=lr, clients=clients, client_outputs=tr.job_output)


def _write_back(client_state, ids, new, ok):
    """client_state [N, ...] with rows ids [m] replaced by new [m, ...] where ok [m]; a slot
    that is not ok writes nothing (an empty slot's padded id may be a real client's)."""
    def put(a, n):
        return a.at[jnp.where(ok, ids, a.shape[0])].set(n.astype(a.dtype), mode="drop")
    return jax.tree.map(put, client_state, new)


def _server(algorithm, server_tx, state, feedback, hyper, keep):
    """Steps 4-5 for every replica: (params, algo_state, server_opt_state, metrics); replicas
    that are not kept keep theirs. With a server optimizer, a replica whose aggregate no
    client reached (weight_sum = 0: every update dropped or not finite, or nobody kept) keeps
    its model and the optimizer's state too: its momentum is not applied to a Delta of
    zeros (unless the algorithm ``steps_without_clients``). (The plain step w + Delta adds
    that zero Delta: the model stays.)"""
    delta, algo_state, algo_metrics = jax.vmap(algorithm.server_update)(
        state.algo_state, state.params, feedback, hyper)
    params, opt_state = server_step(server_tx, state.params, delta, state.server_opt_state)
    moved = (keep if server_tx is None or algorithm.steps_without_clients
             else keep & (feedback.weight_sum > 0))

    def kept(new, old, which=keep):
        return jax.tree.map(lambda n, o: _per_replica_where(which, n, o), new, old)
    params = kept(params, state.params, moved)
    metrics = dict(algo_metrics)
    if server_tx is not None:   # how far the server step moved each model
        metrics["server_step_norm"] = jnp.sqrt(jax.vmap(engine.tree_sqnorm)(
            jax.tree.map(jnp.subtract, params, state.params)))
    return (params, kept(algo_state, state.algo_state),
            kept(opt_state, state.server_opt_state, moved), metrics)


def _privatize(private, clip: float, m: int, feedback: ClientFeedback, hyper, key, z):
    """One replica's feedback made private (:mod:`deltafl_jax.privacy.dp`): N(0, (z C a_max)^2 I)
    added to the sum of the clipped updates (clipped by the engine), and the weight it is
    divided by replaced by the algorithm's fixed denominator, or by the kept weight with noise
    N(0, (z a_max)^2), floored (:class:`PrivateAggregate`). The noise comes from the replica's
    round key."""
    a_max = jnp.asarray(private.max_weight(hyper, m), jnp.float32)
    leaves, treedef = jax.tree.flatten(feedback.delta_sum)
    keys = jax.random.split(jax.random.fold_in(key, NOISE_STREAM), len(leaves) + 1)
    noisy = [x + (z * clip * a_max * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
             for x, k in zip(leaves, keys[1:])]
    if private.denominator is None:
        drawn = z * a_max * jax.random.normal(keys[0], (), jnp.float32)
        floor = jnp.where(z > 0, jnp.asarray(private.floor(hyper, m), jnp.float32), a_max)
        total = jnp.maximum(feedback.weight_sum + drawn, floor)
    else:
        total = jnp.asarray(private.denominator(hyper, m), jnp.float32)
    return feedback._replace(delta_sum=jax.tree.unflatten(treedef, noisy), weight_sum=total)


# The round's noise for one replica, as the audit (deltafl_jax.studies.audit) runs it.
privatize_feedback = _privatize


def _private(algorithm, clip, m, adaptive=None, correlated=None):
    """(the algorithm's private version, the vmapped feedback transform) with a clip, else
    (None, None); a run with a clip has one (:func:`deltafl_jax.run.resolve.resolve` refuses
    the others). Adaptive clipping: the transform takes each replica's clip too; BandMF: its
    noise history (and returns the new one)."""
    if clip is None:
        return None, None
    private = algorithm.private
    if adaptive is not None:   # the clip of each replica from the state, traced
        return private, jax.vmap(lambda fb, h, k, z, c: _privatize(private, c, m, fb, h, k, z))
    if correlated is not None:
        coef, s_T = correlated.coef, correlated.sensitivity(correlated.rounds)
        return private, jax.vmap(lambda fb, h, k, z, hist: bandmf_privatize(
            private, clip, m, coef, s_T, fb, h, k, z, hist))
    return private, jax.vmap(functools.partial(_privatize, private, clip, m))


def _cohort_weights(algorithm, private, ctx: RoundContext, z, expected: Optional[int]):
    """The weights of step 2 (`ctx`: every replica's :class:`RoundContext`, leaves [R, ...];
    z [R] the noise multipliers); with `expected` (a Poisson cohort of that expected size)
    a_max on every sampled client of a fixed-denominator private version
    (:func:`deltafl_jax.privacy.dp.poisson_weights`). Empty slots are masked by the round
    (:func:`_masked_weights`)."""
    weights = _weights(algorithm, private, ctx, z)
    if expected is not None and private is not None:
        weights = jax.vmap(lambda w, h: poisson_weights(private, w, h, expected))(weights,
                                                                                   ctx.hyper)
    return weights


def _masked_weights(dpr, algorithm, ctx: RoundContext, z, variable: bool):
    """(losses, weights) of step 2. A cohort whose size varies (`variable`: Poisson sampling,
    or fewer clients online than slots) has empty slots (size 0): their loss and weight are
    0 for every algorithm, before and after its weighting, so they count in none of its sums."""
    if not variable:
        return ctx.losses, dpr.weights(algorithm, ctx, z)
    ctx = ctx._replace(losses=jnp.where(ctx.sizes > 0, ctx.losses, 0.0))
    weights = dpr.weights(algorithm, ctx, z)
    return ctx.losses, jnp.where(ctx.sizes > 0, weights, 0.0)


def _weights(algorithm, private, ctx: RoundContext, z):
    """Step 2 for every replica (`ctx` leaves [R, ...]): the algorithm's client_weights, or
    its private version."""
    if private is not None and private.client_weights is not None:
        return jax.vmap(private.client_weights)(ctx, z)
    return jax.vmap(algorithm.client_weights)(ctx)


class _RoundDP:
    """Client-level DP's part of a round: the private version and its feedback transform
    (:func:`_private`), a Poisson cohort's weights (:func:`_cohort_weights`; `expected`: its
    expected size q N, the plan's slots being `num_sampled`), the adaptive clip (`adaptive`:
    the run's :class:`~deltafl_jax.privacy.dp.Privacy`) and BandMF's noise (`correlated`: its
    :class:`~deltafl_jax.privacy.dp.Correlated`), both in ``ServerState.dp``."""

    def __init__(self, algorithm, clip, num_sampled, expected, adaptive, correlated):
        self.m = expected or num_sampled    # the cohort the private version expects
        self.expected, self.adaptive, self.correlated = expected, adaptive, correlated
        self.private, self.privatize = _private(algorithm, clip, self.m, adaptive, correlated)

    def weights(self, algorithm, ctx: RoundContext, z):
        return _cohort_weights(algorithm, self.private, ctx, z, self.expected)

    def private_feedback(self, feedback, tr, hyper, keys, z, dp, keep):
        """Every replica's feedback made private, with DP's own state (:class:`ServerState`'s
        ``dp``) stepped: (feedback, dp, extra round metrics). Adaptive clipping: the clip's
        step from the noised unclipped count (:func:`deltafl_jax.privacy.dp.adaptive_clip`;
        expected count D / a_max); BandMF: the noise history
        (:func:`deltafl_jax.privacy.dp.bandmf_privatize`)."""
        privatize, private, m = self.privatize, self.private, self.m
        adaptive, correlated = self.adaptive, self.correlated
        if private is None:
            return feedback, dp, {}
        if adaptive is not None:
            clip = dp["clip"]
            feedback = privatize(feedback, hyper, keys, z, clip)
            unclipped = jnp.sum(tr.job_trained & tr.job_finite & ~tr.job_clipped, axis=1)
            new, frac = jax.vmap(lambda c, u, k, zz, h: adaptive_clip(
                c, u, k, zz, adaptive, private.denominator(h, m) / private.max_weight(h, m)))(
                    clip, unclipped, keys, z, hyper)
            return (feedback, {**dp, "clip": jnp.where(keep, new, clip)},
                    {"dp_clip_norm": clip, "dp_unclipped_fraction": frac})
        if correlated is not None and len(correlated.coef) > 1:
            feedback, history = privatize(feedback, hyper, keys, z, dp["noise"])
            return feedback, {**dp, "noise": jax.tree.map(
                lambda n, o: _per_replica_where(keep, n, o), history, dp["noise"])}, {}
        if correlated is not None:   # one band: independent noise, no history
            return privatize(feedback, hyper, keys, z, feedback.delta_sum)[0], dp, {}
        return privatize(feedback, hyper, keys, z), dp, {}

    def clips(self, state):
        """[R] each replica's clip (adaptive clipping), else None (the engine's static C)."""
        return state.dp["clip"] if self.adaptive is not None else None

    def feedback(self, feedback, tr, each: engine.ReplicaRound, z, dp, keep):
        """(feedback, dp, extra metrics) (:meth:`private_feedback`), and each Poisson
        round's cohort size."""
        feedback, dp, extra = self.private_feedback(feedback, tr, each.hyper, each.keys, z, dp,
                                                    keep)
        if self.expected is not None:
            extra["cohort_size"] = jnp.sum(feedback.sizes > 0, axis=1)
        return feedback, dp, extra


def build_round_fn(model: Model, algorithm: FederatedAlgorithm, replicas: Replicas,
                   local: engine.LocalSGDConfig, eval_chunk: int, eval_lanes: int,
                   num_sampled: int,
                   server_tx: Optional[optax.GradientTransformation] = None,
                   expected: Optional[int] = None, adaptive=None, correlated=None,
                   variable: bool = False, tables: bool = False):
    """The round of `algorithm` for `replicas`, with the server optimizer's transformation
    `server_tx` (None: the plain step w + Delta), client-level DP when ``local.clip`` is set
    (:class:`_RoundDP`); `variable`: the plan's cohorts may leave slots empty (Poisson, or
    fewer clients online than slots). An unjitted pure function; with `tables` it takes and
    returns the lanes' slot tables too (:class:`deltafl_jax.run.program.TableRound`)."""
    dpr = _RoundDP(algorithm, local.clip, num_sampled, expected, adaptive, correlated)
    z_np = np.asarray(replicas.dp_noise, np.float32)
    local = local._replace(client_update=algorithm.client_update)
    layout = engine.EvalLayout(eval_chunk, eval_lanes, local.axis)
    group = jnp.asarray(replicas.group, jnp.int32)
    hyper_np = jax.tree.map(lambda v: np.asarray(v, np.float32), replicas.hyper)
    l2_np = np.asarray(replicas.l2, np.float32)

    def round_with_tables(state: ServerState, data: RoundData, key, slot_tables=None):
        t = state.round
        hyper = jax.tree.map(jnp.asarray, hyper_np)
        l2 = jnp.asarray(l2_np)
        lr = jnp.stack([jnp.asarray(s(t), jnp.float32) for s in replicas.schedules])
        if algorithm.uses_losses:
            losses, sizes, ev = _losses(model, state, data, group, l2, num_sampled, layout)
        else:
            losses, sizes, ev = _no_losses(data, group)
        keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(key)
        clients = data.plan.clients[group]                          # [R, m] client ids
        z = jnp.asarray(z_np)
        ctx = RoundContext(state.algo_state, losses, sizes, hyper, keys, clients)
        losses, weights = _masked_weights(dpr, algorithm, ctx, z, variable)
        keep = (state.active if state.active is not None
                else jnp.ones((weights.shape[0],), bool))
        weights = jnp.where(keep[:, None], weights, 0.0)
        inputs = engine.ClientInputs(state.algo_state, state.client_state, clients)
        runs = (jnp.broadcast_to(keep[:, None], weights.shape) if algorithm.all_sampled_work
                else None)
        each = engine.ReplicaRound(group, lr, l2, hyper, keys, dpr.clips(state))
        tr = engine.train_jobs(model, state.params, data, each, engine.JobChoice(weights, runs),
                               local, inputs, slot_tables)
        feedback = _feedback(tr, losses, sizes, weights, lr, clients)
        feedback, dp, extra = dpr.feedback(feedback, tr, each, z, state.dp, keep)
        feedback = _probed(model, algorithm, state, feedback, data, each, layout)
        params, algo_state, opt_state, algo_metrics = _server(
            algorithm, server_tx, state, feedback, hyper, keep)
        client_state = state.client_state
        if jax.tree.leaves(client_state):
            client_state = jax.vmap(_write_back)(client_state, clients, tr.job_state,
                                                 tr.job_finite & (sizes > 0))
        metrics = {**_round_metrics(weights, sizes, losses, lr, tr, ev, algo_metrics,
                                    algorithm.uses_losses), **extra}
        new = state.replace(params=params, algo_state=algo_state, round=t + 1, dp=dp,
                            server_opt_state=opt_state, client_state=client_state)
        return new, {**metrics, **state_nonfinite(new, clients, sizes > 0)}, tr.tables

    return round_with_tables if tables else _without_tables(round_with_tables)


def _without_tables(round_with_tables):
    """``round_fn(state, data, key) -> (state, metrics)``: fresh slot tables every round."""
    def round_fn(state: ServerState, data: RoundData, key) -> Tuple[ServerState, Dict]:
        new, metrics, _ = round_with_tables(state, data, key)
        return new, metrics

    return round_fn
