"""What a resolved run runs: its program placed on the devices and compiled.

:func:`compile_program` turns a :class:`~deltafl_jax.run.resolve.ResolvedRun` into a frozen
:class:`Program`: the device mesh and the placement of the work
(:mod:`deltafl_jax.run.placement`: lanes, ``--client_data``, the bytes each device holds,
refused in one line when they cannot fit), the clients' examples on the devices or the host
(:mod:`deltafl_jax.run.client_store`), the plan's slots and capacities (the shapes the round
is compiled for), the jitted round (:func:`deltafl_jax.rounds.build_round_fn`; an asynchronous
run's server step, :class:`deltafl_jax.run.buffered.AsyncRound`), the served model's function
and the server optimizer. A :class:`Program` also gives the run's initial state and its
replicas' keys, placed on the mesh.

It owns no host state that changes as the run goes (the plans' draws are
:mod:`deltafl_jax.run.planning`'s). It may import the layers below the run (the engine, the
round, the plan, the models and their augmentation) and, in :mod:`deltafl_jax.run`, the resolve
step, the placement, the client store and the asynchronous round; never the planning, the
evaluation or the experiment that read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import numpy as np

from deltafl_jax import engine, rounds
from deltafl_jax.asynchronous.run import BufferedRun
from deltafl_jax.engine import mesh as mesh_lib
from deltafl_jax.errors import ConfigError
from deltafl_jax.models.augment import augmentation
from deltafl_jax.run import placement as placement_lib
from deltafl_jax.run.buffered import AsyncRound, async_speeds
from deltafl_jax.run.client_store import ClientStore
from deltafl_jax.run.resolve import ResolvedRun
from deltafl_jax.sampling import plan as plan_lib
from deltafl_jax.asynchronous.scheduler import job_durations


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A run's program on its devices.

    placement: lanes, evaluation chunk, where the clients' examples are kept. footprint: the
    bytes held on each device. mesh: the device mesh when the round spans D > 1 devices (None:
    one device). store: the clients' examples, on the devices or on the host. server_tx: the
    server optimizer's transformation (None: w + Delta). slots: the plan's job slots m (AFL:
    every training client; Poisson: the cap; an asynchronous run: K). caps: the plan's
    index-stream capacities. round_fn: the jitted ``round_fn(state, data, keys) -> (state,
    metrics)``. served_fn: the jitted ``(algo_state, params) -> served params`` of an algorithm
    that serves another model than w_t (None: w_t). buffered: an asynchronous run's step
    (None: rounds).
    """

    placement: placement_lib.Placement
    footprint: placement_lib.Footprint
    mesh: Optional[Any]
    store: ClientStore
    server_tx: Optional[Any]
    slots: int
    caps: plan_lib.Capacities
    round_fn: Callable
    served_fn: Optional[Callable] = None
    buffered: Optional[AsyncRound] = None

    def place(self, tree):
        """`tree` replicated over the mesh (unchanged on one device)."""
        return tree if self.mesh is None else mesh_lib.replicate(tree, self.mesh)

    def initial_state(self, run: ResolvedRun) -> rounds.ServerState:
        """The server state before round 1 of every replica of `run`, on the devices."""
        privacy = run.config.privacy
        correlated = run.accounting.correlated if run.accounting is not None else None
        clip = privacy.initial_clip if privacy.adaptive else None
        state = rounds.init_state(run.model, run.algorithm, run.replicas, run.seeds,
                                  self.server_tx, run.data.train.num_clients, clip=clip,
                                  bands=len(correlated.coef) if correlated else 0)
        if self.buffered is not None:   # the same w_0 in the ring of versions
            state = self.buffered.initial_state(state.params, self.server_tx,
                                                run.replicas.server_lr)
        return self.place(state)

    def keys(self, run: ResolvedRun):
        """Each replica's key, from its plan group's seed."""
        return self.place(rounds.replica_keys(run.replicas, run.seeds))

    def served_params(self, state):
        """The models that are evaluated and saved, [R, ...]: w_t, or what the algorithm
        serves instead (AFL: the averaged iterate; an asynchronous run: the ring's newest)."""
        if self.buffered is not None:
            return self.buffered.served_params(state)
        if self.served_fn is None:
            return state.params
        return self.served_fn(state.algo_state, state.params)

    def placement_line(self, run: ResolvedRun) -> str:
        """The start-up line of the placement and the bytes per device."""
        return placement_lib.placement_line(self.placement, self.footprint, run.data,
                                            run.replicas.size,
                                            run.config.placement.placement_backend)


