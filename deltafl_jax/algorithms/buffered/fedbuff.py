"""FedBuff (Nguyen et al., *Federated Learning with Buffered Asynchronous Aggregation*,
AISTATS 2022, Algorithm 1): the server step of buffered asynchronous aggregation on the device.

The host's :class:`~deltafl_jax.sampling.asynchronous.AsyncScheduler` decides, on a virtual
clock, which K updates fill each buffer and from which model version each client started.
One server step here trains those K jobs in lanes, each from its own base version, and
applies

    Delta = (1/K) sum_k s(tau_k) Delta_k,    s(tau) = 1 / sqrt(1 + tau),

Delta_k = w_k - w_{base_k} the client's local SGD from its base version and tau_k its
staleness, through the server optimizer (g = -Delta, :mod:`deltafl_jax.optimizers.server`;
by default w + Delta) from the current version; the new version is written into the ring of
versions the device keeps. The 1/K and the uniform weights are Algorithm 1's (the buffer's
sum divided by its size K, no weighting by n_k) with the paper's polynomial staleness scaling
1/sqrt(1 + tau) applied to each update; FedScale's ``async_aggregator.py``
(SymbioticLab/FedScale, commit 1539103) differs: it weighs the clients' *models* by
1/(1 + tau) and divides by the sum of those weights.

Why an algorithm of its own (``--algorithm=fedbuff``; :class:`BufferedRun` is its host
side, driven by the run loop through :mod:`deltafl_jax.run.buffered`) rather than an asynchronous mode that every
algorithm's aggregation could use: the other algorithms' server updates read a synchronous
cohort's quantities at one global model w_t (Delta-FL's filter of the losses F_k(w_t) and
its superquantile, SCAFFOLD's and MIFA's per-client memories of the same round, q-FFL's
Lipschitz terms at w_t); with every update from a different version those have no meaning,
and each would need its own asynchronous derivation. FedBuff fixes the client work (the run's
local SGD) and the aggregation (the staleness-weighted mean), so it is one algorithm with
its own step, as FedAsync is another.

The state (:class:`BufferedState`) keeps, per replica, V versions (leaves [R, V, ...]) and
the slot of the current one; replicas of one seed share the seed's scheduler (the plan's
group), so the step's inputs (:class:`BufferedInputs`) carry a leading group axis G.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from deltafl_jax import engine
from deltafl_jax.algorithms.deltafl import THETA_SWEEP, DeltaFLHyper, check_thetas, theta_one
from deltafl_jax.algorithms.fedavg import fedavg
from deltafl_jax.algorithms.spec import AlgorithmSpec, Grid, Reporting
from deltafl_jax.engine import mesh as mesh_lib
from deltafl_jax.errors import ConfigError
from deltafl_jax.optimizers.server import init_states, server_step
from deltafl_jax.replicas.labels import Replicas
from deltafl_jax.sampling import plan as plan_lib
from deltafl_jax.sampling.asynchronous import (AsyncScheduler, AsyncSettings, ServerStep,
                                               check_ring_fits, staleness_weight)
from deltafl_jax.sampling.plan import RoundData
from deltafl_jax.sampling.samplers import Cohort


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
    :class:`~deltafl_jax.sampling.asynchronous.ServerStep`.

    slots: [G, K] int32 the ring slot of each update's base version; weights: [G, K] float32
    s(tau_k); staleness: [G, K] int32 tau_k; new_slot: [G] int32 where the new version goes.
    """

    slots: Any
    weights: Any
    staleness: Any
    new_slot: Any


