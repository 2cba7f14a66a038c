"""The lane executor: client evaluation and local SGD for many models in one jitted program.

Delta-FL's round (Algorithm 2) does two kinds of client work, for every replica r (one model per
conformity level theta and seed):

1. F_k(w_t) on every sampled client (line 4): a forward pass over the client's whole data;
2. LocalUpdate (lines 7-8) on the clients that pass the filter: minibatch SGD from w_t.

Both are flattened into *work items* and run by ``lanes`` parallel lanes inside one
``lax.while_loop`` whose trip count is computed from the data:

- evaluation items are (replica, chunk of `chunk` examples) over the packed example stream of
  the sampled clients, so clients of ragged sizes share chunks and padding stays below one
  chunk per replica;
- training jobs are (replica, client) pairs that the filter kept. Jobs are sorted by their
  number of steps and dealt to lanes in snake order; a lane runs its jobs one after another,
  resetting to w_t at each job start. A job that the filter dropped costs nothing, and the
  loop stops when the busiest lane is done.

``lanes`` is the client-parallelism knob (``--clients_per_step``). With one lane, each step is
an ordinary (unbatched) model step, which is the fast form on XLA:CPU for convolutions; with
more lanes the step is ``jax.vmap``-ed over lanes, which suits accelerators and small models.

Nothing here is jitted: the caller jits the round once (see :mod:`deltafl_jax.rounds`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from deltafl_jax.models import Model

Params = object


def _ceil_div(a, b):
    return (a + b - 1) // b


def _select_tree(pred, on_true, on_false):
    """Per-lane select: pred [c] picks between two pytrees with leading dim c."""
    def sel(a, b):
        p = pred.reshape(pred.shape + (1,) * (a.ndim - 1))
        return jnp.where(p, a, b)
    return jax.tree.map(sel, on_true, on_false)


def _gather_replicas(params, r):
    """params with leading dim R, r [c] -> pytree with leading dim c."""
    return jax.tree.map(lambda a: jnp.take(a, r, axis=0), params)


LANE_MODES = ("vmap", "unroll")


def _per_lane(fn, lanes: int, mode: str = "vmap"):
    """Run `fn` on every lane (inputs and outputs carry a leading lane axis).

    One lane: the plain unbatched function. "vmap": one batched computation, the form for
    accelerators and small models. "unroll": `lanes` independent copies of the unbatched
    computation, which XLA:CPU can run concurrently on its cores while each keeps ordinary
    (ungrouped) convolutions.
    """
    if mode not in LANE_MODES:
        raise ValueError(f"unknown lane mode {mode!r}; expected one of {LANE_MODES}")
    if lanes == 1 or mode == "unroll":
        def unrolled(*args):
            outs = [fn(*jax.tree.map(lambda a, i=i: a[i], args)) for i in range(lanes)]
            return jax.tree.map(lambda *o: jnp.stack(o), *outs)
        return unrolled
    return jax.vmap(fn)


def _tree_sqnorm(tree):
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def _tree_all_finite(tree):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


# ----------------------------------------------------------------------------- evaluation


class EvalResult(NamedTuple):
    loss_sum: jax.Array   # [R, S] sum of per-example losses per replica and segment (client)
    error_sum: jax.Array  # [R, S]
    real_examples: jax.Array    # scalar: examples evaluated
    padded_examples: jax.Array  # scalar: example slots computed (lanes * chunk * trips)


def evaluate_streams(model: Model, params, X, Y, idx, seg, length, stream_of_replica,
                     num_segments: int, chunk: int, lanes: int) -> EvalResult:
    """Sum of losses and errors of each replica's model over the segments of its stream.

    Args:
      model: the model.
      params: pytree with leading dim R (one model per replica).
      X, Y: the device-resident split ([N, ...] inputs, [N] labels).
      idx: [G, L] example indices (L a multiple of `chunk`); seg: [G, L] segment of each
        entry (num_segments for padding); length: [G] real entries per stream.
      stream_of_replica: [R] which stream each replica evaluates.
      num_segments: S, the number of clients in a stream.
      chunk: examples per work item; lanes: items processed at once.
    """
    R = stream_of_replica.shape[0]
    S = num_segments
    n_chunks = _ceil_div(length, chunk)[stream_of_replica]            # [R]
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n_chunks).astype(jnp.int32)])
    total_items = cum[-1]
    trips = _ceil_div(total_items, lanes)
    offs = jnp.arange(chunk, dtype=jnp.int32)

    def item_io(u):
        """Index work for item u: replica, valid mask, example ids and segments."""
        in_range = u < total_items
        r = jnp.clip(jnp.searchsorted(cum, u, side="right") - 1, 0, R - 1).astype(jnp.int32)
        q = u - cum[r]
        g = stream_of_replica[r]
        start = q * chunk
        ex = lax.dynamic_slice(idx, (g, start), (1, chunk))[0]
        sg = lax.dynamic_slice(seg, (g, start), (1, chunk))[0]
        valid = in_range & (start + offs < length[g])
        return r, ex, jnp.where(valid, sg, S), valid

    def item_sums(p, x, y, sg, valid):
        loss, err = model.losses_and_errors(p, x, y)
        loss = jnp.where(valid, loss, 0.0)
        err = jnp.where(valid, err, 0.0)
        return (jax.ops.segment_sum(loss, sg, S + 1), jax.ops.segment_sum(err, sg, S + 1))

    run_items = _per_lane(item_sums, lanes)

    def body(carry):
        t, loss_acc, err_acc, real = carry
        u = t * lanes + jnp.arange(lanes, dtype=jnp.int32)
        r, ex, sg, valid = jax.vmap(item_io)(u)
        x = jnp.take(X, ex, axis=0)
        y = jnp.take(Y, ex, axis=0)
        ls, es = run_items(_gather_replicas(params, r), x, y, sg, valid)
        loss_acc = loss_acc.at[r].add(ls)
        err_acc = err_acc.at[r].add(es)
        return t + 1, loss_acc, err_acc, real + jnp.sum(valid)

    zeros = jnp.zeros((R, S + 1), jnp.float32)
    init = (jnp.int32(0), zeros, zeros, jnp.int32(0))
    _, loss_acc, err_acc, real = lax.while_loop(lambda c: c[0] < trips, body, init)
    return EvalResult(loss_sum=loss_acc[:, :S], error_sum=err_acc[:, :S],
                      real_examples=real, padded_examples=trips * lanes * chunk)


# ----------------------------------------------------------------------------- training


class TrainResult(NamedTuple):
    delta_sum: Params        # [R, ...] sum over finished, finite jobs of a_j (w_j - w_r)
    weight_sum: jax.Array    # [R] sum of a_j over the same jobs
    job_sqnorm: jax.Array    # [R, m] ||w_j - w_r||^2 of each finished job (0 if not trained)
    job_finite: jax.Array    # [R, m] bool: the job finished and its update is finite
    job_trained: jax.Array   # [R, m] bool: the job ran
    real_examples: jax.Array    # scalar: examples that went through local SGD
    padded_examples: jax.Array  # scalar: example slots computed (trips * lanes * batch)
    trips: jax.Array            # scalar: loop iterations


class LocalSGDConfig(NamedTuple):
    """Static choices of LocalUpdate."""

    batch_size: int
    lanes: int
    make_optimizer: Callable  # (learning_rate, l2) -> optax.GradientTransformation
    use_prox: bool = False    # add (mu/2)||w - w_t||^2 to the local objective (FedProx)
    lane_mode: str = "vmap"   # how lanes > 1 run: "vmap" or "unroll" (see _per_lane)


def sgd_with_weight_decay(learning_rate, l2):
    """The paper's local step w <- (1 - lr l2) w - lr grad, as an optax transform."""
    return optax.chain(optax.add_decayed_weights(l2), optax.sgd(learning_rate))


