"""Build an experiment: the data, the model, the algorithm, the replicas and the jitted round.

:func:`build_experiment` turns a frozen :class:`deltafl_jax.config.ExperimentConfig` into an
:class:`Experiment`: everything a run needs, built once, with every check that can fail done
before any output is written. :meth:`Experiment.evaluate` gives the per-client losses and
errors of every replica on all training and all test clients (paper, App. C.2.3), or on a
sample of K of each (``--eval_clients``), from which :meth:`Experiment.summarize` estimates
the metrics with 95% confidence intervals (:mod:`deltafl_jax.eval_sample`). Where the work
and the data go is :mod:`deltafl_jax.run.placement`; the clients' examples, on the devices
or on the host, are :mod:`deltafl_jax.run.client_store`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Optional

import jax
import numpy as np

from deltafl_jax import engine, plan as plan_lib, rounds
from deltafl_jax.engine import mesh as mesh_lib
from deltafl_jax.algorithms.protocol import FederatedAlgorithm
from deltafl_jax.algorithms.spec import AlgorithmSpec
from deltafl_jax.availability_metrics import AvailabilitySplit
from deltafl_jax.config import PERCENTILES, ExperimentConfig
from deltafl_jax.data import FederatedDataset
from deltafl_jax.errors import ConfigError
from deltafl_jax.eval_sample import EvalSampler, summarize_sample
from deltafl_jax.metrics import summarize
from deltafl_jax.models import Model, ModelOptions
from deltafl_jax.models.augment import augmentation
from deltafl_jax.privacy import Accounting
from deltafl_jax.replicas import Replicas
from deltafl_jax.run import placement as placement_lib
from deltafl_jax.run.callbacks import RunFacts, RunView
from deltafl_jax.run import personal as personal_lib
from deltafl_jax.run.buffered import CLIENT_COUNTS, LOST_COUNTS, AsyncRound, async_speeds
from deltafl_jax.run.client_store import ClientStore
from deltafl_jax.run.personal import PersonalEvaluation
from deltafl_jax.run.placement import (Footprint, Placement, check_memory, choose_placement,
                                       compute_footprint)
from deltafl_jax.run.resolve import resolve, test_availability
from deltafl_jax.sampling import FixedSampler, PoissonSampler, Sampler
from deltafl_jax.sampling.participation import Participation
from deltafl_jax.sampling.timeline import VirtualClock

CLOCK = "clock"   # the virtual clock's part of the checkpointed host state

AUTO_FULL_EVAL = 100_000    # populations up to this many clients are evaluated whole by default
AUTO_EVAL_CLIENTS = 1000    # clients of each split per evaluation beyond it


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
    num_sampled: int       # m: clients sampled per round (AFL: all training clients; Poisson:
                           # the cap, the plan's slots; an asynchronous run: K)
    round_fn: Callable     # jitted round_fn(state, data, keys) -> (state, metrics)
    store: ClientStore     # the clients' examples, on the devices or on the host
    served_fn: Optional[Callable] = None  # jitted (algo_state, params) -> served params
    mesh: Optional[Any] = None            # the device mesh when the round spans D > 1 devices
    footprint: Optional[Footprint] = None # bytes held on each device
    server_tx: Optional[Any] = None   # the server optimizer's transformation (None: w + Delta)
    accounting: Optional[Accounting] = None   # client-level DP: epsilon of each replica
    eval_clients: Optional[int] = None    # K clients of each split per evaluation (None: all)
    personal: Optional[PersonalEvaluation] = None   # seen / unseen clients (--client_holdout)
    sampler: Optional[Sampler] = None     # who trains (None: m of N uniformly, fixed)
    replica_seeds: Optional[np.ndarray] = None   # [R] each replica's seed index (the run's)
    # the test error by availability quintile (deltafl_jax/availability_metrics.py); None: none
    availability_split: Optional[AvailabilitySplit] = None
    participation: Optional[Participation] = None   # online sets and participation counts
    clock: Optional[Any] = None   # the virtual clock (--client_speed; an asynchronous run's)
    buffered: Optional[AsyncRound] = None   # an asynchronous run's step (None: rounds)

    @property
    def poisson(self) -> Optional[PoissonSampler]:
        """The Poisson sampler (q, cap) under --client_sampling=poisson, else None."""
        return self.sampler if isinstance(self.sampler, PoissonSampler) else None

    def _place(self, tree):
        return tree if self.mesh is None else mesh_lib.replicate(tree, self.mesh)

    @property
    def seeds(self):
        """The seed of each plan group: the run's seeds, or each replica's own when the
        algorithm samples from its state (one plan per replica, :func:`plan_per_replica`)."""
        if self.replica_seeds is not None:
            return tuple(self.config.seeds[int(g)] for g in self.replica_seeds)
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
        privacy = self.config.privacy
        correlated = self.accounting.correlated if self.accounting is not None else None
        clip = privacy.initial_clip if privacy.adaptive else None
        state = rounds.init_state(self.model, self.algorithm, self.replicas, self.seeds,
                                  self.server_tx, self.data.train.num_clients, clip=clip,
                                  bands=len(correlated.coef) if correlated else 0)
        if self.buffered is not None:   # the same w_0 in the ring of versions
            state = self.buffered.initial_state(state.params, self.server_tx,
                                                self.replicas.server_lr)
        return self._place(state)

    def keys(self):
        return self._place(rounds.replica_keys(self.replicas, self.seeds))

    def served_params(self, state):
        """The models that are evaluated and saved, [R, ...]: w_t, or what the algorithm
        serves instead (AFL: the averaged iterate)."""
        if self.buffered is not None:
            return self.buffered.served_params(state)
        if self.served_fn is None:
            return state.params
        return self.served_fn(state.algo_state, state.params)

    def personal_params(self, state):
        """Every training client's personal model, [R, N, ...] (the algorithm's
        ``client_model``), or None for an algorithm that serves the global model to all."""
        if self.algorithm.client_model is None:
            return None
        return self._personal_fn(state.algo_state, state.client_state,
                                 self.served_params(state),
                                 jax.tree.map(lambda v: np.asarray(v, np.float32),
                                              self.replicas.hyper))

    @functools.cached_property
    def _personal_fn(self):
        model_of = self.algorithm.client_model
        per_client = jax.vmap(model_of, in_axes=(None, 0, None, None))
        return jax.jit(jax.vmap(per_client))

    def round_plan(self, round_idx: int, state=None) -> plan_lib.RoundPlan:
        """The plan as the devices read it (indices into the split, or into the round's
        buffer when the host keeps the split). An algorithm that samples from its state
        (``sampling``) needs the round's state (the previous round's result)."""
        cohorts, steps = self.kept_cohorts(round_idx, state)
        return plan_lib.make_round_plan(self.seeds, round_idx, self.data.train.offsets,
                                        self.num_sampled, self.work, self.caps,
                                        packed=self.store.host, cohorts=cohorts, steps=steps)

    def cohorts(self, round_idx: int, state=None, online=None) -> list:
        """Each plan group's cohort of the round (:mod:`deltafl_jax.sampling`), drawn among
        `online` (one id array per group; None: every client); an algorithm that samples from
        its state (``sampling``: by its weights) needs the round's state. With the virtual
        clock, the clients it keeps of those selected (:meth:`kept_cohorts`)."""
        return self.kept_cohorts(round_idx, state, online)[0]

    def kept_cohorts(self, round_idx: int, state=None, online=None):
        """(cohorts, steps): each plan group's cohort of the round and the local steps [G, m]
        that cap its slots' (None: the work's). With the virtual clock the server selects
        (M slots under ``--over_select``) and keeps the m first to finish by the deadline
        (:mod:`deltafl_jax.sampling.timeline`)."""
        sampler = self.sampler or FixedSampler(self.data.train.num_clients, self.num_sampled)
        if self.clock is not None and self.clock.over_selects and \
                self.algorithm.sampling is None:
            sampler = self.clock.selection_sampler()
        if online is None and self.participation is not None:
            online = self.participation.online(round_idx)
        if self.algorithm.sampling is None:
            cohorts = plan_lib.draw_cohorts(sampler, self.seeds, round_idx, online)
        else:
            if state is None:
                raise ValueError(f"{self.algorithm.name} samples its clients from its state: "
                                 "give round_plan / round_data the round's state")
            weights = mesh_lib.to_host(self._sampling_fn(state.algo_state))
            cohorts = [sampler.with_weights(weights[g]).cohort(
                           seed, round_idx, None if online is None else online[g])
                       for g, seed in enumerate(self.seeds)]
        steps = None
        if self.clock is not None:
            cohorts, steps = self.clock.select(round_idx, cohorts, online)
        if self.participation is not None:
            self.participation.drawn(round_idx, cohorts)
        return cohorts, steps

    def count_round(self, round_idx: int) -> Dict[str, np.ndarray]:
        """Count round `round_idx` as trained in the participation record and on the virtual
        clock (once per round, in order, after its plan was drawn); its per-round metrics [R]:
        ``num_online``, the clients online in each replica's plan group, and with the clock
        ``virtual_time``, ``round_seconds``, ``num_dropped`` and ``num_late``
        (:meth:`deltafl_jax.sampling.timeline.VirtualClock.count`)."""
        out = {}
        group = np.asarray(self.replicas.group)
        if self.participation is not None:
            out["num_online"] = self.participation.count(round_idx)[group]
        if self.clock is not None:
            out.update({k: v[group] for k, v in self.clock.count(round_idx).items()})
        return out

    def virtual_time(self) -> Optional[np.ndarray]:
        """[R] each replica's virtual time (seconds) at the end of the rounds counted so far,
        or None without the virtual clock."""
        if self.clock is None:
            return None
        return self.clock.now[np.asarray(self.replicas.group)].copy()

    def host_state(self) -> Dict[str, object]:
        """The host's state that a checkpoint keeps: the participation record, and the
        virtual clock's under ``clock``."""
        out = dict(self.participation.state()) if self.participation is not None else {}
        if self.clock is not None:
            out[CLOCK] = self.clock.state()
        return out

    def restore_host(self, host: Dict[str, object]) -> None:
        """Continue from a :meth:`host_state`."""
        if self.participation is not None:
            self.participation.restore(host)
        if self.clock is not None:
            self.clock.restore(host[CLOCK])

    def participation_arrays(self, clients=None) -> Dict[str, np.ndarray]:
        """Each replica's realised participation so far, [R, N] (or [R, K] at the training
        clients `clients`): ``train_rounds_online`` and ``train_rounds_sampled``, the rounds its
        plan group's clients were online and sampled; with a clock, its counts
        (``client_counts``)."""
        group = np.asarray(self.replicas.group)
        out = {}
        counts = [] if self.participation is None else [
            ("train_rounds_online", self.participation.online_rounds),
            ("train_rounds_sampled", self.participation.sampled_rounds)]
        if self.clock is not None:
            counts += self.clock.client_counts()
        for name, per_group in counts:
            per = per_group[group]
            out[name] = per if clients is None else per[:, np.asarray(clients, np.int64)]
        return out

    def round_data(self, round_idx: int, state=None) -> rounds.RoundData:
        """The round's plan and examples on the device(s) (`state`: as :meth:`round_plan`),
        with the probe sample of an algorithm that has one. An asynchronous run's: server
        step `round_idx`'s data and its inputs (:class:`deltafl_jax.run.buffered.AsyncClock`)."""
        if self.buffered is not None:
            plan, inputs = self.clock.plan(round_idx)
            return self.store.round_data(plan), inputs
        data = self.store.round_data(self.round_plan(round_idx, state))
        if self.algorithm.probe is None:
            return data
        probe = plan_lib.make_probe_plan(self.seeds, round_idx, self.data.train.offsets,
                                         self.num_sampled, self.caps)
        return data._replace(probe=self.store.put(probe))

    @functools.cached_property
    def _sampling_fn(self):
        return jax.jit(jax.vmap(self.algorithm.sampling))

    def evaluation_sample(self, round_idx: int):
        """The clients evaluated after round `round_idx` (an :class:`EvalSample`), or None
        when every client is."""
        if self.eval_clients is None:
            return None
        return self._sampler.draw(self.seeds[0], round_idx, self.eval_clients)

    def evaluate(self, params, round_idx: int = 0) -> Dict[str, np.ndarray]:
        """Per-client arrays [R, N] (float64) on all training and all test clients: losses
        (train ones with (l2/2)||w||^2) and errors (NaN where the loss is not finite). With ``eval_clients`` = K, on the sample
        of :meth:`evaluation_sample` instead ([R, K]), whose client indices are added as
        ``train_clients`` and ``test_clients``."""
        out = {}
        sqnorm = mesh_lib.to_host(jax.vmap(engine.tree_sqnorm)(params))
        sample = self.evaluation_sample(round_idx)
        for name, split in (("train", self.data.train), ("test", self.data.test)):
            clients = None if sample is None else getattr(sample, name)
            loss_sum, err_sum = self.store.stream_sums(params, name, clients)
            n = (split.sizes if clients is None else split.sizes[clients]).astype(np.float64)
            loss = np.asarray(loss_sum, np.float64) / n
            if name == "train":
                # l2 = 0 adds nothing, even where ||w||^2 overflowed float32 to inf
                l2 = self.replicas.l2.astype(np.float64)
                with np.errstate(invalid="ignore"):   # 0 x inf, replaced by 0
                    loss = loss + 0.5 * np.where(l2 == 0, 0.0, l2 * sqnorm)[:, None]
            out[f"{name}_loss"] = loss
            # An error counted from a model whose loss is not finite (NaN logits argmax to a
            # class) is no measurement: it is NaN, and so is every summary taken over it.
            err = np.asarray(err_sum, np.float64) / n
            out[f"{name}_error"] = np.where(np.isfinite(loss), err, np.nan)
            if clients is not None:
                out[f"{name}_clients"] = np.asarray(clients, np.int64)
        out.update(self.participation_arrays(None if sample is None else sample.train))
        return out

    def evaluate_personal(self, state, round_idx: int) -> Dict[str, np.ndarray]:
        """Per-client arrays of the personalised evaluation (:mod:`deltafl_jax.run.personal`:
        seen clients on their held-out data, unseen devices after adaptation), [R, K]; empty
        without ``--client_holdout``."""
        if self.personal is None:
            return {}
        sample = self.evaluation_sample(round_idx)
        return self.personal.evaluate(
            state, self.served_params(state), self.seeds[0], round_idx,
            test_clients=None if sample is None else sample.test,
            sample_size=None if sample is None else self.eval_clients)

    def summarize(self, per_client, method: str = "lower") -> Dict[str, np.ndarray]:
        """The papers' metrics per replica (alpha-weighted train losses, unweighted test); on
        a sampled evaluation, their estimates with 95% confidence intervals
        (:func:`deltafl_jax.eval_sample.summarize_sample`). With a personalised evaluation,
        each population's summaries (:func:`deltafl_jax.run.personal.summarize_populations`)."""
        classify = self.model.loss_kind != "squared"
        target = self.config.target_accuracy if classify else None
        if "train_clients" in per_client:
            out = summarize_sample(per_client["train_loss"], per_client["test_error"],
                                   per_client["test_loss"], PERCENTILES,
                                   num_test=self.data.test.num_clients,
                                   target_accuracy=target,
                                   error_bounds=(0.0, 1.0 if classify else np.inf))
        else:
            out = summarize(per_client["train_loss"], self.data.train.sizes,
                            per_client["test_error"], per_client["test_loss"], PERCENTILES,
                            method, target)
        if self.personal is not None:
            out.update(personal_lib.summarize_populations(
                per_client, self.personal.steps, self.data.train.num_clients,
                self.data.test.num_clients, method))
        if self.availability_split is not None:
            out.update(self.availability_split.summaries(per_client, method))
        return out

    def view(self) -> RunView:
        """The narrow view that callbacks get (:class:`deltafl_jax.run.callbacks.RunView`)."""
        data = self.data
        facts = RunFacts(
            dataset=data.name, dataset_stats=data.stats(),
            train_clients=data.train.num_clients, test_clients=data.test.num_clients,
            model=self.model.name, classify=self.model.is_classifier,
            config=self.config, num_sampled=self.num_sampled, lanes=self.lanes,
            eval_chunk=self.eval_chunk, backend=self.backend,
            placement_line=placement_lib.placement_line(
                self.placement, self.footprint, data, self.replicas.size,
                self.config.placement_backend),
            accounting=self.accounting)
        return RunView(labels=tuple(self.replicas.labels), facts=facts, evaluate=self.evaluate,
                       summarize=self.summarize, served_params=self.served_params,
                       personal_params=self.personal_params,
                       initial_state=self.initial_state)

    @functools.cached_property
    def _sampler(self) -> EvalSampler:
        return EvalSampler(self.data.train.sizes, self.data.test.num_clients)