def step_inputs(steps: Sequence[ServerStep]) -> BufferedInputs:
    """The step of each group, from its scheduler's :class:`ServerStep` (one per seed)."""
    return BufferedInputs(
        slots=np.stack([s.slots for s in steps]).astype(np.int32),
        weights=np.stack([staleness_weight(s.staleness) for s in steps]).astype(np.float32),
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


def buffered_mean(delta_sum, state, slots, weights):
    """FedBuff's Delta = (1/K) sum_k s(tau_k) Delta_k from the sum of the weighted updates
    (`slots`, `weights`: [R, K] each update's base slot and s(tau_k))."""
    del state
    K = slots.shape[1]
    return jax.tree.map(lambda d: d / K, delta_sum)


def kept_rows(keep, new, old):
    """new where keep [R], else old, leaf by leaf (leaves [R, ...])."""
    return jax.tree.map(lambda n, o: jnp.where(keep.reshape(keep.shape + (1,) * (n.ndim - 1)),
                                               n, o), new, old)


def build_buffered_step(model, replicas: Replicas, local: engine.LocalSGDConfig,
                        server_tx: Optional[optax.GradientTransformation] = None,
                        aggregate=buffered_mean):
    """The server step of FedBuff for `replicas`, an unjitted pure function

        step_fn(state, data, inputs, key) -> (state, metrics)

    with `data` a :class:`~deltafl_jax.sampling.plan.RoundData` whose plan holds the K buffered
    jobs of each group in its K slots (in the scheduler's order), `inputs` the
    :class:`BufferedInputs`, `key` the replicas' root keys (the step's keys fold in the new
    version's number); `aggregate(delta_sum, state, slots, weights) -> Delta` turns the
    sum of the updates weighted by s(tau_k) into the server's Delta (FedBuff's
    :func:`buffered_mean`; FedAsync's mixing, :mod:`deltafl_jax.algorithms.fedasync`). A
    replica none of whose K updates is finite keeps its model and its server optimizer's
    state (the new version is the current one again)."""
    group = jnp.asarray(replicas.group, jnp.int32)
    hyper_np = jax.tree.map(lambda v: np.asarray(v, np.float32), replicas.hyper)
    l2_np = np.asarray(replicas.l2, np.float32)
    schedules = replicas.schedules

    def step_fn(state: BufferedState, data: RoundData, inputs: BufferedInputs, key
                ) -> Tuple[BufferedState, Dict[str, Any]]:
        t = state.version
        lr = jnp.stack([jnp.asarray(s(t), jnp.float32) for s in schedules])
        keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(key)
        sizes = data.plan.sizes[group]
        weights, slots = jnp.where(sizes > 0, inputs.weights[group], 0.0), inputs.slots[group]
        tr = engine.train_jobs(model, state.ring, X=data.x, Y=data.y, plan=data.plan,
                               replica_group=group, job_weight=weights, learning_rate=lr,
                               l2=jnp.asarray(l2_np), hyper=jax.tree.map(jnp.asarray, hyper_np),
                               cfg=local, base=slots, keys=keys,
                               clients=engine.ClientInputs((), (), data.plan.clients[group]))
        delta = aggregate(tr.delta_sum, state, slots, weights)
        current = current_params(state)
        reached = tr.weight_sum > 0
        delta = kept_rows(reached, delta, jax.tree.map(jnp.zeros_like, delta))
        params, opt_state = server_step(server_tx, current, delta, state.server_opt_state)
        params = kept_rows(reached, params, current)
        opt_state = kept_rows(reached, opt_state, state.server_opt_state)
        new_slot = inputs.new_slot[group]
        ring = jax.tree.map(lambda a, p: jax.vmap(lambda x, s, v: x.at[s].set(v))(a, new_slot, p),
                            state.ring, params)
        metrics = {"staleness_mean": jnp.mean(inputs.staleness[group].astype(jnp.float32), 1),
                   "num_rejected": jnp.sum(tr.job_trained & ~tr.job_finite, axis=1),
                   "learning_rate": lr, "train_real_examples": tr.real_examples,
                   "train_trips": tr.trips, "device_train_trips": tr.device_trips,
                   "device_train_jobs": tr.device_jobs,
                   "server_step_norm": jnp.sqrt(jax.vmap(engine.tree_sqnorm)(
                       jax.tree.map(jnp.subtract, params, current)))}
        return BufferedState(ring=ring, current=new_slot, version=t + 1,
                             server_opt_state=opt_state), metrics

    return step_fn


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
    """The host side of a FedBuff run: one :class:`AsyncScheduler` per seed, each server
    step's plan (the K buffered jobs of every seed in the plan's K slots; a job's examples
    are shuffled by (seed, the step's index, client), :mod:`deltafl_jax.sampling.plan`) and the
    jitted step (:func:`build_buffered_step`).

    seconds: ids [k] -> [k] float64 the virtual duration of a job of each client;
    availability: who is online at each version (None: everyone); offsets: the training
    split's [N + 1] row offsets; memory_bytes: the device memory the ring of versions may
    take (None: what the first device reports free; no check on a backend that reports
    none, XLA:CPU); mesh: a 1-D device mesh (``engine.mesh.make_mesh``) over
    whose devices the step's jobs are dealt (None: one device). Set ``local.order_lanes``
    for sums that do not depend on the device count. aggregate: the step's aggregate
    (:func:`build_buffered_step`; None: FedBuff's :func:`buffered_mean`); packed: the plan
    indexes the step's packed buffer (the host keeps the split, ``--client_data=host``);
    mean_online_seconds: clients go offline mid-job with sessions of this mean
    (:class:`AsyncScheduler`; None: never).
    """

    def __init__(self, model, replicas: Replicas, local: engine.LocalSGDConfig, *,
                 seeds: Sequence[int], settings: AsyncSettings, offsets: np.ndarray,
                 work: plan_lib.LocalWork, seconds, eval_chunk: int = 8,
                 server_tx: Optional[optax.GradientTransformation] = None, availability=None,
                 mesh=None, memory_bytes: Optional[int] = None, aggregate=None,
                 packed: bool = False, mean_online_seconds: Optional[float] = None):
        offsets = np.asarray(offsets, np.int64)
        settings.check(offsets.size - 1)
        check_ring_fits(settings.ring, version_bytes(model, replicas.size),
                        device_free_bytes() if memory_bytes is None else memory_bytes)
        self.seeds, self.offsets, self.work = [int(s) for s in seeds], offsets, work
        self.K, self.group = settings.buffer_size, np.asarray(replicas.group, np.int64)
        self.schedulers = [AsyncScheduler(
            num_clients=offsets.size - 1, concurrency=settings.concurrency,
            buffer_size=self.K, max_staleness=settings.max_staleness, seconds=seconds,
            seed=s, availability=availability,
            mean_online_seconds=mean_online_seconds) for s in self.seeds]
        self.caps = plan_lib.capacities(np.diff(offsets), self.K, work, eval_chunk,
                                        with_replacement=True)
        self.packed = bool(packed)
        aggregate = aggregate or buffered_mean
        if mesh is not None and mesh.size > 1:
            local = local._replace(axis=mesh_lib.DeviceAxis(mesh.size, mesh_lib.AXIS))
            raw = mesh_lib.sharded(build_buffered_step(model, replicas, local, server_tx,
                                                       aggregate), mesh, 4)
        else:
            raw = build_buffered_step(model, replicas, local, server_tx, aggregate)
        self.step_fn = jax.jit(raw, donate_argnums=(0,))

    def next_step(self, index: int):
        """(the plan, the :class:`BufferedInputs`, the schedulers' :class:`ServerStep` s) of
        server step `index` of every seed."""
        steps = [s.next_step() for s in self.schedulers]
        cohorts = [Cohort(s.clients.astype(np.int32), np.ones(self.K, bool),
                          np.ones(self.K, np.float64)) for s in steps]
        plan = plan_lib.make_round_plan(self.seeds, index, self.offsets, self.K, self.work,
                                        self.caps, packed=self.packed, cohorts=cohorts)
        return plan, step_inputs(steps), steps

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


# ---------------------------------------------------------------------- the spec

@dataclasses.dataclass(frozen=True)
class AsyncStep:
    """What an asynchronous spec (``AlgorithmSpec.asynchronous``) gives the run.

    aggregate: the spec's typed options -> the step's aggregate (:func:`build_buffered_step`);
    buffer_size: the K the method fixes (FedAsync: 1), None: ``--buffer_size``.
    """

    aggregate: Callable[[Any], Callable]
    buffer_size: Optional[int] = None

    def settings(self, given: AsyncSettings) -> AsyncSettings:
        """The run's settings: `given` (the ``asynchronous`` group), K fixed where the method
        fixes it."""
        if self.buffer_size is None:
            return given
        return dataclasses.replace(given, buffer_size=self.buffer_size)


def async_validator(step: AsyncStep) -> Callable[[Any], None]:
    """A spec's ``validate`` for `step`: the thetas (:func:`check_thetas`), then
    :func:`check_asynchronous`."""

    def validate(config) -> None:
        check_thetas(config)
        check_asynchronous(config, step)
    return validate


def check_asynchronous(config, step: AsyncStep) -> None:
    """ConfigError (one line naming the flag) for what an asynchronous run cannot combine
    with: a synchronous round's deadline and over-selection, a client sampler other than the
    scheduler's uniform draw, client-level DP (its accountant counts synchronous cohorts), a
    personalised evaluation; and its own settings (K <= C)."""
    name = config.algorithm
    t = config.timing
    flag = ("--round_deadline" if t.round_deadline is not None else "--partial_work"
            if t.partial_work else "--over_select" if t.over_select != 1.0 else None)
    if flag:
        raise ConfigError(f"{flag}: --algorithm={name} has no rounds to end by a deadline; its "
                          "clients train as slots free up (--concurrency, --buffer_size)")
    if config.sampling.sampler != "fixed":
        raise ConfigError(f"--client_sampling={config.sampling.sampler}: --algorithm={name} "
                          "starts an idle online client, uniformly, whenever a slot frees up")
    if config.privacy.enabled:
        raise ConfigError(f"--dp_clip: --algorithm={name} has no private version (the DP "
                          "accountant counts synchronous cohorts)")
    if config.personal.client_holdout > 0:
        raise ConfigError(f"--client_holdout: --algorithm={name} has no personalised "
                          "evaluation")
    step.settings(config.asynchronous).check()


FEDBUFF = AsyncStep(aggregate=lambda options: buffered_mean)

SPEC = AlgorithmSpec(
    name="fedbuff", display_name="FedBuff",
    help="FedBuff: buffered asynchronous aggregation of K staleness-weighted updates from C "
         "clients in flight (--concurrency, --buffer_size, --max_staleness)",
    factory=lambda config, data, options: fedavg()._replace(name="fedbuff"),
    hyper=DeltaFLHyper, sweep=THETA_SWEEP,
    validate=async_validator(FEDBUFF),
    grid=Grid(values=theta_one("fedbuff", "trains every update it buffers (theta = 1)"),
              fixed_sweep=True),
    reporting=Reporting(names_value=False), asynchronous=FEDBUFF)
