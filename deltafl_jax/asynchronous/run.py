"""The host side of a buffered asynchronous run: :class:`BufferedRun`.

One :class:`~deltafl_jax.asynchronous.scheduler.AsyncScheduler` per seed (with the rule's
refill and draw policy), each server step's plan (the K buffered jobs of every seed in the
plan's K slots; a job's examples are shuffled by (seed, the step's index, client),
:mod:`deltafl_jax.sampling.plan`), the rule's staleness weights, and the jitted step
(:func:`deltafl_jax.asynchronous.step.build_buffered_step`) over a device mesh.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import jax
import numpy as np
import optax

from deltafl_jax import engine
from deltafl_jax.asynchronous.rule import BufferedRule
from deltafl_jax.asynchronous.step import BufferedState, build_buffered_step, step_inputs
from deltafl_jax.engine import mesh as mesh_lib
from deltafl_jax.replicas.labels import Replicas
from deltafl_jax.sampling import plan as plan_lib
from deltafl_jax.asynchronous.scheduler import (AsyncScheduler, AsyncSettings, check_ring_fits,
                                               ring_size)
from deltafl_jax.sampling.plan import RoundData
from deltafl_jax.sampling.samplers import Cohort


def version_bytes(model, replicas: int) -> int:
    """Bytes of one model version of every replica (one slot of the ring)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    return replicas * sum(int(np.prod(x.shape)) * x.dtype.itemsize
                          for x in jax.tree.leaves(shapes))


def device_free_bytes() -> Optional[int]:
    """This process's first device's bytes_limit - bytes_in_use (memory_stats), None where
    it reports none (XLA:CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


class BufferedRun:
    """The host side of a buffered asynchronous run of `rule` (module docstring).

    seconds: ids [k] -> [k] float64 the virtual duration of a job of each client;
    availability: who is online at each version (None: everyone); offsets: the training
    split's [N + 1] row offsets; memory_bytes: the device memory the ring of versions may
    take (None: what the first device reports free; no check on a backend that reports
    none, XLA:CPU); mesh: a 1-D device mesh (``engine.mesh.make_mesh``) over
    whose devices the step's jobs are dealt (None: one device). Set ``local.order_lanes``
    for sums that do not depend on the device count. packed: the plan indexes the step's
    packed buffer (the host keeps the split, ``--client_data=host``); mean_online_seconds:
    clients go offline mid-job with sessions of this mean (:class:`AsyncScheduler`; None:
    never); eval_lanes: the lanes of a rule's losses at the base versions (None: the
    training's).
    """

    def __init__(self, model, replicas: Replicas, local: engine.LocalSGDConfig, *,
                 rule: BufferedRule, seeds: Sequence[int], settings: AsyncSettings,
                 offsets: np.ndarray, work: plan_lib.LocalWork, seconds, eval_chunk: int = 8,
                 server_tx: Optional[optax.GradientTransformation] = None, availability=None,
                 mesh=None, memory_bytes: Optional[int] = None, packed: bool = False,
                 mean_online_seconds: Optional[float] = None,
                 eval_lanes: Optional[int] = None):
        offsets = np.asarray(offsets, np.int64)
        settings.check(offsets.size - 1)
        ring = ring_size(settings.concurrency, settings.buffer_size, settings.max_staleness,
                         rule.refill_before_step)
        check_ring_fits(ring, version_bytes(model, replicas.size),
                        device_free_bytes() if memory_bytes is None else memory_bytes)
        self.seeds, self.offsets, self.work = [int(s) for s in seeds], offsets, work
        self.K, self.group = settings.buffer_size, np.asarray(replicas.group, np.int64)
        self.staleness = rule.staleness
        self.schedulers = [AsyncScheduler(
            num_clients=offsets.size - 1, concurrency=settings.concurrency,
            buffer_size=self.K, max_staleness=settings.max_staleness, seconds=seconds,
            seed=s, availability=availability, mean_online_seconds=mean_online_seconds,
            refill_before_step=rule.refill_before_step, draw_busy=rule.draw_busy)
            for s in self.seeds]
        self.caps = plan_lib.capacities(np.diff(offsets), self.K, work, eval_chunk,
                                        with_replacement=True)
        self.packed = bool(packed)
        sharded = mesh is not None and mesh.size > 1
        if sharded:
            local = local._replace(axis=mesh_lib.DeviceAxis(mesh.size, mesh_lib.AXIS))
        raw = build_buffered_step(model, replicas, local, server_tx, rule=rule,
                                  eval_chunk=eval_chunk, eval_lanes=eval_lanes)
        if sharded:
            raw = mesh_lib.sharded(raw, mesh, 4)
        self.step_fn = jax.jit(raw, donate_argnums=(0,))

    def next_step(self, index: int):
        """(the plan, the :class:`~deltafl_jax.asynchronous.step.BufferedInputs`, the
        schedulers' :class:`~deltafl_jax.asynchronous.scheduler.ServerStep` s) of server step
        `index` of every seed."""
        steps = [s.next_step() for s in self.schedulers]
        cohorts = [Cohort(s.clients.astype(np.int32), np.ones(self.K, bool),
                          np.ones(self.K, np.float64)) for s in steps]
        plan = plan_lib.make_round_plan(self.seeds, index, self.offsets, self.K, self.work,
                                        self.caps, packed=self.packed, cohorts=cohorts)
        return plan, step_inputs(steps, self.staleness), steps

    def step(self, state: BufferedState, x, y, keys):
        """One server step of every replica: (state, metrics); the metrics add each
        replica's virtual time ``virtual_time`` and its stale updates dropped since the
        previous step ``dropped_updates``."""
        plan, inputs, steps = self.next_step(self.schedulers[0].version)
        state, metrics = self.step_fn(state, RoundData(x=x, y=y, plan=plan), inputs, keys)
        group = self.group
        metrics = {**metrics,
                   "virtual_time": np.asarray([s.time for s in steps], np.float64)[group],
                   "dropped_updates": np.asarray([s.dropped for s in steps], np.int64)[group]}
        return state, metrics

    def state(self) -> Dict[str, np.ndarray]:
        """Every seed's scheduler state, keys ``<g>/<name>``."""
        return {f"{g}/{k}": v for g, s in enumerate(self.schedulers)
                for k, v in s.state().items()}

    def restore(self, state: Dict[str, np.ndarray]) -> None:
        for g, s in enumerate(self.schedulers):
            prefix = f"{g}/"
            s.restore({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