def capacity_sizes(split, m: int) -> np.ndarray:
    """The client sizes that bound the round's streams: the split's own, or for a generator
    with a size cap, m clients at the cap (the same device bytes at every population)."""
    cap = getattr(split, "max_size", None)
    return split.sizes if cap is None else np.full((m,), cap, np.int64)


def eval_clients(config: ExperimentConfig, data: FederatedDataset) -> Optional[int]:
    """K of a sampled evaluation, or None for a full one: ``--eval_clients`` (0: full), by
    default full while the population has at most AUTO_FULL_EVAL clients (train + test) and
    AUTO_EVAL_CLIENTS beyond; full too when K covers both splits."""
    population = data.train.num_clients + data.test.num_clients
    k = config.eval_clients
    if k is None:
        k = 0 if population <= AUTO_FULL_EVAL else AUTO_EVAL_CLIENTS
    if k == 0 or k >= max(data.train.num_clients, data.test.num_clients):
        return None
    return int(k)


def _augment(config: ExperimentConfig, data: FederatedDataset) -> Optional[Callable]:
    """The local steps' augmentation (``--augment``; None: none); ConfigError for images it
    cannot read."""
    try:
        return augmentation(config.augment, data)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _local_config(config, place: Placement, mesh, augment=None) -> engine.LocalSGDConfig:
    """The clients' local SGD on `place` (over `mesh`'s devices; None: one device)."""
    axis = mesh_lib.SINGLE if mesh is None else mesh_lib.DeviceAxis(place.devices,
                                                                    mesh_lib.AXIS)
    return engine.LocalSGDConfig(batch_size=config.batch_size, lanes=place.lanes,
                                 lane_mode=place.lane_mode, unroll=place.unroll,
                                 branchless=place.branchless, axis=axis,
                                 order_lanes=place.order_lanes,
                                 clip=config.privacy.initial_clip,
                                 optimizer=config.client.transformation, augment=augment)


