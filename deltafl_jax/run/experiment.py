"""Build an experiment: a resolved run, its compiled program, its plans and its evaluation.

:func:`build_experiment` turns a frozen :class:`deltafl_jax.run.config.ExperimentConfig` into an
:class:`Experiment`, with every check that can fail done before any output is written, in four
parts, each its own module:

- what the run resolves (:mod:`deltafl_jax.run.resolve`: the model, the algorithm, the replica
  grid, the sampler, the DP accounting; a frozen :class:`~deltafl_jax.run.resolve.ResolvedRun`),
- what it runs (:mod:`deltafl_jax.run.program`: the placement, the clients' examples on the
  devices or the host, the plan's capacities, the jitted round, the mesh),
- each round's plan on the host (:mod:`deltafl_jax.run.planning`: the cohorts, the virtual
  clock, the participation record, the host state a checkpoint keeps),
- its evaluation and summaries (:mod:`deltafl_jax.run.evaluation`: all clients or a sample of
  K, the personalised evaluation, the metrics with their confidence intervals, the error by
  availability quintile).

An :class:`Experiment` holds those four parts and joins them: the loop, the runner, the
checkpoints and ``--estimate`` read a run through its methods, callbacks through its
:meth:`Experiment.view`. This module may import the four parts and the callbacks' view; the
parts never import it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Optional

import jax
import numpy as np

from deltafl_jax.data import FederatedDataset
from deltafl_jax.replicas.labels import ReplicaNames, Replicas, replica_names
from deltafl_jax.run.callbacks import RunFacts, RunView
from deltafl_jax.run.config import ExperimentConfig
from deltafl_jax.run.evaluation import Evaluator, build_evaluator
from deltafl_jax.run.planning import RoundPlanner, build_planner, virtual_clock
from deltafl_jax.run.program import Program, compile_program
from deltafl_jax.run.resolve import ResolvedRun, resolve


@dataclasses.dataclass(frozen=True, eq=False)
class Experiment:
    """Everything a run needs, built once: what it resolves (`run`), what it runs
    (`program`), each round's plan (`planner`) and its evaluation (`evaluator`)."""

    run: ResolvedRun
    program: Program
    planner: RoundPlanner
    evaluator: Evaluator

    # What the run resolves, read through `run`.
    config = property(lambda self: self.run.config)
    data = property(lambda self: self.run.data)
    model = property(lambda self: self.run.model)
    model_options = property(lambda self: self.run.model_options)
    spec = property(lambda self: self.run.spec)
    algorithm = property(lambda self: self.run.algorithm)
    replicas = property(lambda self: self.run.replicas)
    accounting = property(lambda self: self.run.accounting)
    seeds = property(lambda self: self.run.seeds, doc=(
        "The seed of each plan group: the run's seeds, or each replica's own when the "
        "algorithm samples from its state (one plan per replica)."))
    # What it runs, read through `program`.
    placement = property(lambda self: self.program.placement)
    round_fn = property(lambda self: self.program.round_fn)
    buffered = property(lambda self: self.program.buffered)
    num_sampled = property(lambda self: self.program.slots, doc=(
        "m: the plan's slots per round (AFL: every training client; Poisson: the cap; an "
        "asynchronous run: K)."))
    lanes = property(lambda self: self.program.placement.lanes)
    eval_chunk = property(lambda self: self.program.placement.eval_chunk)
    # Each round's host state, read through `planner`.
    clock = property(lambda self: self.planner.clock)
    participation = property(lambda self: self.planner.participation)

    @property
    def backend(self) -> str:
        return jax.default_backend()

    def initial_state(self):
        """The server state before round 1, on the devices."""
        return self.program.initial_state(self.run)

    def keys(self):
        return self.program.keys(self.run)

    def served_params(self, state):
        """The models that are evaluated and saved, [R, ...]: w_t, or what the algorithm
        serves instead (AFL: the averaged iterate)."""
        return self.program.served_params(state)

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
    def names(self) -> ReplicaNames:
        """The replicas' keys, method columns and labels as written
        (:class:`~deltafl_jax.replicas.labels.ReplicaNames`): what the loop and callbacks read."""
        return replica_names(self.replicas.labels, self.spec.display_name, self.spec.reporting.names_value)

    @functools.cached_property
    def _personal_fn(self):
        per_client = jax.vmap(self.algorithm.client_model, in_axes=(None, 0, None, None))
        return jax.jit(jax.vmap(per_client))

    # Each round's plan (deltafl_jax.run.planning).

    def round_plan(self, round_idx: int, state=None):
        """:meth:`deltafl_jax.run.planning.RoundPlanner.round_plan` on this program."""
        return self.planner.round_plan(self.program, round_idx, state)

    def round_data(self, round_idx: int, state=None):
        """:meth:`deltafl_jax.run.planning.RoundPlanner.round_data` on this program."""
        return self.planner.round_data(self.program, round_idx, state)

    def cohorts(self, round_idx: int, state=None, online=None) -> list:
        """Each plan group's cohort of the round (the clients the virtual clock keeps)."""
        return self.planner.kept_cohorts(round_idx, state, online)[0]

    def kept_cohorts(self, round_idx: int, state=None, online=None):
        return self.planner.kept_cohorts(round_idx, state, online)

    def count_round(self, round_idx: int) -> Dict[str, np.ndarray]:
        return self.planner.count_round(round_idx)

    def virtual_time(self) -> Optional[np.ndarray]:
        return self.planner.virtual_time()

    def host_state(self) -> Dict[str, object]:
        return self.planner.host_state()

    def restore_host(self, host: Dict[str, object]) -> None:
        self.planner.restore_host(host)

    def participation_arrays(self, clients=None) -> Dict[str, np.ndarray]:
        return self.planner.participation_arrays(clients)

    # The evaluation (deltafl_jax.run.evaluation).

    def evaluation_sample(self, round_idx: int):
        """The clients evaluated after round `round_idx` (an ``EvalSample``), or None when
        every client is."""
        return self.evaluator.sample(round_idx)

    def evaluate(self, params, round_idx: int = 0) -> Dict[str, np.ndarray]:
        """The per-client arrays of :meth:`deltafl_jax.run.evaluation.Evaluator.evaluate`
        after round `round_idx`, with the participation so far of the clients evaluated."""
        sample = self.evaluator.sample(round_idx)
        out = self.evaluator.evaluate(params, sample)
        out.update(self.participation_arrays(None if sample is None else sample.train))
        return out

    def evaluate_personal(self, state, round_idx: int) -> Dict[str, np.ndarray]:
        """:meth:`deltafl_jax.run.evaluation.Evaluator.evaluate_personal` of `state`."""
        return self.evaluator.evaluate_personal(state, self.served_params(state), round_idx)

    def summarize(self, per_client, method: str = "lower") -> Dict[str, np.ndarray]:
        """:meth:`deltafl_jax.run.evaluation.Evaluator.summarize`."""
        return self.evaluator.summarize(per_client, method)

    def view(self) -> RunView:
        """The narrow view that callbacks get (:class:`deltafl_jax.run.callbacks.RunView`)."""
        data = self.data
        facts = RunFacts(
            dataset=data.name, dataset_stats=data.stats(),
            train_clients=data.train.num_clients, test_clients=data.test.num_clients,
            model=self.model.name, classify=self.model.is_classifier,
            config=self.config, num_sampled=self.num_sampled, lanes=self.lanes,
            eval_chunk=self.eval_chunk, backend=self.backend,
            placement_line=self.program.placement_line(self.run),
            accounting=self.accounting)
        return RunView(labels=tuple(self.replicas.labels), names=self.names, facts=facts,
                       evaluate=self.evaluate,
                       summarize=self.summarize, served_params=self.served_params,
                       personal_params=self.personal_params,
                       initial_state=self.initial_state)


def build_experiment(config: ExperimentConfig, data: FederatedDataset,
                     replicas: Optional[Replicas] = None) -> Experiment:
    """The run of `config` on `data` (loaded by the caller) resolved
    (:func:`deltafl_jax.run.resolve.resolve`), placed on the devices, with its round jitted.
    Raises ConfigError / DataError on bad input.

    `replicas` may be given to train an arbitrary set of per-replica hyper-parameters (the
    tuner's learning-rate / l2 grids); by default they are the spec's sweep x seeds.
    """
    run = resolve(config, data, replicas)
    clock = virtual_clock(run)   # checked before anything is placed on a device
    program = compile_program(run)
    return Experiment(run=run, program=program, planner=build_planner(run, program, clock),
                      evaluator=build_evaluator(run, program))
