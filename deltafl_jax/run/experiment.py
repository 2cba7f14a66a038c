"""Build an experiment: the data, the model, the algorithm, the replicas and the jitted round.

:func:`build_experiment` turns a frozen :class:`deltafl_jax.config.ExperimentConfig` into an
:class:`Experiment`: everything a run needs, built once, with every check that can fail done
before any output is written. :meth:`Experiment.evaluate` gives the per-client losses and
errors of every replica on all training and all test clients (paper, App. C.2.3).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax import engine, plan as plan_lib, rounds
from deltafl_jax.engine import mesh as mesh_lib
from deltafl_jax.algorithms import registry
from deltafl_jax.algorithms.spec import AlgorithmSpec, FederatedAlgorithm
from deltafl_jax.config import PERCENTILES, ExperimentConfig
from deltafl_jax.data import FederatedDataset
from deltafl_jax.datasets import load_dataset
from deltafl_jax.errors import ConfigError
from deltafl_jax.metrics import summarize
from deltafl_jax.models import Model, ModelOptions, build_model, default_conv_impl
from deltafl_jax.privacy import UPDATE_RELEASE, Accounting
from deltafl_jax.replicas import Replicas


@dataclasses.dataclass(frozen=True)
class Placement:
    """How client work runs: devices, lanes per device and their mode, evaluation chunk and
    lanes (from the model's preferences on this backend, unless the config sets them), and
    the local-SGD loop's shape (minibatch steps per while trip, conds or masked selects:
    :func:`deltafl_jax.engine.loop_shape`)."""

    lanes: int
    lane_mode: str
    eval_chunk: int
    eval_lanes: int
    devices: int = 1
    unroll: int = 1
    branchless: bool = False


def placement(config: ExperimentConfig, model: Model, m: int, num_replicas: int,
              backend: Optional[str] = None, devices: int = 1) -> Placement:
    """Lanes per device: on CPU the model's measured preference; on accelerators enough that
    devices x lanes cover the R x m jobs of a round (every kept client trains in the first
    trip), capped at m. Evaluation lanes: one on CPU (a bigger chunk is the better batch
    there); on accelerators one per replica (up to 16), so a step evaluates all models.
    `config.placement_backend` plans as on that backend instead of the running one, and
    `config.branchless` overrides the loop shape's body."""
    backend = backend or config.placement_backend or jax.default_backend()
    prefs = model.lanes
    jobs = m * num_replicas
    per_device = (prefs.lanes(m, backend, devices) if backend == "cpu"
                  else min(m, -(-jobs // devices)))
    lanes = min(config.clients_per_step or per_device, jobs)
    loop = engine.loop_shape(backend)
    return Placement(lanes=lanes, lane_mode=prefs.lane_mode(backend),
                     eval_chunk=config.eval_chunk or prefs.eval_chunk(backend),
                     eval_lanes=1 if backend == "cpu" else max(1, min(num_replicas, 16)),
                     devices=devices, unroll=loop.unroll,
                     branchless=loop.branchless if config.branchless is None
                     else config.branchless)


@dataclasses.dataclass(eq=False)
class Experiment:
    """Everything a run needs, built once."""

    config: ExperimentConfig
    data: FederatedDataset
    model: Model
    model_options: ModelOptions
    spec: AlgorithmSpec
    algorithm: FederatedAlgorithm
    replicas: Replicas
    work: plan_lib.LocalWork
    caps: plan_lib.Capacities
    placement: Placement
    num_sampled: int       # m: clients sampled per round (AFL: all training clients)
    round_fn: Callable     # jitted round_fn(state, data, keys) -> (state, metrics)
    device_train: Tuple[jax.Array, jax.Array]
    device_test: Tuple[jax.Array, jax.Array]
    split_plans: Dict[str, Any]
    eval_fn: Callable      # jitted (params, x, y, idx, seg, length) -> (loss_sum, err_sum)
    served_fn: Optional[Callable] = None  # jitted (algo_state, params) -> served params
    mesh: Optional[Any] = None            # the device mesh when the round spans D > 1 devices
    footprint: Optional[Footprint] = None # bytes held on each device
    server_tx: Optional[Any] = None   # the server optimizer's transformation (None: w + Delta)
    accounting: Optional[Accounting] = None   # client-level DP: epsilon of each replica

    def _place(self, tree):
        return tree if self.mesh is None else mesh_lib.replicate(tree, self.mesh)

    @property
    def seeds(self):
        return self.config.seeds

    @property
    def backend(self) -> str:
        return jax.default_backend()

    @property
    def lanes(self) -> int:
        return self.placement.lanes

    @property
    def eval_chunk(self) -> int:
        return self.placement.eval_chunk

    def initial_state(self) -> rounds.ServerState:
        return self._place(rounds.init_state(self.model, self.algorithm, self.replicas,
                                             self.seeds, self.server_tx,
                                             self.data.train.num_clients))

    def keys(self):
        return self._place(rounds.replica_keys(self.replicas, self.seeds))

    def served_params(self, state):
        """The models that are evaluated and saved, [R, ...]: w_t, or what the algorithm
        serves instead (AFL: the averaged iterate)."""
        if self.served_fn is None:
            return state.params
        return self.served_fn(state.algo_state, state.params)

    def round_plan(self, round_idx: int) -> plan_lib.RoundPlan:
        return plan_lib.make_round_plan(self.seeds, round_idx, self.data.train.offsets,
                                        self.num_sampled, self.work, self.caps)

    def round_data(self, round_idx: int) -> rounds.RoundData:
        x, y = self.device_train
        plan = self.round_plan(round_idx)
        plan = jax.device_put(plan) if self.mesh is None else self._place(plan)
        return rounds.RoundData(x=x, y=y, plan=plan)

    def evaluate(self, params) -> Dict[str, np.ndarray]:
        """Per-client arrays [R, N] (float64) on all training and all test clients: losses
        (train ones with (l2/2)||w||^2) and errors."""
        out = {}
        sqnorm = mesh_lib.to_host(jax.vmap(engine.tree_sqnorm)(params))
        for name, split, (x, y) in (("train", self.data.train, self.device_train),
                                    ("test", self.data.test, self.device_test)):
            sp = self.split_plans[name]
            loss_sum, err_sum = mesh_lib.tree_to_host(
                self.eval_fn(params, x, y, sp.eval_idx, sp.eval_seg, sp.eval_len))
            k = split.num_clients
            n = split.sizes.astype(np.float64)
            loss = np.asarray(np.asarray(loss_sum)[:, :k], np.float64) / n
            if name == "train":
                loss = loss + 0.5 * (self.replicas.l2.astype(np.float64) * sqnorm)[:, None]
            out[f"{name}_loss"] = loss
            out[f"{name}_error"] = np.asarray(np.asarray(err_sum)[:, :k], np.float64) / n
        return out

    def summarize(self, per_client, method: str = "lower") -> Dict[str, np.ndarray]:
        """The papers' metrics per replica (alpha-weighted train losses, unweighted test)."""
        return summarize(per_client["train_loss"], self.data.train.sizes,
                         per_client["test_error"], per_client["test_loss"], PERCENTILES,
                         method)


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes held on EACH device (everything is replicated across the mesh): the two splits,
    the replicas' state (models, the algorithm's and the server optimizer's state), the
    per-client state of an algorithm that keeps one (SCAFFOLD's c_k: N x |w| per replica, and
    the round's per-job results), one round's plan, and the lanes' local models (params, anchor
    and optimizer state, about 3 copies of one model per lane, and a job context each)."""

    data: int
    state: int
    plan: int
    lanes: int
    clients: int = 0

    @property
    def total(self) -> int:
        return self.data + self.state + self.plan + self.lanes + self.clients


def _tree_nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def footprint(data: FederatedDataset, model: Model, replicas: Replicas, place: Placement,
              caps: plan_lib.Capacities, m: int, state_shape=None) -> Footprint:
    """`state_shape`: the round state's shapes (``jax.eval_shape`` of the initial state);
    None: the models alone."""
    model_bytes = _tree_nbytes(jax.eval_shape(model.init, jax.random.key(0)))
    G = len(set(int(g) for g in replicas.group))
    split_bytes = sum(s.x.nbytes + s.num_examples * 4 for s in (data.train, data.test))
    state, clients, per_client = replicas.size * model_bytes, 0, 0
    if state_shape is not None:
        clients = _tree_nbytes(state_shape.client_state)
        state = _tree_nbytes(state_shape) - clients
        per_client = clients // max(1, replicas.size * data.train.num_clients)
    return Footprint(data=int(split_bytes), state=state,
                     plan=4 * G * (2 * caps.eval_len + caps.train_len + 6 * m),
                     lanes=place.lanes * (3 * model_bytes + per_client),
                     clients=clients + 2 * replicas.size * m * per_client)


def _mb(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MB"


def placement_line(exp: "Experiment") -> str:
    """One line: devices, lanes, and the bytes each device holds."""
    p, f = exp.placement, exp.footprint
    clients = (f", per-client state {_mb(f.clients)} ({exp.data.train.num_clients} clients x "
               f"{exp.replicas.size} replicas, and the round's per-job results)"
               if f.clients else "")
    running, planned = jax.default_backend(), exp.config.placement_backend
    as_on = f", as on {planned}" if planned and planned != running else ""
    return (f"placement: {p.devices} {running} device(s) x {p.lanes} lane(s) "
            f"({p.lane_mode}{as_on}); per device: data {_mb(f.data)}, state {_mb(f.state)}{clients}, "
            f"round plan {_mb(f.plan)}, lanes {_mb(f.lanes)}")


def check_memory(fp: Footprint, devices) -> None:
    """ConfigError before compiling when the run cannot fit in a device's memory (backends
    whose devices report memory_stats(); XLA:CPU does not)."""
    local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    try:
        stats = local[0].memory_stats()
    except Exception:  # pylint: disable=broad-except
        stats = None
    limit = (stats or {}).get("bytes_limit")
    if not limit or fp.total <= 0.9 * limit:
        return
    biggest = max(("the data (--max_examples_per_client, --max_train_clients)", fp.data),
                  ("the replicas (fewer --thetas, --server_lr values or --seeds)", fp.state),
                  ("the per-client state (fewer replicas, or --max_train_clients)", fp.clients),
                  ("the lanes (--clients_per_step)", fp.lanes), key=lambda kv: kv[1])[0]
    raise ConfigError(f"the run needs about {_mb(fp.total)} per device but "
                      f"{local[0].device_kind} has {_mb(limit)}; reduce {biggest}")


def _device_split(split, mesh=None):
    """The split on the device(s), in its stored dtype (uint8 pixels stay uint8)."""
    y = split.y if split.y is not None else np.zeros((split.num_examples,), np.int32)
    pair = (split.x, y.astype(np.int32))
    return jax.device_put(pair) if mesh is None else mesh_lib.replicate(pair, mesh)


def _model(config: ExperimentConfig, data: FederatedDataset) -> Tuple[Model, ModelOptions]:
    conv_impl = config.conv_impl or (default_conv_impl(config.placement_backend)
                                     if config.placement_backend else None)
    options = ModelOptions(conv_impl=conv_impl, use_bias=config.use_bias)
    try:
        return build_model(config.model, data, options), options
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _eval_fn(model: Model, place: Placement, num_segments: int, mesh=None):
    """One jitted evaluation of R models over a whole split (both splits share it), its
    chunks dealt across the devices of `mesh`."""
    axis = mesh_lib.SINGLE if mesh is None else mesh_lib.DeviceAxis(place.devices,
                                                                    mesh_lib.AXIS)

    def eval_fn(params, x, y, idx, seg, length):
        group = jnp.zeros((jax.tree.leaves(params)[0].shape[0],), jnp.int32)
        res = engine.evaluate_streams(model, params, x, y, idx, seg, length, group,
                                      num_segments, place.eval_chunk, place.eval_lanes, axis)
        return res.loss_sum, res.error_sum
    return jax.jit(eval_fn if mesh is None else mesh_lib.sharded(eval_fn, mesh, 6))


def _sampled(config: ExperimentConfig, spec: AlgorithmSpec, data: FederatedDataset) -> int:
    m = config.clients_per_round
    if m > data.train.num_clients:
        raise ConfigError(
            f"--clients_per_round={m} exceeds the {data.train.num_clients} training clients of "
            f"{data.name}")
    return int(data.train.num_clients) if spec.all_clients else m


def _round_fn(model, algorithm, replicas, config, place: Placement, m: int, mesh,
              server_tx):
    """The jitted round: plain for one device, jit(shard_map(...)) over a mesh otherwise."""
    axis = mesh_lib.SINGLE if mesh is None else mesh_lib.DeviceAxis(place.devices,
                                                                    mesh_lib.AXIS)
    local = engine.LocalSGDConfig(batch_size=config.batch_size, lanes=place.lanes,
                                  lane_mode=place.lane_mode, unroll=place.unroll,
                                  branchless=place.branchless,
                                  local_penalty=algorithm.local_penalty, axis=axis,
                                  clip=config.dp_clip)
    raw = rounds.build_round_fn(model, algorithm, replicas, local, place.eval_chunk,
                                place.eval_lanes, m, server_tx)
    return jax.jit(raw if mesh is None else mesh_lib.sharded(raw, mesh, 3), donate_argnums=(0,))


def _mesh(config: ExperimentConfig):
    """None for one device (the plain path), else the mesh of --devices devices."""
    devices = config.devices if config.devices not in (None, 0, -1) else jax.device_count()
    if devices == 1:
        return None
    try:
        return mesh_lib.make_mesh(devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _accounting(config: ExperimentConfig, spec: AlgorithmSpec, algorithm: FederatedAlgorithm,
                m: int, num_clients: int, replicas) -> Optional[Accounting]:
    """The privacy ledger of a private run (None otherwise), its noise multipliers those of
    the config's DP values (calibrated to each --dp_target_epsilon); ConfigError when the
    algorithm, with its options, has no private version."""
    privacy = config.privacy
    if not privacy.enabled:
        return None
    if algorithm.private is None:
        raise ConfigError(f"--dp_clip: --algorithm={spec.name} has a private version only with "
                          f"{spec.dp_requires}")
    if replicas is not None:
        raise ConfigError("--dp_clip applies to the replicas of the algorithm's own sweep, not "
                          "to a grid given with them (the tuner's)")
    releases = (UPDATE_RELEASE,) + tuple(algorithm.private.releases)
    noise = privacy.noise_multipliers_for(m, config.num_rounds, num_clients, releases)
    return Accounting(population=num_clients, m=m, releases=releases,
                      delta=privacy.delta_for(num_clients), noise=noise)


def build_experiment(config: ExperimentConfig, data: Optional[FederatedDataset] = None,
                     replicas: Optional[Replicas] = None) -> Experiment:
    """Load the data and build the jitted round. Raises ConfigError / DataError on bad input.

    `replicas` may be given to train an arbitrary set of per-replica hyper-parameters (the
    tuner's learning-rate / l2 grids); by default they are the spec's sweep x seeds.
    """
    data = data if data is not None else load_dataset(config.data)
    model, options = _model(config, data)
    spec = registry.get(config.algorithm)
    m = _sampled(config, spec, data)
    algorithm = spec.make(config, data)
    accounting = _accounting(config, spec, algorithm, m, data.train.num_clients, replicas)
    replicas = replicas or spec.grid(
        config, accounting.noise if accounting is not None else (0.0,)).build()
    if accounting is not None:   # each replica's own z, in replica order
        accounting = dataclasses.replace(accounting,
                                         noise=tuple(float(z) for z in replicas.dp_noise))
    local_steps = spec.local_steps if spec.local_steps is not None else config.local_steps
    work = plan_lib.LocalWork(batch_size=config.batch_size, local_epochs=config.local_epochs,
                              local_steps=local_steps)
    mesh = _mesh(config)
    place = placement(config, model, m, replicas.size,
                      devices=1 if mesh is None else mesh.devices.size)
    caps = plan_lib.capacities(data.train.sizes, m, work, place.eval_chunk)
    server_tx = config.server.transformation()
    state_shape = jax.eval_shape(lambda: rounds.init_state(
        model, algorithm, replicas, config.seeds, server_tx, data.train.num_clients))
    fp = footprint(data, model, replicas, place, caps, m, state_shape)
    check_memory(fp, jax.devices() if mesh is None else list(mesh.devices.flat))
    round_fn = _round_fn(model, algorithm, replicas, config, place, m, mesh, server_tx)
    # Both splits use one segment count (the larger), so one evaluation program serves both.
    segments = max(data.train.num_clients, data.test.num_clients)
    put = jax.device_put if mesh is None else (lambda t: mesh_lib.replicate(t, mesh))
    split_plans = {name: put(plan_lib.make_split_plan(split.offsets, place.eval_chunk, segments))
                   for name, split in (("train", data.train), ("test", data.test))}
    return Experiment(
        config=config, data=data, model=model, model_options=options, spec=spec,
        algorithm=algorithm, replicas=replicas, work=work,
        caps=caps, placement=place, footprint=fp,
        num_sampled=m, round_fn=round_fn, device_train=_device_split(data.train, mesh),
        device_test=_device_split(data.test, mesh), split_plans=split_plans,
        eval_fn=_eval_fn(model, place, segments, mesh),
        served_fn=(jax.jit(jax.vmap(algorithm.eval_params))
                   if algorithm.eval_params is not None else None), mesh=mesh,
        server_tx=server_tx, accounting=accounting)