def _round_fn(model, algorithm, replicas, config, place: Placement, m: int, mesh,
              server_tx, expected: Optional[int] = None, correlated=None,
              variable: bool = False, augment=None):
    """The jitted round: plain for one device, jit(shard_map(...)) over a mesh otherwise."""
    local = _local_config(config, place, mesh, augment)
    privacy = config.privacy
    raw = rounds.build_round_fn(model, algorithm, replicas, local, place.eval_chunk,
                                place.eval_lanes, m, server_tx, expected=expected,
                                adaptive=privacy if privacy.adaptive else None,
                                correlated=correlated, variable=variable)
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


def _check_probe(spec: AlgorithmSpec, algorithm: FederatedAlgorithm, place: Placement) -> None:
    """ConfigError for an algorithm with a second sample (``probe``) on a host-kept split:
    its plan indexes the split on the device."""
    if algorithm.probe is not None and place.client_data == "host":
        raise ConfigError(f"--algorithm={spec.name} evaluates a second sample of clients from "
                          "the training split on the device: use --client_data=device")


def _availability_split(config: ExperimentConfig, data: FederatedDataset,
                        availability) -> Optional[AvailabilitySplit]:
    """Every evaluation's error split by availability quintile (None without availability):
    the training clients by their model's p_i (the seen clients of ``--client_holdout``, with
    their rounds online and sampled), the test devices by the same model over them."""
    if availability is None:
        return None
    test = test_availability(config, data)
    return AvailabilitySplit(availability.rates(), None if test is None else test.rates(),
                             ("train_rounds_online", "train_rounds_sampled"))


