"""The resolve step: a configuration and its data -> a validated run, before anything is placed
on a device.

:func:`resolve` is the one step between the settings and the program: the model, the
algorithm built by its spec, the clients sampled per round, the replica grid, the client-level
DP accounting (built once, from the grid's noise multipliers) and the client sampler
(:mod:`deltafl_jax.sampling`; Poisson sampling's cap); and
the refusals that need the data or the built algorithm (a configuration's own checks are
:class:`deltafl_jax.ExperimentConfig`'s; a private run's, with or without the built
algorithm, are :func:`deltafl_jax.privacy.dp.check_private_version`). The runner, the tuner (its grids
passed as `replicas`) and ``--estimate`` all reach it through
:func:`deltafl_jax.run.experiment.build_experiment`, which then places the run on the devices
and compiles its round. The data is loaded by the caller, once (the command's entry point, or
:func:`deltafl_jax.run_experiment` / :func:`deltafl_jax.run.estimate.estimate_run` when called
without it).

It owns what the settings mean on the data, and nothing placed on a device: the frozen
:class:`ResolvedRun` that the program (:mod:`deltafl_jax.run.program`), the planner
(:mod:`deltafl_jax.run.planning`) and the evaluation (:mod:`deltafl_jax.run.evaluation`) read
whole. It may import the configuration, the data, the models, the algorithms' registry, the
sampling package, the privacy accounting and, in :mod:`deltafl_jax.run`, the placement's
checks and the personalised evaluation's block sizes; nothing that builds or compiles a
program.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import List, Optional, Tuple

import jax
import numpy as np

from deltafl_jax.algorithms import registry
from deltafl_jax.algorithms.protocol import FederatedAlgorithm
from deltafl_jax.algorithms.spec import AlgorithmSpec
from deltafl_jax.data import FederatedDataset
from deltafl_jax.errors import ConfigError
from deltafl_jax.evaluation.holdout import hold_out
from deltafl_jax.models import Model, ModelOptions, build_model
from deltafl_jax.privacy.dp import (OVERFLOW_PLAIN, OVERFLOW_SHARE, UPDATE_RELEASE,
                                    UPDATE_RELEASE_ADD_REMOVE, Accounting, Correlated,
                                    bandmf_coefficients, check_private_version)
from deltafl_jax.replicas.labels import Replicas, grid_for
from deltafl_jax.run import personal as personal_lib
from deltafl_jax.run.config import ExperimentConfig
from deltafl_jax.run.placement import check_streams, tree_nbytes
from deltafl_jax.sampling import plan as plan_lib
from deltafl_jax.sampling import PoissonSampler, Sampler, WeightedSampler
from deltafl_jax.sampling.availability import Availability, build_availability
from deltafl_jax.sampling.inclusion import (KeepOrder, arrivals, expected_kept_probability,
                                            keep_order, mean_kept_probability)
from deltafl_jax.sampling.speeds import DeviceSpeeds, build_speeds


@dataclasses.dataclass(frozen=True, eq=False)
class ResolvedRun:
    """A validated run: what the settings mean on this data.

    data: the dataset, each client's held-out part split off (``--client_holdout``).
    num_sampled: the plan's slots per round (m; every training client for an algorithm that
    trains them all; the cap under Poisson sampling): the sampler's slots. expected: m under
    Poisson sampling (None otherwise). replicas: the grid (the spec's sweep x its crossed and
    platform values x seeds, or the caller's). replica_seeds: each replica's seed index when the algorithm
    samples from its own state (one plan per replica), else None. seeds: the seed of each
    plan group. accounting: client-level DP's ledger (None: not private). sampler: the run's
    client sampler (:class:`deltafl_jax.sampling.Sampler`; an algorithm that samples from its
    state: a :class:`~deltafl_jax.sampling.WeightedSampler` given its weights each round).
    variable: a cohort may leave slots empty (the round gives them weight 0). availability:
    who is online in each round (:mod:`deltafl_jax.sampling.availability`), None when every
    client always is (``--availability=always``: no online sets drawn). speeds: the clients'
    device speeds of the virtual clock (``--client_speed``; None: no clock).
    """

    config: ExperimentConfig
    data: FederatedDataset
    model: Model
    model_options: ModelOptions
    spec: AlgorithmSpec
    algorithm: FederatedAlgorithm
    num_sampled: int
    expected: Optional[int]
    replicas: Replicas
    replica_seeds: Optional[np.ndarray]
    seeds: Tuple[int, ...]
    work: plan_lib.LocalWork
    accounting: Optional[Accounting]
    sampler: Sampler
    variable: bool
    availability: Optional[Availability] = None
    speeds: Optional[DeviceSpeeds] = None

    @property
    def poisson(self) -> Optional[PoissonSampler]:
        """The Poisson sampler (q, cap) under --client_sampling=poisson, else None."""
        return self.sampler if isinstance(self.sampler, PoissonSampler) else None


def resolve(config: ExperimentConfig, data: FederatedDataset,
            replicas: Optional[Replicas] = None) -> ResolvedRun:
    """The validated run of `config` on `data` (loaded by the caller). `replicas` replaces the
    spec's grid (the tuner's). ConfigError, naming the flag, for what the settings cannot
    mean on this data or with this algorithm."""
    if config.personal.client_holdout:   # each client's held-out part set aside
        data = hold_out(data, config.personal.client_holdout, config.data.data_seed)
    model, options = _model(config, data)
    spec = registry.get(config.algorithm)
    m = _sampled(config, spec, data)
    availability = _availability(config, spec, data)
    training = config.training
    forced = spec.clients.local_steps
    local_steps = forced if forced is not None else training.local_steps
    work = plan_lib.LocalWork(batch_size=training.batch_size, local_epochs=training.local_epochs,
                              local_steps=local_steps)
    algorithm = spec.make(config, data, participation_probabilities(
        config, availability, data.train.num_clients, m,
        _keep_order(config, data, model, work, m)) if spec.clients.takes_probabilities else None)
    check_private_version(config.privacy, config.sampling.sampler, spec, algorithm,
                          tuned=replicas is not None)
    noise = _noise(config, spec, algorithm, m, data.train.num_clients)
    replicas = replicas or grid_for(
        spec, config, noise.per_value if noise is not None else (0.0,)).build()
    replicas, replica_seeds, seeds = _plan_groups(config, algorithm, replicas)
    accounting = None if noise is None else noise.accounting(
        tuple(float(z) for z in replicas.dp_noise))   # each replica's own z, in replica order
    sampler = _sampler(config, spec, algorithm, m, data.train.num_clients, accounting)
    if accounting is not None and isinstance(sampler, PoissonSampler):
        accounting = dataclasses.replace(accounting, cap=sampler.cap)
    check_streams(_streams(config, data, work, sampler.slots,
                           len(set(int(g) for g in replicas.group)),
                           algorithm.sampling is not None))
    warning = config.privacy.delta_warning(data.train.num_clients) if noise else None
    if warning:   # a valid private run whose default delta is large
        print(warning, file=sys.stderr, flush=True)
    return ResolvedRun(config=config, data=data, model=model, model_options=options, spec=spec,
                       algorithm=algorithm, num_sampled=sampler.slots,
                       expected=m if sampler.variable else None, replicas=replicas,
                       replica_seeds=replica_seeds, seeds=seeds, work=work,
                       accounting=accounting, sampler=sampler,
                       variable=(sampler.variable or availability is not None
                                 or _drops(config)),
                       availability=availability, speeds=_speeds(config, data, m))


def _keep_order(config: ExperimentConfig, data: FederatedDataset, model: Model,
                work: plan_lib.LocalWork, m: int) -> Optional[KeepOrder]:
    """Under ``--over_select``, the training clients' order of arrival on the virtual clock
    (:func:`deltafl_jax.sampling.inclusion.keep_order`), as the run's clock builds it; else
    None (every selected client that can arrive is kept)."""
    settings = config.timing
    if not settings.active or settings.slots(m) <= m:
        return None
    speeds = _speeds(config, data, m)
    sizes = np.asarray(data.train.sizes, np.int64)
    model_bytes = tree_nbytes(jax.eval_shape(model.init, jax.random.key(0)))
    return keep_order(arrivals(speeds, sizes, work.steps_for(np.maximum(sizes, 1)),
                               work.batch_size, model_bytes,
                               deadline=settings.round_deadline,
                               partial_work=settings.partial_work,
                               full_batches=work.local_steps is not None))


def _drops(config: ExperimentConfig) -> bool:
    """The virtual clock may aggregate fewer than m clients (a deadline, or clients going
    offline during their jobs)."""
    t = config.timing
    return t.active and (t.round_deadline is not None or t.mean_online_seconds is not None)


def _speeds(config: ExperimentConfig, data: FederatedDataset, m: int) -> Optional[DeviceSpeeds]:
    """The training clients' device speeds (None without ``--client_speed``); ConfigError
    when over-selection asks for more clients than there are."""
    settings = config.timing
    if not settings.active:
        return None
    slots = settings.slots(m)
    if slots > data.train.num_clients:
        raise ConfigError(f"--over_select={settings.over_select:g}: ceil(r m) = {slots} exceeds "
                          f"the {data.train.num_clients} training clients of {data.name}")
    return build_speeds(settings, num_clients=data.train.num_clients,
                        data_seed=config.data.data_seed)


@dataclasses.dataclass(frozen=True)
class _Noise:
    """A private run's noise before its grid: the releases of a round, the noise multiplier of
    each DP value (calibrated to each --dp_target_epsilon), and what the ledger needs."""

    population: int
    m: int
    releases: Tuple[float, ...]
    delta: float
    per_value: Tuple[float, ...]
    sampler: str
    accountant: str
    rounds: int
    correlated: Optional[Correlated] = None

    def accounting(self, noise: Tuple[float, ...]) -> Accounting:
        """The ledger of the replicas whose noise multipliers are `noise`."""
        return Accounting(population=self.population, m=self.m, releases=self.releases,
                          delta=self.delta, noise=noise, sampler=self.sampler,
                          accountant=self.accountant, rounds=self.rounds,
                          correlated=self.correlated)


def _noise(config: ExperimentConfig, spec: AlgorithmSpec, algorithm: FederatedAlgorithm,
           m: int, num_clients: int) -> Optional[_Noise]:
    """The noise of a private run (None otherwise): its releases and each DP value's z.
    Cyclic participation accounts the run as one Gaussian mechanism over BandMF's
    factorisation (--dp_mechanism=gaussian: one band)."""
    del spec
    privacy = config.privacy
    if not privacy.enabled:
        return None
    T = config.training.num_rounds
    correlated = None
    sampler = config.sampling.sampler
    if sampler == "cyclic":
        groups = num_clients // m
        bands = 1 if privacy.mechanism == "gaussian" else (privacy.bands or min(groups, T))
        correlated = Correlated(coef=bandmf_coefficients(T, bands), min_sep=groups, rounds=T)
        releases = (UPDATE_RELEASE_ADD_REMOVE,)
    else:
        count = ((privacy.clip_count_noise,) if privacy.adaptive else ())
        private = algorithm.private
        if sampler == "poisson":
            releases = (UPDATE_RELEASE_ADD_REMOVE,) + tuple(private.add_remove_releases) + count
        else:
            releases = (UPDATE_RELEASE,) + tuple(private.releases) + count
    per_value = privacy.noise_multipliers_for(m, T, num_clients, releases, correlated,
                                              sampler=sampler)
    return _Noise(population=num_clients, m=m, releases=releases,
                  delta=privacy.delta_for(num_clients), per_value=per_value,
                  sampler=sampler, accountant=privacy.accountant_for(sampler), rounds=T,
                  correlated=correlated)


def _streams(config: ExperimentConfig, data: FederatedDataset, work: plan_lib.LocalWork,
             m: int, groups: int, with_replacement: bool) -> List[Tuple[str, int, int]]:
    """(the flags that size it, entries, host bytes) of each index stream the run allocates: a
    round's training and evaluation streams (one per plan group, :func:`deltafl_jax.sampling.plan.
    capacities`; a generator's clients at its size cap) and the personalised evaluation's
    adaptation stream of one block (:func:`deltafl_jax.run.personal.block_caps`)."""
    cap = getattr(data.train, "max_size", None)
    sizes = data.train.sizes if cap is None else np.full((m,), cap, np.int64)
    caps = plan_lib.capacities(sizes, m, work, config.placement.eval_chunk or 1, with_replacement)
    local = (f"--local_epochs={config.training.local_epochs}" if work.local_steps is None
             else f"--local_steps={work.local_steps}")
    out = [(f"{local} with --batch_size={config.training.batch_size}", caps.train_len,
            4 * groups * caps.train_len),
           (f"--eval_chunk={config.placement.eval_chunk}", caps.eval_len,
            8 * groups * caps.eval_len)]
    steps = max(config.personal.finetune_steps)
    if data.holdout is not None and steps > 0:
        block = personal_lib.block_caps(
            [tuple(s.sizes for s in data.holdout.population(data, p))
             for p in personal_lib.POPULATIONS], steps, config.training.batch_size)
        out.append((f"--finetune_steps={steps} with --batch_size={config.training.batch_size}",
                    block.adapt, 4 * block.adapt))
    return out


def _model(config: ExperimentConfig, data: FederatedDataset) -> Tuple[Model, ModelOptions]:
    place = config.placement
    options = ModelOptions(conv_impl=place.conv_impl, conv_backend=place.placement_backend,
                           use_bias=config.training.use_bias,
                           llm=config.llm if config.training.model == "llama" else None,
                           compute_dtype=config.precision.compute_dtype,
                           rnn_impl=place.rnn_impl)
    try:
        return build_model(config.training.model, data, options), options
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _sampled(config: ExperimentConfig, spec: AlgorithmSpec, data: FederatedDataset) -> int:
    m = config.training.clients_per_round
    if config.sampling.sampler == "cyclic" and spec.clients.full_participation:
        raise ConfigError(f"--client_sampling=cyclic: --algorithm={spec.name} trains every "
                          f"client every round")
    if spec.asynchronous is not None:   # its scheduler keeps --concurrency jobs in flight
        return min(m, int(data.train.num_clients))   # m is never read: the default 10 is fine
    if m > data.train.num_clients:
        raise ConfigError(
            f"--clients_per_round={m} exceeds the {data.train.num_clients} training clients of "
            f"{data.name}")
    return int(data.train.num_clients) if spec.clients.full_participation else m


def _sampler(config: ExperimentConfig, spec: AlgorithmSpec, algorithm: FederatedAlgorithm,
             m: int, num_clients: int, accounting: Optional[Accounting]) -> Sampler:
    """The run's sampler: the algorithm's own (``sampling``: by its weights, m draws) or
    --client_sampling's (:meth:`deltafl_jax.sampling.Sampling.build`) of m of the N training
    clients (m = N for an algorithm that trains them all). A Poisson cap's overflow budget: a
    private run's overflow term (1 + e^eps) P at most delta / OVERFLOW_SHARE at its largest
    finite epsilon; a non-private run's P at most OVERFLOW_PLAIN. ConfigError for a sampler
    whose cohorts vary in size with an algorithm whose round needs a fixed cohort."""
    settings = config.sampling
    if settings.variable and spec.clients.fixed_cohort:
        raise ConfigError(f"--client_sampling={settings.sampler}: --algorithm={spec.name} "
                          f"needs a fixed cohort of m clients a round (it supports "
                          f"--client_sampling=fixed)")
    if algorithm.sampling is not None:
        return WeightedSampler(num_clients=num_clients, slots=m)
    budget = OVERFLOW_PLAIN
    if accounting is not None and settings.variable:
        eps = [float(e) for e in accounting.epsilons(config.training.num_rounds)
               if math.isfinite(e)]
        if eps:
            budget = accounting.delta / OVERFLOW_SHARE / (1.0 + math.exp(min(max(eps), 700)))
    return settings.build(num_clients, m, rounds=config.training.num_rounds, overflow_budget=budget)


def _availability(config: ExperimentConfig, spec: AlgorithmSpec,
                  data: FederatedDataset) -> Optional[Availability]:
    """The run's availability model, built once from the training split (None for
    ``always``). ConfigError for an algorithm whose round needs a full cohort of m clients
    (fewer may be online) or that trains every client every round."""
    settings = config.online
    if settings.chosen.everyone:
        return None
    if spec.asynchronous is None and spec.clients.fixed_cohort:
        # (an asynchronous run's scheduler starts online clients only)
        raise ConfigError(f"--availability={settings.model}: --algorithm={spec.name} needs a "
                          f"fixed cohort of m clients a round (it runs with "
                          f"--availability=always)")
    return _built(config, data.train, data.num_classes)


def _built(config: ExperimentConfig, split, num_classes: int) -> Availability:
    """``--availability``'s model over the clients of `split` (their sizes, and their label
    counts when the model reads them)."""
    settings = config.online
    return build_availability(settings, num_clients=split.num_clients, sizes=split.sizes,
                              label_counts=label_counts(split, num_classes)
                              if settings.chosen.needs_labels(settings) else None,
                              num_rounds=config.training.num_rounds)


def test_availability(config: ExperimentConfig, data: FederatedDataset) -> Optional[Availability]:
    """The same availability model over the test devices, so that their errors can be split by
    availability as the training clients' are: the generated models' law (the same settings
    and ``--availability_seed``) and a trace's devices assigned alike; None for a model that
    does not cover them (``covers_test``: ``always``, and a schedule, which names the training
    clients only)."""
    if not config.online.chosen.covers_test:
        return None
    return _built(config, data.test, data.num_classes)


def participation_probabilities(config: ExperimentConfig, availability: Optional[Availability],
                                num_clients: int, m: int,
                                order: Optional[KeepOrder] = None) -> np.ndarray:
    """[N] each training client's probability p_i of taking part in a round (being online and
    chosen), under the run's availability (r_i its rate, ``rates()``) and sampler, or with
    `order` (``--over_select``: the clients' order of arrival on the virtual clock) of being
    kept (:func:`_kept_probabilities`); without over-selection:

    - every client online: m / N (1 when m >= N);
    - Poisson: r_i q, q = m / N (exact: each online client joins with probability q);
    - cyclic: r_i m / N (its group's turn comes every N // m rounds; approximate);
    - fixed, a replay (schedule, trace: the same online sets O_t for every seed): the expected
      fraction of the run's T rounds in which client i trains, (1/T) sum_t 1[i in O_t]
      min(1, m / |O_t|) (exact);
    - fixed, a generated model: r_i min(1, m / sum_j r_j), the online count replaced by its
      mean (approximate; exact when the mean is at most m and at most m are ever online).

    A client with p_i = 0 never takes part, so its 1 / p_i is never used: it gets 1."""
    if order is not None:
        p = _kept_probabilities(config, availability, order, m)
        return np.where(p > 0, p, 1.0)
    q = min(1.0, m / num_clients)
    if availability is None:
        return np.full((num_clients,), q, np.float64)
    sampler = config.sampling.sampler
    if sampler != "fixed":
        p = availability.rates() * q
    elif availability.replays:
        p = np.zeros((num_clients,), np.float64)
        for t in range(config.training.num_rounds):
            ids = availability.online(0, t)
            p[ids] += min(1.0, m / max(ids.size, 1))
        p /= config.training.num_rounds
    else:
        rates = availability.rates()
        p = rates * min(1.0, m / max(float(rates.sum()), 1e-300))
    return np.where(p > 0, p, 1.0)


def _kept_probabilities(config: ExperimentConfig, availability: Optional[Availability],
                        order: KeepOrder, m: int) -> np.ndarray:
    """[N] each client's probability of being kept in a round of M = ceil(r m) drawn
    uniformly among the online and the m first to arrive
    (:mod:`deltafl_jax.sampling.inclusion`): exact with every client online and for a replay
    (schedule, trace: the mean over the run's rounds of each round's, its online set the
    same for every seed); for a generated model, the approximation of
    :func:`~deltafl_jax.sampling.inclusion.expected_kept_probability`. 0 for a client that
    can never arrive by the deadline."""
    M = config.timing.slots(m)
    if availability is None:
        return mean_kept_probability(order, M, m)
    if availability.replays:
        return mean_kept_probability(order, M, m, (availability.online(0, t)
                                                   for t in range(config.training.num_rounds)))
    return expected_kept_probability(order, availability.rates(), M, m)


def label_counts(split, num_classes: int) -> Optional[np.ndarray]:
    """[N, C] int64: each client's examples per label (None: a split without labels)."""
    if num_classes <= 0 or not split.has_labels:
        return None
    counts = np.zeros((split.num_clients, num_classes), np.int64)
    y = getattr(split, "y", None)
    if y is not None:
        rows = np.repeat(np.arange(split.num_clients), split.sizes)
        np.add.at(counts, (rows, np.asarray(y, np.int64)), 1)
        return counts
    for k in range(split.num_clients):   # a generated split: its clients one by one
        counts[k] = np.bincount(np.asarray(split.gather([k])[1], np.int64),
                                minlength=num_classes)[:num_classes]
    return counts


def _plan_groups(config: ExperimentConfig, algorithm: FederatedAlgorithm, replicas: Replicas):
    """(replicas, their seed indices or None, the seed of each plan group): one plan per seed,
    or one per replica for an algorithm that samples from its own state (``sampling``)."""
    if algorithm.sampling is None:
        return replicas, None, tuple(config.training.seeds)
    replica_seeds = np.asarray(replicas.group)
    seeds = tuple(config.training.seeds[int(g)] for g in replica_seeds)
    return (dataclasses.replace(replicas, group=np.arange(replicas.size, dtype=np.int32)),
            replica_seeds, seeds)