def compile_program(run: ResolvedRun) -> Program:
    """`run` placed on the devices, its examples stored and its round jitted. ConfigError for
    a placement or a footprint that cannot be (a probe sample on a host-kept split, devices
    that cannot hold the run)."""
    config, data, model = run.config, run.data, run.model
    settings = (None if run.spec.asynchronous is None
                else run.spec.asynchronous.settings(config.asynchronous))
    m = run.num_sampled if settings is None else settings.buffer_size   # the plan's slots
    mesh = device_mesh(config.placement.devices)
    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    place = placement_lib.choose_placement(
        config, model, m, run.replicas.size, devices=len(devices),
        client_data=placement_lib.client_data_mode(config.placement.client_data, data,
                                                   devices))
    _check_probe(run, place)
    server_tx = config.server.transformation()
    state_shape = jax.eval_shape(lambda: rounds.init_state(
        model, run.algorithm, run.replicas, run.seeds, server_tx, data.train.num_clients))
    if settings is None:
        caps = plan_lib.capacities(capacity_sizes(data.train, m), m, run.work,
                                   place.eval_chunk,
                                   with_replacement=run.algorithm.sampling is not None)
        place, footprint = _fit_lanes(run, place, caps, m, state_shape, devices)
        buffered, round_fn = None, _round_fn(run, place, m, mesh, server_tx, devices)
    else:
        buffered = _async_round(run, settings, place, mesh, server_tx)
        fitted, footprint = _fit_lanes(run, place, buffered.run.caps, m, state_shape, devices)
        if fitted.lanes != place.lanes:   # fewer lanes by memory: the step on them
            buffered = _async_round(run, settings, fitted, mesh, server_tx)
        place, caps, round_fn = fitted, buffered.run.caps, buffered.round_fn
    placement_lib.check_memory(footprint, devices)
    algorithm = run.algorithm
    return Program(placement=place, footprint=footprint, mesh=mesh,
                   store=ClientStore(data, model, place, caps, mesh), server_tx=server_tx,
                   slots=m, caps=caps, round_fn=round_fn,
                   served_fn=(jax.jit(jax.vmap(algorithm.eval_params))
                              if algorithm.eval_params is not None else None),
                   buffered=buffered)


def _fit_lanes(run: ResolvedRun, place, caps, m: int, state_shape, devices):
    """(placement, footprint): `place`'s footprint, and on an accelerator without
    ``--clients_per_step`` its lanes lowered to what a device holds
    (:func:`deltafl_jax.run.placement.fit_lanes`; one lane's step is compiled only then)."""
    footprint = placement_lib.compute_footprint(run.data, run.model, run.replicas, place, caps,
                                                m, state_shape)
    def step_bytes() -> int:
        return placement_lib.lane_step_bytes(run.model, run.data, run.config.training.batch_size)

    return placement_lib.fit_lanes(place, footprint, devices, step_bytes)


def capacity_sizes(split, m: int) -> np.ndarray:
    """The client sizes that bound the round's streams: the split's own, or for a generator
    with a size cap, m clients at the cap (the same device bytes at every population)."""
    cap = getattr(split, "max_size", None)
    return split.sizes if cap is None else np.full((m,), cap, np.int64)


def model_bytes(model) -> int:
    """The bytes of one model's parameters (what a client downloads and uploads)."""
    return placement_lib.tree_nbytes(jax.eval_shape(model.init, jax.random.key(0)))


def device_mesh(devices: Optional[int]):
    """None for one device (the plain path), else the mesh of ``--devices`` devices (0, -1 or
    None: every device)."""
    count = devices if devices not in (None, 0, -1) else jax.device_count()
    if count == 1:
        return None
    try:
        return mesh_lib.make_mesh(count)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _augment(run: ResolvedRun) -> Optional[Callable]:
    """The local steps' augmentation (``--augment``; None: none); ConfigError for images it
    cannot read."""
    if run.config.training.augment == "none":
        return None
    try:
        return augmentation(run.config.training.augment, run.data)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _local_config(run: ResolvedRun, place, mesh) -> engine.LocalSGDConfig:
    """The clients' local SGD on `place` (over `mesh`'s devices; None: one device)."""
    config = run.config
    axis = mesh_lib.SINGLE if mesh is None else mesh_lib.DeviceAxis(place.devices,
                                                                    mesh_lib.AXIS)
    return engine.LocalSGDConfig(batch_size=config.training.batch_size, lanes=place.lanes,
                                 lane_mode=place.lane_mode, unroll=place.unroll,
                                 branchless=place.branchless, axis=axis,
                                 order_lanes=place.order_lanes,
                                 clip=config.privacy.initial_clip,
                                 optimizer=config.client.transformation,
                                 augment=_augment(run))


def _round_fn(run: ResolvedRun, place, m: int, mesh, server_tx, devices) -> Callable:
    """The jitted round: plain for one device, jit(shard_map(...)) over a mesh otherwise; on
    CPU devices a :class:`TableRound`, which keeps the lanes' slot tables between rounds."""
    privacy = run.config.privacy
    tables = all(d.platform == "cpu" for d in devices)
    raw = rounds.build_round_fn(
        run.model, run.algorithm, run.replicas, _local_config(run, place, mesh),
        place.eval_chunk, place.eval_lanes, m, server_tx, expected=run.expected,
        adaptive=privacy if privacy.adaptive else None,
        correlated=run.accounting.correlated if run.accounting is not None else None,
        variable=run.variable, tables=tables)
    n = 4 if tables else 3
    fn = jax.jit(raw if mesh is None else mesh_lib.sharded(raw, mesh, n),
                 donate_argnums=(0, 3) if tables else (0,))
    return TableRound(fn, mesh) if tables else fn