def build_experiment(config: ExperimentConfig, data: FederatedDataset,
                     replicas: Optional[Replicas] = None) -> Experiment:
    """The run of `config` on `data` (loaded by the caller) resolved
    (:func:`deltafl_jax.run.resolve.resolve`), placed on the devices, with its round jitted.
    Raises ConfigError / DataError on bad input.

    `replicas` may be given to train an arbitrary set of per-replica hyper-parameters (the
    tuner's learning-rate / l2 grids); by default they are the spec's sweep x seeds.
    """
    run = resolve(config, data, replicas)
    data, model, algorithm, replicas = run.data, run.model, run.algorithm, run.replicas
    settings = (None if run.spec.asynchronous is None
                else run.spec.asynchronous.settings(config.asynchronous))
    m = run.num_sampled if settings is None else settings.buffer_size   # the plan's slots
    mesh = _mesh(config)
    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    place = choose_placement(config, model, m, replicas.size, devices=len(devices),
                             client_data=placement_lib.client_data_mode(config.client_data,
                                                                        data, devices))
    _check_probe(run.spec, algorithm, place)
    server_tx = config.server.transformation()
    steps = (_synchronous(run, place, mesh, server_tx) if settings is None
             else _asynchronous(run, settings, place, mesh, server_tx))
    caps = steps["caps"]
    state_shape = jax.eval_shape(lambda: rounds.init_state(
        model, algorithm, replicas, run.seeds, server_tx, data.train.num_clients))
    device_bytes = compute_footprint(data, model, replicas, place, caps, m, state_shape)
    check_memory(device_bytes, devices)
    store = ClientStore(data, model, place, caps, mesh)
    personal = None if data.holdout is None else PersonalEvaluation(
        data, model, algorithm, replicas, batch_size=config.batch_size, lanes=place.lanes,
        lane_mode=place.lane_mode, branchless=place.branchless,
        optimizer=config.client.transformation, finetune_steps=config.finetune_steps,
        finetune_lr=config.finetune_lr, put=store.put, mesh=mesh)
    return Experiment(
        config=config, data=data, model=model, model_options=run.model_options, spec=run.spec,
        algorithm=algorithm, replicas=replicas, work=run.work, placement=place,
        footprint=device_bytes, num_sampled=m, store=store, personal=personal,
        served_fn=(jax.jit(jax.vmap(algorithm.eval_params))
                   if algorithm.eval_params is not None else None), mesh=mesh,
        server_tx=server_tx, accounting=run.accounting, eval_clients=eval_clients(config, data),
        sampler=run.sampler, replica_seeds=run.replica_seeds, **steps)


