"""Host-side plan of a round: which clients, which examples, in which order.

Sampling (Algorithm 2, line 2) and the per-client shuffles of local SGD are pure functions of
(seed, round, client), drawn with NumPy from ``SeedSequence([seed, round, ...])``, so a run can
be resumed exactly and every conformity level theta trained with one seed sees the same clients
and the same minibatches (common random numbers).

A plan holds only int32 index streams into the device-resident split, padded to capacities that
are fixed for the whole run, so the jitted round never recompiles. Padding never costs work:
the engine loops over the real length of each stream (see :mod:`deltafl_jax.engine`).

Per group g (one per seed) the plan holds:

- ``clients [G, m]``: the sampled clients, without replacement;
- ``sizes [G, m]``: their example counts n_k (0 marks an empty slot);
- ``eval_idx [G, Le]`` / ``eval_seg [G, Le]`` / ``eval_len [G]``: the examples of the sampled
  clients one after another, with the slot (0..m-1) each belongs to, for F_k(w_t);
- ``train_idx [G, Lt]`` / ``train_start [G, m]``: for slot i, `epochs` fresh permutations of
  the client's examples laid end to end (enough for `local_steps` steps in steps mode);
- ``seg_len [G, m]``, ``batches_per_epoch [G, m]``, ``steps [G, m]``: how local step s reads
  its batch: epoch e, batch b = divmod(s, batches_per_epoch); positions
  e * seg_len + b * B + j, valid while b * B + j < seg_len.

The indices point into the device-resident split, or, when the host keeps the split
(``packed``: ``--client_data=host``), into the round's buffer: group g's sampled clients one
after another from row g * eval_len (:func:`pack_round` fills it). The same examples at other
rows: the round computes the same numbers. Planning costs O(m + the sampled examples), not
O(N). Evaluation streams longer than a device buffer are cut into blocks
(:func:`stream_blocks`) that add up as one stream.

Who trains is decided before the plan: a :class:`deltafl_jax.sampling.Cohort` per group (the
sampled clients in the m slots and a ``present`` mask), drawn by the run's sampler
(:mod:`deltafl_jax.sampling.samplers`: fixed, Poisson, cyclic, by weights) among the clients
online in the round. The plan keeps fixed shapes whatever the cohort's size: an empty slot
(``present`` False, a Poisson cohort below its cap or fewer clients online than m) has size 0,
no examples and no local step, and the round gives it weight 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np

from deltafl_jax.sampling.samplers import (Cohort, FixedSampler, cyclic_cohort,  # noqa: F401
                                           overflow_probability, poisson_cap, poisson_cohort,
                                           sample_by_weights, sample_clients)

_SHUFFLE_STREAM = 1
_PROBE_STREAM = 4


class ProbePlan(NamedTuple):
    """A second, uniform sample of m clients per group, evaluated at a model the algorithm
    chooses after local training (DRFA's snapshot average): clients, sizes [G, m] and their
    evaluation streams eval_idx, eval_seg [G, Le], eval_len [G] (as :class:`RoundPlan`'s)."""

    clients: np.ndarray
    sizes: np.ndarray
    eval_idx: np.ndarray
    eval_seg: np.ndarray
    eval_len: np.ndarray


def make_probe_plan(seeds: Sequence[int], round_idx: int, offsets: np.ndarray, m: int,
                    caps: "Capacities") -> ProbePlan:
    """m distinct clients per seed drawn uniformly from the stream [seed, round,
    _PROBE_STREAM] (independent of the round's own sample), with their examples' stream
    into the split (the device-held split only)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    G = len(seeds)
    clients = np.zeros((G, m), np.int32)
    eval_idx = np.zeros((G, caps.eval_len), np.int32)
    eval_seg = np.full((G, caps.eval_len), m, np.int32)
    eval_len = np.zeros((G,), np.int32)
    for g, seed in enumerate(seeds):
        rng = np.random.default_rng([int(seed), int(round_idx), _PROBE_STREAM])
        chosen = np.sort(rng.choice(offsets.size - 1, size=m, replace=False))
        clients[g] = chosen
        n = offsets[chosen + 1] - offsets[chosen]
        total = int(n.sum())
        eval_len[g] = total
        eval_idx[g, :total] = np.concatenate([np.arange(s, s + k)
                                              for s, k in zip(offsets[chosen], n)])
        eval_seg[g, :total] = np.repeat(np.arange(m, dtype=np.int32), n)
    sizes = (offsets[clients + 1] - offsets[clients]).astype(np.int32)
    return ProbePlan(clients=clients, sizes=sizes, eval_idx=eval_idx, eval_seg=eval_seg,
                     eval_len=eval_len)


def client_permutations(seed: int, round_idx: int, client: int, n: int, epochs: int) -> np.ndarray:
    """`epochs` independent permutations of range(n), concatenated: the order in which the
    client visits its examples in this round."""
    rng = np.random.default_rng([int(seed), int(round_idx), _SHUFFLE_STREAM, int(client)])
    return np.concatenate([rng.permutation(n) for _ in range(epochs)]).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class LocalWork:
    """How much local SGD a client does: `local_epochs` epochs, or exactly `local_steps`
    steps (which cycle through fresh permutations) when local_steps is set."""

    batch_size: int
    local_epochs: int = 1
    local_steps: Optional[int] = None

    def epochs_for(self, n: np.ndarray) -> np.ndarray:
        n = np.asarray(n, dtype=np.int64)
        if self.local_steps is None:
            return np.full_like(n, self.local_epochs)
        return -(-(self.local_steps * self.batch_size) // n)  # ceil(K B / n)

    def steps_for(self, n: np.ndarray) -> np.ndarray:
        n = np.asarray(n, dtype=np.int64)
        if self.local_steps is None:
            return self.local_epochs * (-(-n // self.batch_size))
        return np.full_like(n, self.local_steps)


class RoundPlan(NamedTuple):
    """Index streams of one round (shapes in the module docstring)."""

    clients: np.ndarray
    sizes: np.ndarray
    eval_idx: np.ndarray
    eval_seg: np.ndarray
    eval_len: np.ndarray
    train_idx: np.ndarray
    train_start: np.ndarray
    seg_len: np.ndarray
    batches_per_epoch: np.ndarray
    steps: np.ndarray


class RoundData(NamedTuple):
    """x: [N, ...] and y: [N] the training split on the device; plan: this round's
    :class:`RoundPlan` (arrays with a leading group axis G); probe: the
    round's second sample (:class:`ProbePlan`) for an algorithm with a
    ``probe``, else None."""

    x: jax.Array
    y: jax.Array
    plan: RoundPlan
    probe: Any = None


@dataclasses.dataclass(frozen=True)
class Capacities:
    """Static lengths of the streams, fixed for a run (an upper bound over all rounds)."""

    eval_len: int
    train_len: int


def capacities(sizes: np.ndarray, m: int, work: LocalWork, eval_chunk: int,
               with_replacement: bool = False) -> Capacities:
    """Upper bounds of the stream lengths over every possible sample of m clients: m distinct
    clients, or with `with_replacement` (:func:`sample_by_weights`) m draws that may all be
    the largest client."""
    sizes = np.asarray(sizes, dtype=np.int64)

    def top_m(values):
        values = np.sort(values)[::-1]
        return int(values[0]) * m if with_replacement else int(values[:m].sum())

    eval_len = top_m(sizes)
    eval_len = -(-eval_len // eval_chunk) * eval_chunk
    # Train stream of a slot: epochs_for(n) * n entries; bound it by the largest values.
    train_len = top_m(work.epochs_for(sizes) * sizes) + work.batch_size
    return Capacities(eval_len=eval_len, train_len=train_len)


def draw_cohorts(sampler, seeds: Sequence[int], round_idx: int, online=None) -> list:
    """One :class:`~deltafl_jax.sampling.Cohort` per seed: `sampler`'s draw for the round
    among `online` (one array of online ids per seed, or None: every client online)."""
    return [sampler.cohort(seed, round_idx, None if online is None else online[g])
            for g, seed in enumerate(seeds)]


def make_round_plan(seeds: Sequence[int], round_idx: int, offsets: np.ndarray, m: int,
                    work: LocalWork, caps: Capacities, packed: bool = False,
                    cohorts: Optional[Sequence[Cohort]] = None,
                    steps: Optional[np.ndarray] = None) -> RoundPlan:
    """The plan of round `round_idx` for each seed in `seeds` (one group per seed) of the
    `cohorts` (one per seed, each in m slots; None: m clients drawn uniformly from all,
    :class:`~deltafl_jax.sampling.FixedSampler`); `packed`: indices into the round's buffer
    (module docstring) instead of the split. Empty slots have size 0 and no step. `steps`
    [G, m] caps each slot's local steps (the virtual clock's: a client past the deadline keeps
    the steps it completed, :mod:`deltafl_jax.sampling.timeline`); None: the work's."""
    offsets = np.asarray(offsets, dtype=np.int64)
    if cohorts is None:
        cohorts = draw_cohorts(FixedSampler(offsets.size - 1, m), seeds, round_idx)
    G = len(seeds)
    clients = np.zeros((G, m), np.int32)
    eval_idx = np.zeros((G, caps.eval_len), np.int32)
    eval_seg = np.full((G, caps.eval_len), m, np.int32)
    eval_len = np.zeros((G,), np.int32)
    train_idx = np.zeros((G, caps.train_len), np.int32)
    train_start = np.zeros((G, m), np.int32)
    present = np.stack([np.asarray(c.present, bool) for c in cohorts]) if G else \
        np.ones((0, m), bool)
    for g, seed in enumerate(seeds):
        chosen = np.asarray(cohorts[g].clients)[present[g]]
        clients[g, :chosen.size] = chosen
        n = offsets[chosen + 1] - offsets[chosen]
        starts = (g * caps.eval_len + np.cumsum(n) - n) if packed else offsets[chosen]
        total = int(n.sum())
        eval_len[g] = total
        if total:
            eval_idx[g, :total] = np.concatenate([np.arange(s, s + k)
                                                  for s, k in zip(starts, n)])
        eval_seg[g, :total] = np.repeat(np.arange(chosen.size, dtype=np.int32), n)
        epochs = work.epochs_for(n)
        pos = 0
        for i, (client, start, k, e) in enumerate(zip(chosen, starts, n, epochs)):
            perm = client_permutations(seed, round_idx, int(client), int(k), int(e))
            train_start[g, i] = pos
            train_idx[g, pos:pos + perm.size] = start + perm
            pos += perm.size
    sizes, seg_len, batches_per_epoch, steps = _slot_work(clients, present, offsets, work,
                                                          cap=steps)
    return RoundPlan(clients=clients, sizes=sizes, eval_idx=eval_idx, eval_seg=eval_seg,
                     eval_len=eval_len, train_idx=train_idx, train_start=train_start,
                     seg_len=seg_len, batches_per_epoch=batches_per_epoch, steps=steps)


def _slot_work(clients, present, offsets, work: LocalWork, cap=None):
    """(sizes, seg_len, batches_per_epoch, steps), each [G, m] int32, of the slots' clients
    (steps at most `cap` [G, m] when given); an empty slot (not `present`) has no examples and
    no steps (one empty batch an epoch)."""
    sizes = (offsets[clients + 1] - offsets[clients]).astype(np.int32)
    sizes = np.where(present, sizes, 0).astype(np.int32)
    if work.local_steps is None:
        seg_len = sizes
    else:
        seg_len = (work.epochs_for(np.maximum(sizes, 1)) * sizes).astype(np.int32)
    batches_per_epoch = (-(-seg_len // work.batch_size)).astype(np.int32)
    steps = work.steps_for(sizes).astype(np.int32)
    batches_per_epoch = np.where(present, batches_per_epoch, 1).astype(np.int32)
    steps = np.where(present, steps, 0).astype(np.int32)
    if cap is not None:
        steps = np.minimum(steps, np.asarray(cap, np.int64)).astype(np.int32)
    return sizes, seg_len, batches_per_epoch, steps


def pack_round(split, clients: np.ndarray, caps: Capacities,
               sizes: Optional[np.ndarray] = None):
    """The round's buffer (x [G * eval_len, ...], y [G * eval_len] int32) of a packed plan:
    group g's sampled clients `clients[g]` one after another from row g * eval_len, zeros
    after them (`sizes`: the plan's, whose 0 marks an empty slot, left out). `split` is any
    split with ``gather`` (:mod:`deltafl_jax.data`)."""
    G = clients.shape[0]
    x = np.zeros((G * caps.eval_len,) + tuple(split.feature_shape), split.x_dtype)
    y = np.zeros((G * caps.eval_len,), np.int32)
    for g in range(G):
        ids = clients[g] if sizes is None else clients[g][np.asarray(sizes[g]) > 0]
        xs, ys = split.gather(ids)
        lo = g * caps.eval_len
        x[lo:lo + len(xs)] = xs
        if ys is not None:
            y[lo:lo + len(ys)] = ys
    return x, y


class StreamBlock(NamedTuple):
    """One block of an evaluation stream (clients one after another): stream positions
    [lo, hi), the clients [first, last) of the list that it touches, and its segment array."""

    lo: int
    hi: int
    first: int
    last: int
    seg: np.ndarray      # [1, block_len] int32: list index of each entry; pad_segment after
    length: np.ndarray   # [1] int32: hi - lo


def stream_blocks(sizes: np.ndarray, block_len: int, pad_segment: int):
    """The blocks of `block_len` entries of the stream of clients with `sizes` (in order)."""
    sizes = np.asarray(sizes, np.int64)
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if sizes.size else 0
    for lo in range(0, total, block_len):
        hi = min(lo + block_len, total)
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(ends, hi - 1, side="right")) + 1
        seg = np.full((1, block_len), pad_segment, np.int32)
        seg[0, :hi - lo] = np.searchsorted(ends, np.arange(lo, hi), side="right")
        yield StreamBlock(lo, hi, first, last, seg, np.array([hi - lo], np.int32))


class SplitPlan(NamedTuple):
    """A whole split as one evaluation stream: every example, with its client index."""

    eval_idx: np.ndarray  # [1, L]
    eval_seg: np.ndarray  # [1, L]
    eval_len: np.ndarray  # [1]


def make_split_plan(offsets: np.ndarray, eval_chunk: int,
                    num_segments: Optional[int] = None) -> SplitPlan:
    """`num_segments` (>= the number of clients) marks padding; splits of different sizes can
    share it, and then one compiled evaluation."""
    offsets = np.asarray(offsets, dtype=np.int64)
    total = int(offsets[-1])
    num_clients = offsets.size - 1
    pad_segment = num_clients if num_segments is None else int(num_segments)
    cap = -(-total // eval_chunk) * eval_chunk
    idx = np.zeros((1, cap), np.int32)
    idx[0, :total] = np.arange(total)
    seg = np.full((1, cap), pad_segment, np.int32)
    seg[0, :total] = np.repeat(np.arange(num_clients, dtype=np.int32), np.diff(offsets))
    return SplitPlan(eval_idx=idx, eval_seg=seg, eval_len=np.array([total], np.int32))
