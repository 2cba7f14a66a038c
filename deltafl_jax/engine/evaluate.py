"""Client evaluation for many models in one jitted program: F_k(w) (Algorithm 2, line 4) and
the per-client errors of the papers' metrics (App. C.2.3).

Evaluation items are (replica, chunk of `chunk` examples) over the packed example stream of the
clients, so clients of ragged sizes share chunks and padding stays below one chunk per
replica. ``lanes`` items run per trip of a ``lax.while_loop`` whose trip count comes from the
data. Each item's sums go to its own row of a [R, items per replica, S + 1] buffer, added up
after the loop one item at a time in the replica's stream order: a replica's sums depend on its
own stream only, neither on the other replicas of the program nor on how many devices share
the items. Nothing here is jitted: the caller jits the round once.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deltafl_jax.engine.lanes import ceil_div, per_lane
from deltafl_jax.engine.mesh import SINGLE, DeviceAxis
from deltafl_jax.engine.trees import gather_rows
from deltafl_jax.models import Model


class EvalResult(NamedTuple):
    loss_sum: jax.Array   # [R, S] sum of per-example losses per replica and segment (client)
    error_sum: jax.Array  # [R, S]
    real_examples: jax.Array    # scalar: examples evaluated
    padded_examples: jax.Array  # scalar: example slots computed (lanes * chunk * trips)
    trips: jax.Array            # scalar: loop iterations (the busiest device's)


class EvalCarry(NamedTuple):
    trip: jax.Array      # [] int32
    loss_acc: jax.Array  # [R, Q, S + 1] each item's sums, by (replica, chunk of its stream)
    err_acc: jax.Array   # [R, Q, S + 1]
    real: jax.Array      # [] int32


def _item_reader(idx, seg, length, stream_of_replica, cum, total_items, chunk, S):
    """item u -> (replica, its chunk q, example ids [chunk], segments [chunk], valid
    [chunk])."""
    R = stream_of_replica.shape[0]
    offs = jnp.arange(chunk, dtype=jnp.int32)

    def item_io(u):
        in_range = u < total_items
        # searchsorted(cum, u, side="right") - 1, as one comparison over the R + 1 offsets
        # (jnp.searchsorted's default is a nested while loop: sequential trips in each trip).
        r = jnp.clip(jnp.sum(cum <= u) - 1, 0, R - 1).astype(jnp.int32)
        q = u - cum[r]
        g = stream_of_replica[r]
        start = q * chunk
        ex = lax.dynamic_slice(idx, (g, start), (1, chunk))[0]
        sg = lax.dynamic_slice(seg, (g, start), (1, chunk))[0]
        valid = in_range & (start + offs < length[g])
        return r, q, ex, jnp.where(valid, sg, S), valid   # q past the stream: never summed

    return item_io


def in_stream_order(items, n_chunks, init=None):
    """Each replica's items ([R, Q, S + 1] pairs of sums) added one after another in stream
    order, from `init` ((loss_sum, error_sum), each [R, S]) or zeros: [R, S + 1] each."""
    R, Q, S1 = items[0].shape

    def add(q, total):
        live = (q < n_chunks)[:, None]
        return tuple(jnp.where(live, t + a[:, q], t) for t, a in zip(total, items))

    zeros = jnp.zeros((R, S1), jnp.float32)
    start = (zeros, zeros) if init is None else tuple(
        zeros.at[:, :S1 - 1].set(a.astype(jnp.float32)) for a in init)
    return lax.fori_loop(0, Q, add, start)


class EvalStreams(NamedTuple):
    """G packed example streams, each the examples of S clients (segments) back to back."""

    idx: jax.Array       # [G, L] example indices (L a multiple of the chunk)
    seg: jax.Array       # [G, L] segment (client) of each entry; S for padding
    length: jax.Array    # [G] real entries per stream
    num_segments: int    # S, the number of clients in a stream


class EvalLayout(NamedTuple):
    """How evaluation work is cut and run: static for a program."""

    chunk: int                  # examples per work item
    lanes: int                  # items processed at once (per device)
    axis: DeviceAxis = SINGLE   # the devices sharing the items


def evaluate_streams(model: Model, params, X, Y, streams: EvalStreams, stream_of_replica,
                     layout: EvalLayout, init=None) -> EvalResult:
    """Sum of losses and errors of each replica's model over the segments of its stream.

    Args:
      model: the model.
      params: pytree with leading dim R (one model per replica).
      X, Y: the device-resident split ([N, ...] inputs, [N] labels).
      streams: the G streams (:class:`EvalStreams`).
      stream_of_replica: [R] which stream each replica evaluates.
      layout: chunk, lanes and the devices sharing the items (round-robin over D x lanes
        global lanes); the sums are reduced once after the loop.
      init: (loss_sum, error_sum), each [R, S], to continue from (None: zeros): a stream
        evaluated in blocks one after another (the host-kept split) adds up in the order of one
        whole stream, so on one device the sums are the same bit for bit.
    """
    idx, seg, length, num_segments = streams
    chunk, lanes, axis = layout
    R = stream_of_replica.shape[0]
    S = num_segments
    n_chunks = ceil_div(length, chunk)[stream_of_replica]            # [R]
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n_chunks).astype(jnp.int32)])
    total_items = cum[-1]
    first = axis.index() * lanes            # this device's first global lane
    stride = axis.count * lanes
    trips = ceil_div(jnp.maximum(total_items - first, 0), stride)
    item_io = _item_reader(idx, seg, length, stream_of_replica, cum, total_items, chunk, S)

    def item_sums(p, x, y, sg, valid):
        loss, err = model.losses_and_errors(p, x, y)
        loss = jnp.where(valid, loss, 0.0)
        err = jnp.where(valid, err, 0.0)
        return (jax.ops.segment_sum(loss, sg, S + 1), jax.ops.segment_sum(err, sg, S + 1))

    run_items = per_lane(item_sums, lanes)

    def body(c: EvalCarry) -> EvalCarry:
        u = c.trip * stride + first + jnp.arange(lanes, dtype=jnp.int32)
        r, q, ex, sg, valid = jax.vmap(item_io)(u)
        x = jnp.take(X, ex, axis=0)
        y = jnp.take(Y, ex, axis=0)
        ls, es = run_items(gather_rows(params, r), x, y, sg, valid)
        return EvalCarry(trip=c.trip + 1, loss_acc=c.loss_acc.at[r, q].set(ls, mode="drop"),
                         err_acc=c.err_acc.at[r, q].set(es, mode="drop"),
                         real=c.real + jnp.sum(valid))

    Q = ceil_div(idx.shape[1], chunk)   # the most items of one replica
    zeros = jnp.zeros((R, Q, S + 1), jnp.float32)
    start = EvalCarry(jnp.int32(0), zeros, zeros, jnp.int32(0))
    out = lax.while_loop(lambda c: c.trip < trips, body, start)
    loss_sum, error_sum = in_stream_order(axis.sum((out.loss_acc, out.err_acc)), n_chunks, init)
    return EvalResult(loss_sum=loss_sum[:, :S],
                      error_sum=error_sum[:, :S], real_examples=axis.sum(out.real),
                      padded_examples=axis.sum(trips * lanes * chunk), trips=axis.max(trips))