def _model_bytes(model) -> int:
    return placement_lib.tree_nbytes(jax.eval_shape(model.init, jax.random.key(0)))


def _synchronous(run, place: Placement, mesh, server_tx) -> Dict[str, Any]:
    """The synchronous rounds' parts of the :class:`Experiment`: the plan's capacities, the
    jitted round, the virtual clock (with ``--client_speed``), the participation record and
    the error by availability quintile."""
    config, data, m = run.config, run.data, run.num_sampled
    caps = plan_lib.capacities(capacity_sizes(data.train, m), m, run.work, place.eval_chunk,
                               with_replacement=run.algorithm.sampling is not None)
    clock = None if run.speeds is None else VirtualClock(
        config.timing, run.speeds, run.seeds, data.train.sizes, m, run.work,
        _model_bytes(run.model), availability=run.availability)
    if clock is not None:
        clock.check()
    round_fn = _round_fn(run.model, run.algorithm, run.replicas, config, place, m, mesh,
                         server_tx, run.expected,
                         run.accounting.correlated if run.accounting is not None else None,
                         variable=run.variable, augment=_augment(config, data))
    return dict(caps=caps, round_fn=round_fn, clock=clock,
                participation=Participation(run.seeds, data.train.num_clients,
                                            run.availability),
                availability_split=_availability_split(config, data, run.availability))


