"""Where a run's work and data go: devices, lanes, where the clients' examples are kept, and
the bytes each device holds.

- :func:`choose_placement`: lanes per device, lane mode, evaluation chunk and lanes, the local-SGD
  loop's shape (from the model's preferences on the backend; :mod:`deltafl_jax.engine.lanes`).
- :func:`client_data_mode`: ``--client_data=device`` keeps both splits on every device;
  ``host`` keeps them on the host and ships each round's sampled clients (and each evaluation
  block) to the devices; ``auto`` is device while the splits fit in
  ``DEVICE_DATA_SHARE`` of one device's memory, host beyond, and always host for a population
  generated on demand.
- :func:`compute_footprint` / :func:`placement_line` / :func:`check_memory`: the bytes each
  device holds, the start-up line that shows them, and a one-line refusal of a run that cannot
  fit.
- :func:`fit_lanes`: on an accelerator without ``--clients_per_step``, the most lanes (up to
  the default) whose footprint fits in ``MEMORY_SHARE`` of the device's bytes_limit, each
  lane counted with its local model, anchor and optimizer state and the activations of one
  local step (:func:`lane_step_bytes`, XLA's memory analysis of one lane's compiled step);
  fewer lanes run the round's jobs in more trips (:func:`deltafl_jax.engine.lanes.deal_jobs`),
  to the same sums (the order of each replica's sum is ``order_lanes``', not the lanes'). A model's frozen part (a pretrained base under LoRA: :func:`frozen_bytes`) is counted
  once per device, shared by every lane and replica.
- :func:`check_streams`: a one-line refusal, before anything is built or written, of a plan
  whose index streams (a round's training and evaluation streams, the personalised
  evaluation's adaptation stream) are longer than int32 indices reach or than the host's memory
  holds (``--local_epochs``, ``--local_steps``, ``--batch_size``, ``--eval_chunk``,
  ``--finetune_steps`` set far too large).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional, Sequence, Tuple

import jax
import numpy as np

from deltafl_jax import engine
from deltafl_jax.data import FederatedDataset, is_generated
from deltafl_jax.errors import ConfigError
from deltafl_jax.models import Model
from deltafl_jax.replicas.labels import Replicas
from deltafl_jax.run.config import CLIENT_DATA as CLIENT_DATA_MODES, ExperimentConfig
from deltafl_jax.sampling import plan as plan_lib

DEVICE_DATA_SHARE = 0.25   # auto: the splits stay on the device while they fit in this share
INDEX_LIMIT = 2 ** 31 - 1   # the plans index their streams with int32
HOST_SHARE = 0.5   # the plans' host arrays (and their device copies) must fit in this share
EVAL_BLOCK_EXAMPLES = 1 << 15   # host mode: examples per evaluation block (rounded up)
MEMORY_SHARE = 0.9   # of a device's bytes_limit that the footprint may take (lanes, refusal)


@dataclasses.dataclass(frozen=True)
class Placement:
    """How client work runs: devices, lanes per device and their mode, evaluation chunk and
    lanes (from the model's preferences on this backend, unless the config sets them), the
    local-SGD loop's shape (minibatch steps per while trip, conds or masked selects:
    :func:`deltafl_jax.engine.loop_shape`), and where the clients' examples are kept
    (``client_data``: "device" or "host"). ``order_lanes``: the lanes by which each replica's
    sums are ordered (:func:`deltafl_jax.engine.lanes.finish_order`): those of one device of a
    one-device run, whatever ``devices`` is (None: ``lanes``). ``jobs``: a round's R x m
    jobs; ``lanes_note``: why ``lanes`` (the start-up line and ``--estimate`` print it);
    ``by_memory``: the lanes are the accelerator's default, which :func:`fit_lanes` lowers
    to what the device's memory holds."""

    lanes: int
    lane_mode: str
    eval_chunk: int
    eval_lanes: int
    devices: int = 1
    unroll: int = 1
    branchless: bool = False
    client_data: str = "device"
    order_lanes: Optional[int] = None
    jobs: int = 0
    lanes_note: str = ""
    by_memory: bool = False

    @property
    def eval_block(self) -> int:
        """Examples per evaluation block when the host keeps the split: a multiple of one
        trip's examples over every device, so blocks add up as one stream does."""
        stride = self.eval_chunk * self.eval_lanes * self.devices
        return -(-EVAL_BLOCK_EXAMPLES // stride) * stride


def choose_placement(config: ExperimentConfig, model: Model, m: int, num_replicas: int,
                     backend: Optional[str] = None, devices: int = 1,
                     client_data: str = "device") -> Placement:
    """Lanes per device: on CPU the model's measured preference; on accelerators enough that
    devices x lanes cover the R x m jobs of a round (every replica's every kept client trains
    in the first trip, so the critical path is the largest job), which :func:`fit_lanes` then
    lowers to what the device's memory holds (``by_memory``). Evaluation lanes: one on CPU (a bigger chunk is the better batch
    there); on accelerators one per replica (up to 16), so a step evaluates all models.
    `config.placement_backend` plans as on that backend instead of the running one, and
    `config.branchless` overrides the loop shape's body."""
    backend = backend or config.placement.placement_backend or jax.default_backend()
    prefs = model.lanes
    jobs = m * num_replicas
    per_device = (prefs.lanes(m, backend, devices) if backend == "cpu"
                  else -(-jobs // devices))
    lanes = min(config.placement.clients_per_step or per_device, jobs)
    one_device = prefs.lanes(m, backend, 1) if backend == "cpu" else m
    loop = engine.loop_shape(backend)
    explicit = bool(config.placement.clients_per_step)
    note = ("--clients_per_step" if explicit else "the model's CPU preference"
            if backend == "cpu" else "")
    return Placement(lanes=lanes, lane_mode=prefs.lane_mode(backend), jobs=jobs,
                     lanes_note=note, by_memory=not note,
                     eval_chunk=config.placement.eval_chunk or prefs.eval_chunk(backend),
                     eval_lanes=1 if backend == "cpu" else max(1, min(num_replicas, 16)),
                     devices=devices, unroll=loop.unroll,
                     branchless=loop.branchless if config.placement.branchless is None
                     else config.placement.branchless, client_data=client_data,
                     order_lanes=min(config.placement.clients_per_step or one_device, m))


def split_bytes(data: FederatedDataset) -> int:
    """Bytes of both splits' inputs and int32 labels as the device holds them."""
    row = int(np.prod(data.feature_shape, dtype=np.int64)) * np.dtype(data.train.x_dtype).itemsize
    return (row + 4) * (data.train.num_examples + data.test.num_examples)


def _local(devices) -> list:
    return [d for d in devices if d.process_index == jax.process_index()] or list(devices)


def _bytes_limit(devices) -> Optional[int]:
    """bytes_limit of this process's first device, from memory_stats() (None on backends that
    report none, such as XLA:CPU)."""
    try:
        return (_local(devices)[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # pylint: disable=broad-except
        return None


def _device_memory(devices) -> Optional[int]:
    """bytes_limit of one device (accelerators), or this machine's memory over the devices
    (XLA:CPU reports none); None when neither is known."""
    local = _local(devices)
    limit = _bytes_limit(devices)
    if limit:
        return int(limit)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, len(local))
    except (ValueError, OSError, AttributeError):
        return None


def client_data_mode(requested: str, data: FederatedDataset, devices) -> str:
    """"device" or "host" for ``--client_data=requested`` (module docstring)."""
    if requested not in CLIENT_DATA_MODES:
        raise ConfigError(f"--client_data must be one of {', '.join(CLIENT_DATA_MODES)}, got "
                          f"{requested!r}")
    generated = is_generated(data.train) or is_generated(data.test)
    if requested == "device" and generated:
        raise ConfigError(f"--client_data=device: {data.name}'s clients are generated on demand "
                          f"and are never all in memory; pass --client_data=host (or auto)")
    if requested != "auto":
        return requested
    if generated:
        return "host"
    memory = _device_memory(devices)
    fits = memory is None or split_bytes(data) <= DEVICE_DATA_SHARE * memory
    return "device" if fits else "host"


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes held on EACH device (everything is replicated across the mesh): the clients'
    examples (both splits; with ``--client_data=host`` one round's buffer of the sampled
    clients and one evaluation block instead), the replicas' state (models, the algorithm's
    and the server optimizer's state), the per-client state of an algorithm that keeps one
    (SCAFFOLD's c_k: N x |w| per replica, and the round's per-job results), one round's plan,
    the lanes' local models (params, anchor and optimizer state, about 3 copies of one
    model per lane, and a job context each), and the round's updates: one model per (replica,
    sampled client), kept so that each replica's sum adds its clients in its own order
    (:func:`deltafl_jax.engine.lanes.finish_order`). ``frozen``: the model's frozen part
    (:func:`frozen_bytes`), once: every lane and replica reads the same arrays, and only the
    trainable part (the models, states, lanes and updates above) is per replica or lane.
    ``activations``: the lanes' activations and temporaries of one local step, counted where
    the lanes are chosen by memory (:func:`fit_lanes`; 0 elsewhere: CPU, or
    ``--clients_per_step``)."""

    data: int
    state: int
    plan: int
    lanes: int
    clients: int = 0
    updates: int = 0
    frozen: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        return (self.data + self.state + self.plan + self.lanes + self.clients + self.updates
                + self.frozen + self.activations)


def tree_nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def frozen_bytes(model: Model) -> int:
    """Bytes of `model`'s frozen part: the pretrained weights that a fine-tuned language model
    holds outside its parameters (``frozen`` of :class:`deltafl_jax.models.llm.LLMModel`, in
    its ``--base_dtype``) and merges in at every forward pass; 0 for a model without one."""
    return tree_nbytes(getattr(model, "frozen", None) or {})


def data_bytes(data: FederatedDataset, place: Placement, caps: plan_lib.Capacities,
               groups: int) -> int:
    """The clients' examples on each device: both splits, or (host mode) the round buffer of
    `groups` x m clients and one evaluation block."""
    if place.client_data == "device":
        return split_bytes(data)
    row = int(np.prod(data.feature_shape, dtype=np.int64)) * np.dtype(data.train.x_dtype).itemsize
    return (row + 4) * (groups * caps.eval_len + place.eval_block)


def compute_footprint(data: FederatedDataset, model: Model, replicas: Replicas,
                      place: Placement, caps: plan_lib.Capacities, m: int,
                      state_shape=None) -> Footprint:
    """`state_shape`: the round state's shapes (``jax.eval_shape`` of the initial state);
    None: the models alone."""
    model_bytes = tree_nbytes(jax.eval_shape(lambda: model.init(jax.random.key(0))))
    G = len(set(int(g) for g in replicas.group))
    state, clients, per_client = replicas.size * model_bytes, 0, 0
    if state_shape is not None:
        clients = tree_nbytes(state_shape.client_state)
        state = tree_nbytes(state_shape) - clients
        per_client = clients // max(1, replicas.size * data.train.num_clients)
    return Footprint(data=int(data_bytes(data, place, caps, G)), state=state,
                     plan=4 * G * (2 * caps.eval_len + caps.train_len + 6 * m),
                     lanes=place.lanes * (3 * model_bytes + per_client),
                     clients=clients + 2 * replicas.size * m * per_client,
                     updates=replicas.size * m * model_bytes, frozen=frozen_bytes(model))


def fit_lanes(place: Placement, usage: Footprint, devices,
              step_bytes: Callable[[], int]) -> Tuple[Placement, Footprint]:
    """`place` and `usage` (its footprint) with, where ``place.by_memory``, the most lanes up
    to ``place.lanes`` that fit in MEMORY_SHARE of a device's bytes_limit: the fixed part
    (data, state, plan, frozen base, per-client state, updates) plus L x per lane (the held
    copies of ``usage.lanes`` and `step_bytes()`, one lane's step activations: called, and
    compiled, only here). Not even one lane: one, which :func:`check_memory` refuses. A
    placement not by memory, or a device that reports no bytes_limit, is kept as it is."""
    if not place.by_memory:
        return place, usage
    limit = _bytes_limit(devices)
    if not limit:
        return dataclasses.replace(place, lanes_note="the device reports no memory limit"), usage
    held = usage.lanes // max(1, place.lanes)
    step = int(step_bytes())
    fixed = usage.total - usage.lanes - usage.activations
    fit = lanes_that_fit(limit, fixed, held + step, place.lanes)
    lanes = max(1, fit)
    fitted = dataclasses.replace(usage, lanes=lanes * held, activations=lanes * step)
    if fit == place.lanes:
        every = "all fit" if place.lanes * place.devices >= place.jobs else "fit"
        note = f"{every}: {_size(fitted.total)} of {_size(limit)}"
    elif fit:
        note = (f"by memory: each lane needs {_size(held + step)}, "
                f"{_size(MEMORY_SHARE * limit - fixed)} of {_size(limit)} left after data, "
                f"state and updates")
    else:
        note = f"not even one lane of {_size(held + step)} fits"
    return dataclasses.replace(place, lanes=lanes, lanes_note=note), fitted


def lanes_text(place: Placement) -> str:
    """"lanes: L of J jobs (why)": the lanes per device, the round's jobs and why."""
    where = f" per device x {place.devices} devices," if place.devices > 1 else " of"
    jobs = f"{where} {place.jobs} jobs" if place.jobs else ""
    note = f" ({place.lanes_note})" if place.lanes_note else ""
    return f"lanes: {place.lanes}{jobs}{note}"


def _mb(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MB"


def _size(n: float) -> str:
    """Bytes in MB, or in GB from 1 GB (2 ** 30)."""
    return f"{n / 2 ** 30:.1f} GB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MB"


def lanes_that_fit(limit: float, fixed: float, per_lane: float, most: int) -> int:
    """The largest L <= `most` with fixed + L x per_lane <= MEMORY_SHARE x limit (bytes);
    0 when not even one lane fits."""
    room = MEMORY_SHARE * limit - fixed
    if per_lane <= 0:
        return most if room >= 0 else 0
    return max(0, min(most, int(room // per_lane)))


def lane_step_bytes(model: Model, data: FederatedDataset, batch_size: int) -> int:
    """The activations and temporaries of one local-SGD step of ONE lane at `batch_size`:
    XLA's memory analysis of that step compiled on its own (value and gradient of the mean
    loss of a minibatch, and the SGD update), its temporaries plus its minibatch's bytes (its
    other arguments, the model, are the lane's held copies). XLA's buffer assignment reuses
    memory across the forward and backward passes as the round's program does, which a sum of
    every intermediate's shape (``jax.eval_shape``) cannot see; that sum is the fallback where
    the backend gives no memory analysis. Vmapped lanes hold L times these bytes."""
    params = jax.eval_shape(model.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((batch_size,) + tuple(data.feature_shape), data.train.x_dtype)
    y = jax.ShapeDtypeStruct((batch_size,), np.int32)

    def step(p, x, y):   # p: one model; x: [B, *feature_shape]; y: [B]
        grads = jax.grad(lambda q: model.losses(q, x, y).mean())(p)
        return jax.tree.map(lambda a, g: a - 0.01 * g, p, grads)

    batch = tree_nbytes((x, y))
    analysis = jax.jit(step).lower(params, x, y).compile().memory_analysis()
    if analysis is not None:
        return int(analysis.temp_size_in_bytes) + batch
    jaxpr = jax.make_jaxpr(step)(params, x, y)
    return batch + sum(tree_nbytes([v.aval for v in eqn.outvars])
                       for eqn in jaxpr.jaxpr.eqns)


def placement_line(place: Placement, usage: Footprint, data: FederatedDataset, num_replicas: int,
                   planned_backend: Optional[str] = None) -> str:
    """One line: devices, lanes, where the clients are kept, and the bytes each device holds."""
    clients = (f", per-client state {_mb(usage.clients)} ({data.train.num_clients} clients x "
               f"{num_replicas} replicas, and the round's per-job results)"
               if usage.clients else "")
    running = jax.default_backend()
    as_on = (f", as on {planned_backend}"
             if planned_backend and planned_backend != running else "")
    held = (f"data {_mb(usage.data)} (both splits)" if place.client_data == "device" else
            f"data {_mb(usage.data)} (the round's sampled clients and one evaluation block of "
            f"{place.eval_block} examples; the host keeps the {data.train.num_clients} + "
            f"{data.test.num_clients} clients)")
    frozen = (f"frozen base {_mb(usage.frozen)} (once, shared by every lane and replica), "
              if usage.frozen else "")
    return (f"placement: {place.devices} {running} device(s) x {place.lanes} lane(s) "
            f"({place.lane_mode}{as_on}); per device: {frozen}{held}, state {_mb(usage.state)}"
            f"{clients}, "
            f"round plan {_mb(usage.plan)}, lanes {_mb(usage.lanes)}, "
            f"updates {_mb(usage.updates)} ({num_replicas} replicas x m)"
            + (f", activations {_mb(usage.activations)}" if usage.activations else "")
            + f"; {lanes_text(place)}")


HOST_STATE_SHARE = 0.8   # of this machine's memory that a CPU run's devices and state may take


def check_memory(usage: Footprint, devices) -> None:
    """ConfigError before compiling when the run cannot fit: in a device's memory (backends
    whose devices report memory_stats()), or, on XLA:CPU, which reports none, in this
    machine's memory, which its host devices share, the per-client state being built on the
    host first (every device's footprint plus one more copy of that state)."""
    limit = _bytes_limit(devices)
    if limit:
        if usage.total > MEMORY_SHARE * limit:
            raise ConfigError(f"the run needs about {_mb(usage.total)} per device but "
                              f"{_local(devices)[0].device_kind} has {_mb(limit)}; reduce "
                              f"{_biggest(usage)}")
        return
    host, n = host_memory(), len(_local(devices))
    need = n * usage.total + usage.clients
    if host and need > HOST_STATE_SHARE * host:
        raise ConfigError(f"the run needs about {_mb(need)} of this machine's {_mb(host)} "
                          f"({n} host device(s) x {_mb(usage.total)}, and the per-client state "
                          f"built on the host first); reduce {_biggest(usage)}")


def _biggest(usage: Footprint) -> str:
    """What to reduce: the largest part of `usage`, named by its flags."""
    return max(("the data (--client_data=host, --max_examples_per_client, "
                "--max_train_clients)", usage.data),
               ("the replicas (fewer --thetas, --server_lr values or --seeds)", usage.state),
               ("the per-client state (fewer replicas, or --max_train_clients)", usage.clients),
               ("the lanes (--clients_per_step, --batch_size)",
                usage.lanes + usage.activations),
               ("the round's updates (fewer replicas or --clients_per_round)", usage.updates),
               ("the frozen base (--base_dtype=bfloat16, or a smaller --base_model)",
                usage.frozen),
               key=lambda kv: kv[1])[0]


def host_memory() -> Optional[int]:
    """This machine's physical memory in bytes (None where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_streams(streams: Sequence[Tuple[str, int, int]]) -> None:
    """ConfigError (one line, naming the flags) before anything is built or written, for the
    index streams of a run's plans: `streams` holds (the flags that size it, its entries, the
    bytes the host allocates for it). A stream longer than int32 indices reach
    (:data:`INDEX_LIMIT`) is refused, and so are streams whose host arrays together exceed
    HOST_SHARE of this machine's memory (each is copied to the devices as well)."""
    for flags, entries, _ in streams:
        if entries > INDEX_LIMIT:
            raise ConfigError(f"{flags}: a stream of {entries:,} examples, more than the "
                              f"{INDEX_LIMIT:,} that the plan's int32 indices reach; lower it")
    memory = host_memory()
    total = sum(n for _, _, n in streams)
    if memory and total > HOST_SHARE * memory:
        flags = max(streams, key=lambda s: s[2])[0]
        raise ConfigError(f"{flags}: the plans need about {_mb(total)} of host memory, more "
                          f"than {HOST_SHARE:.0%} of this machine's {_mb(memory)}; lower it")
