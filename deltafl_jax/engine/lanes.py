"""Lanes: how client work is dealt and run side by side inside one jitted program.

A *lane* runs work items one after another inside a ``lax.while_loop`` whose trip count comes
from the data; ``lanes`` lanes advance together, one step per trip. With one lane a step is an
ordinary (unbatched) model step; with more lanes the step is ``jax.vmap``-ed over lanes
("vmap", for accelerators and small models) or copied once per lane ("unroll": unbatched
copies that XLA:CPU runs concurrently while each keeps ordinary convolutions).

:func:`deal_jobs` deals training jobs to lanes: longest first, in snake order
(0..c-1, c-1..0, ...), so the busiest lane, which sets the trip count, stays close to the mean.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

LANE_MODES = ("vmap", "unroll")


class LoopShape(NamedTuple):
    """How the local-SGD loop body is laid out: `unroll` minibatch steps per while trip, and
    whether a lane's restart and a finished job's bookkeeping run behind a ``lax.cond``
    (branchless=False) or as masked selects on every step."""

    unroll: int = 1
    branchless: bool = False


def loop_shape(backend: str) -> LoopShape:
    """Measured on the 2-core CPU (bench/README.md): unrolling 2-16 steps per trip changed
    nothing beyond noise, and the branchless body was ~1.5x slower (XLA:CPU's cond is cheap,
    the masked bookkeeping is not). Not measured on accelerators yet, so they keep the same."""
    del backend
    return LoopShape()


def ceil_div(a, b):
    return (a + b - 1) // b


def per_lane(fn, lanes: int, mode: str = "vmap"):
    """Run `fn` on every lane (inputs and outputs carry a leading lane axis)."""
    if mode not in LANE_MODES:
        raise ValueError(f"unknown lane mode {mode!r}; expected one of {LANE_MODES}")
    if lanes == 1 or mode == "unroll":
        def unrolled(*args):
            outs = [fn(*jax.tree.map(lambda a, i=i: a[i], args)) for i in range(lanes)]
            return jax.tree.map(lambda *o: jnp.stack(o), *outs)
        return unrolled
    return jax.vmap(fn)


class LaneDeal(NamedTuple):
    """Jobs dealt to c lanes.

    jobs: [c, Q] int32, the job ids of each lane in order (J = an empty slot), Q = ceil(J / c).
    length: [c] int32, the jobs of each lane.
    load: [c] int32, the steps of each lane.
    trips: [] int32, the steps of the busiest lane (the loop's trip count).
    """

    jobs: jax.Array
    length: jax.Array
    load: jax.Array
    trips: jax.Array


def deal_jobs(steps, lanes: int) -> LaneDeal:
    """Deal the jobs with steps > 0 (steps: [J] int32) to `lanes` lanes, longest first, in
    snake order; ties keep job order. A pure function, jittable."""
    J = steps.shape[0]
    c = lanes
    order = jnp.argsort(-steps, stable=True).astype(jnp.int32)
    n_trained = jnp.sum(steps > 0)
    pos = jnp.arange(J, dtype=jnp.int32)
    row, col = pos // c, pos % c
    lane = jnp.where(row % 2 == 0, col, c - 1 - col)
    real = pos < n_trained
    Q = ceil_div(J, c)
    jobs = jnp.full((c, Q), J, jnp.int32).at[lane, row].set(jnp.where(real, order, J))
    length = jax.ops.segment_sum(real.astype(jnp.int32), lane, c)
    load = jax.ops.segment_sum(jnp.where(real, steps[order], 0), lane, c)
    return LaneDeal(jobs=jobs, length=length, load=load, trips=jnp.max(load))


def finish_order(steps, lanes: int):
    """The jobs of one replica (steps: [m] int32; 0: no work) in the order in which they
    finish when they are dealt alone to `lanes` lanes (:func:`deal_jobs`): by the step at
    which they finish, then by lane; jobs without work last, in slot order. [m] int32.

    The engine adds a replica's finished updates in this order, whatever the other jobs of
    its program, so that its sums depend on its own jobs only."""
    m = steps.shape[0]
    deal = deal_jobs(steps, lanes)
    real = deal.jobs < m
    lane_steps = jnp.where(real, steps[jnp.minimum(deal.jobs, m - 1)], 0)
    end = jnp.cumsum(lane_steps, axis=1, dtype=jnp.int32)                  # [c, Q]
    lane = jnp.arange(lanes, dtype=jnp.int32)[:, None]
    big = jnp.iinfo(jnp.int32).max
    key = jnp.full((m + 1,), big, jnp.int32).at[jnp.where(real, deal.jobs, m)].set(
        jnp.where(real, end * lanes + lane, big))[:m]
    return jnp.argsort(key, stable=True).astype(jnp.int32)


def deal_rows(deal: LaneDeal, J: int):
    """[J] int32: each job's row in the deal's table read lane by lane (lane l's q-th job:
    l * Q + q); c * Q for a job that is not dealt (no steps)."""
    flat = deal.jobs.reshape(-1)
    n = flat.shape[0]
    return jnp.full((J + 1,), n, jnp.int32).at[flat].set(jnp.arange(n, dtype=jnp.int32))[:J]


def slot_blocks(tree, blocks: int):
    """Leaves [c, ...] -> [blocks, c, k]: each row flattened, padded with zeros to blocks x k
    elements (k = ceil(size / blocks)) and cut into `blocks` consecutive blocks."""
    def one(v):
        size = math.prod(v.shape[1:])
        k = ceil_div(size, blocks)
        flat = jnp.pad(v.reshape(v.shape[0], size), ((0, 0), (0, blocks * k - size)))
        return flat.reshape(v.shape[0], blocks, k).transpose(1, 0, 2)
    return jax.tree.map(one, tree)


def slot_tables(like, slots: int, blocks: int):
    """Zeros [blocks, slots, k] for each leaf of `like` (leaves [R, ...]; one slot holds a
    [...] row cut into blocks as by :func:`slot_blocks`)."""
    return jax.tree.map(lambda v: jnp.zeros(
        (blocks, slots, ceil_div(math.prod(v.shape[1:]), blocks)), v.dtype), like)


EXCHANGE_CHUNK_BYTES = 8 << 20
"""The most bytes of one leaf's block of a device's rows that one collective permute of
:func:`device_ordered_sum` moves: a bigger block crosses in chunks, one after another."""


def device_ordered_sum(tables, rows, axis, like, chunk_bytes: Optional[int] = None):
    """sum_k row[rows[r, k]] for every replica r, one row at a time in the order given, starting
    from zeros, of the D devices' slot tables' rows stacked in device order: the same
    [R, ...] sums (the leaves of `like` without their first axis) on every device; a row past
    the D x S rows adds nothing. Each element is added in the same order whatever the leaves'
    shape, so a slice of the elements sums to the same bits alone.

    tables: this device's :func:`slot_tables` [D, S, k] (D = ``axis.count`` blocks per row);
    rows: [R, m] int32 into the D x S stacked rows (device j's slot s: j * S + s; D x S:
    nothing). No device holds every row: device i adds, over all the rows, block i of each
    row. It reads block i of its own rows in place, and block i of device j's rows arrives in
    one of D - 1 collective permutes (``axis.shift`` by s = i - j mod D: every device sends
    block i + s of its rows to device i + s). So the other devices' blocks are copied twice
    (cut out, then permuted) and a device's own block not at all, where an all-to-all, which
    XLA:CPU runs as slices, the exchange and a concatenation, copied every block three times
    (docs/benchmarks/pfl-research.md measures both); each step of the sum reads the row's
    block from each of the D sources and keeps the one it needs.

    A leaf whose block of S rows holds more than `chunk_bytes` (None:
    :data:`EXCHANGE_CHUNK_BYTES`) crosses in chunks of its
    columns, one chunk's permutes and sum after another (:func:`_chunked_sum`), so that the
    copies in flight take little memory: XLA:CPU allocates a program's temporaries afresh,
    page by page, at every execution.

    One psum of the [R, D, k] sums joins the blocks (the other devices' blocks are zeros
    there, and a sum that starts from +0 is never -0, so adding them changes no bit). Every
    element is added in the same order as on one device."""
    D = axis.count
    chunk_bytes = EXCHANGE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows = jnp.asarray(rows)
    R = rows.shape[0]
    leaves, treedef = jax.tree.flatten(tables)
    S = leaves[0].shape[1]
    big = [D > 1 and S * t.shape[2] * t.dtype.itemsize > chunk_bytes for t in leaves]
    whole = iter(_ordered_sum([_sources(t, axis) for t, b in zip(leaves, big) if not b],
                              rows, axis, S))
    parts = [_chunked_sum(t, rows, axis, chunk_bytes) if b else next(whole)
             for t, b in zip(leaves, big)]

    def join(part, v):   # [R, k] -> [R, ...]
        k = part.shape[1]
        if D > 1:
            part = axis.sum(jnp.zeros((R, D, k), part.dtype).at[:, axis.index()].set(part))
        flat = part.reshape(R, D * k)[:, :math.prod(v.shape[1:])]
        return flat.reshape((R,) + v.shape[1:])

    return jax.tree.unflatten(treedef, [join(p, v) for p, v in
                                        zip(parts, jax.tree.leaves(like))])


def _sources(t, axis):
    """by_shift[s] [S, k]: block `here` of the rows of device here - s (s = 0: this device's
    own, read in place; the others through ``axis.shift``) of a [D, S, k] table."""
    D, here = axis.count, axis.index()

    def block(j):
        return jax.lax.dynamic_index_in_dim(t, j, 0, keepdims=False)

    return [block(here)] + [axis.shift(block((here + s) % D), s) for s in range(1, D)]


def _ordered_sum(by_leaf, rows, axis, S):
    """Per leaf, [R, k']: its rows[r, q] added for q = 0, 1, ... from zeros, each row read from
    the one of the leaf's D sources (:func:`_sources`) that holds it."""
    D, here = axis.count, axis.index()
    R, m = rows.shape

    def add(q, totals):
        keep = (rows[:, q] < D * S)[:, None]
        row = jnp.minimum(rows[:, q], D * S - 1)
        slot, shift = row % S, (here - row // S) % D

        def pick(by_shift):
            val = by_shift[0][slot]
            for s in range(1, D):
                val = jnp.where((shift == s)[:, None], by_shift[s][slot], val)
            return val

        return [t + jnp.where(keep, pick(src), 0) for t, src in zip(totals, by_leaf)]

    return jax.lax.fori_loop(0, m, add, [jnp.zeros((R, src[0].shape[1]), src[0].dtype)
                                         for src in by_leaf])


def _chunked_sum(t, rows, axis, chunk_bytes: int):
    """:func:`_ordered_sum` of one [D, S, k] table in C chunks of kc columns, at most
    `chunk_bytes` a block (a ``fori_loop`` of C trips, the same on every device, so the
    permutes inside pair up). The last chunk starts at k - kc and so redoes a few columns of
    the one before, to the same bits."""
    _, S, k = t.shape
    C = ceil_div(S * k * t.dtype.itemsize, chunk_bytes)
    kc = ceil_div(k, C)

    def one(c, total):
        start = jnp.minimum(c * kc, k - kc)
        cut = jax.lax.dynamic_slice_in_dim(t, start, kc, axis=2)
        part, = _ordered_sum([_sources(cut, axis)], rows, axis, S)
        return jax.lax.dynamic_update_slice_in_dim(total, part, start, axis=1)

    return jax.lax.fori_loop(0, C, one, jnp.zeros((rows.shape[0], k), t.dtype))


def device_share(deal: LaneDeal, device, lanes: int) -> LaneDeal:
    """Device `device`'s lanes [device * lanes, (device + 1) * lanes) of a deal over
    devices x lanes global lanes, with that device's own trip count."""
    start = device * lanes
    jobs = jax.lax.dynamic_slice_in_dim(deal.jobs, start, lanes, axis=0)
    length = jax.lax.dynamic_slice_in_dim(deal.length, start, lanes)
    load = jax.lax.dynamic_slice_in_dim(deal.load, start, lanes)
    return LaneDeal(jobs=jobs, length=length, load=load, trips=jnp.max(load))


class LaneTimeline:
    """Jobs of `steps` [J] (int32; 0: no work) dealt to `lanes` lanes, or to this device's
    lanes of D x `lanes` global lanes (`axis`), and where each lane stands at a step.

    Lane l runs its jobs back to back from step 0: its q-th job covers steps
    [start[l, q], start[l, q + 1]). A job's steps are numbered 0 .. steps - 1 within it.
    A device's jobs have ``slots`` = lanes x Q rows (lane l's q-th job: row l * Q + q);
    ``rows`` [J] gives each job's row in the ``devices`` tables stacked in device order
    (``first_row`` is this device's first; devices x slots: a job not dealt).
    """

    def __init__(self, steps, lanes: int, axis=None):
        self.J, self.c, self.steps = steps.shape[0], lanes, steps
        count = axis.count if axis is not None else 1
        full = deal_jobs(steps, lanes * count)
        device = axis.index() if count > 1 else 0
        self.deal = device_share(full, device, lanes) if count > 1 else full
        # the jobs' rows in the devices' slot tables stacked in device order ([count * slots])
        self.slots, self.devices = lanes * full.jobs.shape[1], count
        self.rows = deal_rows(full, self.J)
        self.first_row = device * self.slots
        lane_steps = jnp.where(self.deal.jobs < self.J,
                               steps[jnp.minimum(self.deal.jobs, self.J - 1)], 0)
        self.start = jnp.concatenate([jnp.zeros((lanes, 1), jnp.int32),
                                      jnp.cumsum(lane_steps, axis=1, dtype=jnp.int32)], axis=1)

    def job_of(self, q):
        """Job ids [c, ...] of the lanes' q-th jobs, clipped to valid ids."""
        Q = self.deal.jobs.shape[1]
        lane = jnp.arange(self.c).reshape((self.c,) + (1,) * (q.ndim - 1))
        return jnp.minimum(self.deal.jobs[lane, jnp.minimum(q, Q - 1)], self.J - 1)

    def at(self, t):
        """At steps t ([1, K] int32): each lane's job js, the step s within it, whether the
        lane has a job (active), its first step (fresh) and its last (done); each [c, K]."""
        q = jnp.sum(self.start[:, None, 1:] <= t[..., None], axis=-1)          # [c, K]
        active = q < self.deal.length[:, None]
        js = self.job_of(q)
        s = t - jnp.take_along_axis(self.start, jnp.minimum(q, self.start.shape[1] - 1), 1)
        return js, s, active, active & (s == 0), active & (s == self.steps[js] - 1)