def _asynchronous(run, settings, place: Placement, mesh, server_tx) -> Dict[str, Any]:
    """An asynchronous run's parts of the :class:`Experiment` (:mod:`deltafl_jax.run.buffered`):
    the server step as its round, its clock and the plan's capacities (K slots). The
    schedulers ask the availability model who is online at each version, so no
    participation record of rounds is kept; with an availability model, the error by
    availability quintile of the test devices and the clock's per-client counts summed by
    availability quintile of the training clients."""
    config, data = run.config, run.data
    settings.check(data.train.num_clients)
    buffered = AsyncRound(
        run.model, run.replicas, _local_config(config, place, None, _augment(config, data)),
        seeds=run.seeds, settings=settings, data=data, work=run.work,
        speeds=async_speeds(config.timing, data.train.num_clients, config.data.data_seed),
        model_bytes=_model_bytes(run.model), server_tx=server_tx,
        aggregate=run.spec.asynchronous.aggregate(run.spec.options_for(config)),
        availability=run.availability, mesh=mesh, eval_chunk=place.eval_chunk,
        packed=place.client_data == "host",
        mean_online_seconds=config.timing.mean_online_seconds)
    split = _availability_split(config, data, run.availability)
    if split is not None:
        counts = CLIENT_COUNTS + ((LOST_COUNTS,) if buffered.clock.goes_offline else ())
        split = dataclasses.replace(split, participation=(), train_counts=counts)
    return dict(caps=buffered.run.caps, round_fn=buffered.round_fn, clock=buffered.clock,
                buffered=buffered, availability_split=split)
