"""A run's evaluation and its summaries.

:class:`Evaluator` gives the per-client losses and errors of every replica's served model on
all training and all test clients (paper, App. C.2.3), or on a sample of K of each
(``--eval_clients``, :mod:`deltafl_jax.evaluation.sample`); the personalised evaluation's
(``--client_holdout``, :mod:`deltafl_jax.run.personal`); and the summary metrics of each
replica that every evaluation's metrics.jsonl records and summary.json's final metrics hold
(:func:`deltafl_jax.evaluation.metrics.summarize`, or on a sampled evaluation the estimates with 95%
confidence intervals), with the error by availability quintile of the clients
(:class:`deltafl_jax.evaluation.by_availability.AvailabilitySplit`).

It owns which clients an evaluation reads and how its per-client arrays are summarised; the
participation counts it records beside them are the planner's
(:mod:`deltafl_jax.run.planning`). It may import the metrics, the sampled evaluation, the
availability split, the engine's norms and, in :mod:`deltafl_jax.run`, the resolve step, the
program, the client store and the personalised evaluation; never the planning or the
experiment.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Optional

import jax
import numpy as np

from deltafl_jax import engine
from deltafl_jax.engine import mesh as mesh_lib
from deltafl_jax.engine.adapt import AdaptConfig
from deltafl_jax.evaluation.by_availability import AvailabilitySplit
from deltafl_jax.evaluation.metrics import perplexity_summaries, summarize
from deltafl_jax.evaluation.sample import EvalSample, EvalSampler, summarize_sample
from deltafl_jax.run import personal as personal_lib
from deltafl_jax.run.buffered import CLIENT_COUNTS, LOST_COUNTS
from deltafl_jax.run.client_store import ClientStore
from deltafl_jax.run.config import PERCENTILES
from deltafl_jax.run.program import Program
from deltafl_jax.run.resolve import ResolvedRun, test_availability

# ||w||^2 of each replica [R], one compiled program per model shape
_replica_sqnorms = jax.jit(jax.vmap(engine.tree_sqnorm))

AUTO_FULL_EVAL = 100_000    # populations up to this many clients are evaluated whole by default
AUTO_EVAL_CLIENTS = 1000    # clients of each split per evaluation beyond it


@dataclasses.dataclass(frozen=True, eq=False)
class Evaluator:
    """The evaluation of `run` on the examples of `store`. eval_clients: K clients of each
    split per evaluation (None: all). personal: the seen / unseen clients' evaluation
    (``--client_holdout``; None: none). availability_split: the error by availability
    quintile (None: no availability model)."""

    run: ResolvedRun
    store: ClientStore
    eval_clients: Optional[int] = None
    personal: Optional[personal_lib.PersonalEvaluation] = None
    availability_split: Optional[AvailabilitySplit] = None

    def sample(self, round_idx: int) -> Optional[EvalSample]:
        """The clients evaluated after round `round_idx`, or None when every client is."""
        if self.eval_clients is None:
            return None
        return self._sampler.draw(self.run.seeds[0], round_idx, self.eval_clients)

    @functools.cached_property
    def _sampler(self) -> EvalSampler:
        data = self.run.data
        return EvalSampler(data.train.sizes, data.test.num_clients)

    def evaluate(self, params, sample: Optional[EvalSample]) -> Dict[str, np.ndarray]:
        """Per-client arrays [R, N] (float64) on all training and all test clients: losses
        (train ones with (l2/2)||w||^2) and errors (NaN where the loss is not finite). On the
        `sample` (:meth:`sample`) instead ([R, K]), whose client indices are added as
        ``train_clients`` and ``test_clients``."""
        out = {}
        sqnorm = mesh_lib.to_host(_replica_sqnorms(params))
        for name, split in (("train", self.run.data.train), ("test", self.run.data.test)):
            clients = None if sample is None else getattr(sample, name)
            loss_sum, err_sum = self.store.stream_sums(params, name, clients)
            n = (split.sizes if clients is None else split.sizes[clients]).astype(np.float64)
            loss = np.asarray(loss_sum, np.float64) / n
            if name == "train":
                # l2 = 0 adds nothing, even where ||w||^2 overflowed float32 to inf
                l2 = self.run.replicas.l2.astype(np.float64)
                with np.errstate(invalid="ignore"):   # 0 x inf, replaced by 0
                    loss = loss + 0.5 * np.where(l2 == 0, 0.0, l2 * sqnorm)[:, None]
            out[f"{name}_loss"] = loss
            # An error counted from a model whose loss is not finite (NaN logits argmax to a
            # class) is no measurement: it is NaN, and so is every summary taken over it.
            err = np.asarray(err_sum, np.float64) / n
            out[f"{name}_error"] = np.where(np.isfinite(loss), err, np.nan)
            if clients is not None:
                out[f"{name}_clients"] = np.asarray(clients, np.int64)
        return out

    def evaluate_personal(self, state, served, round_idx: int) -> Dict[str, np.ndarray]:
        """Per-client arrays of the personalised evaluation of `state` (whose served models
        are `served`): seen clients on their held-out data, unseen devices after adaptation,
        [R, K]; empty without ``--client_holdout``."""
        if self.personal is None:
            return {}
        sample = self.sample(round_idx)
        return self.personal.evaluate(
            state, served, self.run.seeds[0], round_idx,
            test_clients=None if sample is None else sample.test,
            sample_size=None if sample is None else self.eval_clients)

    def summarize(self, per_client, method: str = "lower") -> Dict[str, np.ndarray]:
        """The papers' metrics per replica (alpha-weighted train losses, unweighted test); on
        a sampled evaluation, their estimates with 95% confidence intervals
        (:func:`deltafl_jax.evaluation.sample.summarize_sample`). With a personalised evaluation,
        each population's summaries (:func:`deltafl_jax.run.personal.summarize_populations`),
        and with an availability model the error by availability quintile."""
        data = self.run.data
        classify = self.run.model.loss_kind != "squared"
        target = self.run.config.evaluation.target_accuracy if classify else None
        if "train_clients" in per_client:
            out = summarize_sample(per_client["train_loss"], per_client["test_error"],
                                   per_client["test_loss"], PERCENTILES,
                                   num_test=data.test.num_clients, target_accuracy=target,
                                   error_bounds=(0.0, 1.0 if classify else np.inf))
        else:
            out = summarize(per_client["train_loss"], data.train.sizes,
                            per_client["test_error"], per_client["test_loss"], PERCENTILES,
                            method, target)
        if self.personal is not None:
            out.update(personal_lib.summarize_populations(
                per_client, self.personal.steps, data.train.num_clients,
                data.test.num_clients, method))
        if self.availability_split is not None:
            out.update(self.availability_split.summaries(per_client, method))
        if getattr(self.run.model, "perplexity", False):   # a language model (models.llm)
            out.update(perplexity_summaries(per_client))
        return out


def eval_clients(config, data) -> Optional[int]:
    """K of a sampled evaluation, or None for a full one: ``--eval_clients`` (0: full), by
    default full while the population has at most AUTO_FULL_EVAL clients (train + test) and
    AUTO_EVAL_CLIENTS beyond; full too when K covers both splits."""
    population = data.train.num_clients + data.test.num_clients
    k = config.evaluation.eval_clients
    if k is None:
        k = 0 if population <= AUTO_FULL_EVAL else AUTO_EVAL_CLIENTS
    if k == 0 or k >= max(data.train.num_clients, data.test.num_clients):
        return None
    return int(k)


def availability_split(run: ResolvedRun, program: Program) -> Optional[AvailabilitySplit]:
    """Every evaluation's error split by availability quintile (None without availability):
    the training clients by their model's p_i (the seen clients of ``--client_holdout``, with
    their rounds online and sampled), the test devices by the same model over them. An
    asynchronous run keeps no record of rounds: its split sums the clock's per-client counts
    by availability quintile of the training clients instead."""
    if run.availability is None:
        return None
    test = test_availability(run.config, run.data)
    split = AvailabilitySplit(run.availability.rates(), None if test is None else test.rates(),
                              ("train_rounds_online", "train_rounds_sampled"))
    if program.buffered is None:
        return split
    counts = CLIENT_COUNTS + ((LOST_COUNTS,) if program.buffered.clock.goes_offline else ())
    return dataclasses.replace(split, participation=(), train_counts=counts)


def build_evaluator(run: ResolvedRun, program: Program) -> Evaluator:
    """The evaluation of `run` on `program`'s devices and examples."""
    config, data, place = run.config, run.data, program.placement
    layout = AdaptConfig(batch_size=config.training.batch_size, lanes=place.lanes,
                         lane_mode=place.lane_mode, branchless=place.branchless,
                         optimizer=config.client.transformation)
    personal = None if data.holdout is None else personal_lib.PersonalEvaluation(
        data, run.model, run.algorithm, run.replicas, layout, config.personal,
        put=program.store.put, mesh=program.mesh)
    return Evaluator(run, program.store, eval_clients=eval_clients(config, data),
                     personal=personal, availability_split=availability_split(run, program))