def train_jobs(model: Model, params, X, Y, plan, replica_group, job_weight, learning_rate,
               l2, prox_mu, cfg: LocalSGDConfig) -> TrainResult:
    """LocalUpdate for every job (r, i) with job_weight[r, i] > 0, and the weighted sums.

    Args:
      params: pytree, leading dim R: w_t of each replica.
      X, Y: the device-resident training split.
      plan: the round's :class:`deltafl_jax.plan.RoundPlan` (device arrays, [G, ...]).
      replica_group: [R] group (seed) of each replica.
      job_weight: [R, m] aggregation weight a_{r,i}; 0 means the client does not train.
      learning_rate, l2, prox_mu: [R] per-replica values for this round.
      cfg: static choices.
    """
    R, m = job_weight.shape
    J = R * m
    c = cfg.lanes
    B = cfg.batch_size
    weight = job_weight.reshape(J)
    job_r = jnp.repeat(jnp.arange(R, dtype=jnp.int32), m)
    job_i = jnp.tile(jnp.arange(m, dtype=jnp.int32), R)
    job_g = replica_group[job_r]
    steps = jnp.where(weight > 0, plan.steps[job_g, job_i], 0).astype(jnp.int32)

    # Deal the trained jobs to lanes: longest first, in snake order (0..c-1, c-1..0, ...).
    order = jnp.argsort(-steps, stable=True).astype(jnp.int32)
    n_trained = jnp.sum(steps > 0)
    pos = jnp.arange(J, dtype=jnp.int32)
    row, col = pos // c, pos % c
    lane = jnp.where(row % 2 == 0, col, c - 1 - col)
    real = pos < n_trained
    Q = _ceil_div(J, c)
    lane_jobs = jnp.full((c, Q), J, jnp.int32).at[lane, row].set(jnp.where(real, order, J))
    lane_len = jax.ops.segment_sum(real.astype(jnp.int32), lane, c)
    lane_load = jax.ops.segment_sum(jnp.where(real, steps[order], 0), lane, c)
    trips = jnp.max(lane_load)

    offs = jnp.arange(B, dtype=jnp.int32)
    lane_ids = jnp.arange(c)

    def local_objective(p, anchor, x, y, valid, mu):
        loss = model.losses(p, x, y)
        obj = jnp.sum(jnp.where(valid, loss, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
        if cfg.use_prox:
            obj = obj + 0.5 * mu * sum(
                jnp.sum(jnp.square(a - b)) for a, b in
                zip(jax.tree.leaves(p), jax.tree.leaves(anchor)))
        return obj

    def lane_step(p, opt_state, anchor, x, y, valid, lr, wd, mu):
        grads = jax.grad(local_objective)(p, anchor, x, y, valid, mu)
        opt = cfg.make_optimizer(lr, wd)
        updates, opt_state = opt.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    run_step = _per_lane(lane_step, c, cfg.lane_mode)

    def opt_init(p):
        return cfg.make_optimizer(0.0, 0.0).init(p)

    def body(carry):
        (t, q, s, lp, opt_state, anchor, delta_sum, weight_sum, sqn, fin, n_real) = carry
        j = lane_jobs[lane_ids, jnp.minimum(q, Q - 1)]
        active = q < lane_len
        js = jnp.minimum(j, J - 1)
        r, i = job_r[js], job_i[js]
        g = replica_group[r]
        fresh = active & (s == 0)

        def reset(state):
            lp, opt_state, anchor = state
            w0 = _gather_replicas(params, r)
            lp = _select_tree(fresh, w0, lp)
            anchor = _select_tree(fresh, w0, anchor)
            opt_state = _select_tree(fresh, jax.vmap(opt_init)(w0), opt_state)
            return lp, opt_state, anchor

        lp, opt_state, anchor = lax.cond(jnp.any(fresh), reset, lambda st: st,
                                         (lp, opt_state, anchor))
        nb = plan.batches_per_epoch[g, i]
        sl = plan.seg_len[g, i]
        e, b = s // nb, s % nb
        within = b[:, None] * B + offs[None, :]
        valid = (within < sl[:, None]) & active[:, None]
        where_ = plan.train_start[g, i][:, None] + e[:, None] * sl[:, None] + within
        ex = plan.train_idx[g[:, None], jnp.where(valid, where_, 0)]
        x = jnp.take(X, ex, axis=0)
        y = jnp.take(Y, ex, axis=0)
        new_p, new_opt = run_step(lp, opt_state, anchor, x, y, valid,
                                  learning_rate[r], l2[r], prox_mu[r])
        lp = _select_tree(active, new_p, lp)
        opt_state = _select_tree(active, new_opt, opt_state)
        done = active & (s == steps[js] - 1)

        def finish(acc):
            delta_sum, weight_sum, sqn, fin = acc
            delta = jax.tree.map(lambda a, w: a - w, lp, anchor)
            ok = jax.vmap(_tree_all_finite)(delta) & done
            coef = jnp.where(ok, weight[js], 0.0)

            def add(total, d):
                d = jnp.where(ok.reshape((c,) + (1,) * (d.ndim - 1)), d, 0.0)
                return total.at[r].add(coef.reshape((c,) + (1,) * (d.ndim - 1)) * d)

            delta_sum = jax.tree.map(add, delta_sum, delta)
            weight_sum = weight_sum.at[r].add(coef)
            slot = jnp.where(done, js, J)
            sqn = sqn.at[slot].set(jax.vmap(_tree_sqnorm)(delta), mode="drop")
            fin = fin.at[slot].set(ok, mode="drop")
            return delta_sum, weight_sum, sqn, fin

        delta_sum, weight_sum, sqn, fin = lax.cond(
            jnp.any(done), finish, lambda acc: acc, (delta_sum, weight_sum, sqn, fin))
        s = jnp.where(done, 0, jnp.where(active, s + 1, s))
        q = jnp.where(done, q + 1, q)
        return (t + 1, q, s, lp, opt_state, anchor, delta_sum, weight_sum, sqn, fin,
                n_real + jnp.sum(valid))

    lane_params = jax.tree.map(lambda a: jnp.zeros((c,) + a.shape[1:], a.dtype), params)
    init = (jnp.int32(0), jnp.zeros((c,), jnp.int32), jnp.zeros((c,), jnp.int32),
            lane_params, jax.vmap(opt_init)(lane_params), lane_params,
            jax.tree.map(jnp.zeros_like, params), jnp.zeros((R,), jnp.float32),
            jnp.zeros((J,), jnp.float32), jnp.zeros((J,), bool), jnp.int32(0))
    out = lax.while_loop(lambda cr: cr[0] < trips, body, init)
    (_, _, _, _, _, _, delta_sum, weight_sum, sqn, fin, n_real) = out
    return TrainResult(delta_sum=delta_sum, weight_sum=weight_sum,
                       job_sqnorm=sqn.reshape(R, m), job_finite=fin.reshape(R, m),
                       job_trained=(steps > 0).reshape(R, m), real_examples=n_real,
                       padded_examples=trips * c * B, trips=trips)