class TableRound:
    """A round ``round_fn(state, data, keys) -> (state, metrics)`` that keeps the lanes' slot
    tables from one round to the next: the jitted ``fn(state, data, keys, tables) -> (state,
    metrics, tables)`` (:func:`deltafl_jax.rounds.build_round_fn` with ``tables=True``) gets
    the last round's tables, donated, and this keeps the ones it returns.

    Why: XLA:CPU allocates a program's temporaries afresh at every execution, and memory that
    large comes from the kernel page by page (a page fault and a page of zeros each): the
    tables, one row per job of the device (6.4 MB a row for pfl_cnn), were most of a round's
    fresh memory (docs/benchmarks/pfl-research.md). A donated argument that the output
    reuses is not allocated again. What the tables hold changes nothing (a round reads no row
    it did not write), so a round's results are the same bits as without them, and one
    TableRound serves any number of states. Accelerators' allocators reuse memory
    themselves; they get the plain jitted round.

    Device arrays; on a mesh each device holds its own tables, returned as if replicated
    (the round never reads another device's). ``lower`` gives a :class:`LoweredTables`
    (``--estimate``)."""

    def __init__(self, fn, mesh):
        self.fn, self.mesh = fn, mesh
        self.tables = None

    def _tables(self, state, data, keys):
        if self.tables is None:   # zeros of the shapes the round returns, on its devices
            shapes = jax.eval_shape(self.fn, state, data, keys, None)[2]
            where = None if self.mesh is None else mesh_lib.replicated(self.mesh)
            self.tables = jax.tree.map(   # from the host: no program to compile
                lambda s: jax.device_put(np.zeros(s.shape, s.dtype), where), shapes)
        return self.tables

    def __call__(self, state, data, keys):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((state, data, keys))):
            return self.fn(state, data, keys, self._tables(state, data, keys))[:2]  # traced
        return self.run(self.fn, state, data, keys)

    def run(self, fn, state, data, keys):
        """`fn` (this round, jitted or compiled) on the kept tables, keeping those it returns."""
        tables = self._tables(state, data, keys)
        self.tables = None   # donated: if the call fails, the next one starts afresh
        state, metrics, self.tables = fn(state, data, keys, tables)
        return state, metrics

    def lower(self, state, data, keys) -> "LoweredTables":
        return LoweredTables(self, self.fn.lower(state, data, keys,
                                                 self._tables(state, data, keys)))


class LoweredTables:
    """A :class:`TableRound` lowered: ``as_text()``, and ``compile()`` -> a compiled round
    called as ``(state, data, keys)`` that passes and keeps its owner's tables, with the
    compiled program's ``memory_analysis()`` and ``cost_analysis()``."""

    def __init__(self, owner: TableRound, lowered):
        self.owner, self.lowered = owner, lowered

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(self) -> "CompiledTables":
        return CompiledTables(self.owner, self.lowered.compile())


class CompiledTables:
    """See :class:`LoweredTables` (and ``as_text()``, the compiled program's)."""

    def __init__(self, owner: TableRound, compiled):
        self.owner, self.compiled = owner, compiled

    def __call__(self, state, data, keys):
        return self.owner.run(self.compiled, state, data, keys)

    def as_text(self) -> str:
        return self.compiled.as_text()

    def memory_analysis(self):
        return self.compiled.memory_analysis()

    def cost_analysis(self):
        return self.compiled.cost_analysis()


def _async_round(run: ResolvedRun, settings, place, mesh, server_tx) -> AsyncRound:
    """An asynchronous run's server step as its round (:mod:`deltafl_jax.run.buffered`), with
    its clock and the plan's capacities (K slots): the spec's rule
    (:class:`~deltafl_jax.asynchronous.rule.BufferedRule`) on a
    :class:`~deltafl_jax.asynchronous.run.BufferedRun`."""
    config, data = run.config, run.data
    settings.check(data.train.num_clients)
    speeds = async_speeds(config.timing, data.train.num_clients, config.data.data_seed)
    buffered = BufferedRun(
        run.model, run.replicas, _local_config(run, place, None),
        rule=run.spec.asynchronous.make(config, run.spec.options_for(config)),
        seeds=run.seeds, settings=settings, offsets=data.train.offsets, work=run.work,
        seconds=job_durations(speeds, data.train.sizes, run.work, model_bytes(run.model)),
        eval_chunk=place.eval_chunk, eval_lanes=place.eval_lanes, server_tx=server_tx,
        availability=run.availability, mesh=mesh, packed=place.client_data == "host",
        mean_online_seconds=config.timing.mean_online_seconds)
    return AsyncRound(buffered, data.train.num_clients, run.availability)


def _check_probe(run: ResolvedRun, place) -> None:
    """ConfigError for an algorithm with a second sample (``probe``) on a host-kept split:
    its plan indexes the split on the device."""
    if run.algorithm.probe is not None and place.client_data == "host":
        raise ConfigError(f"--algorithm={run.spec.name} evaluates a second sample of clients "
                          "from the training split on the device: use --client_data=device")
