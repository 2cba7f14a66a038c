"""The run loop: rounds, periodic evaluation, hooks, and the recorder of the run's histories.

    result = run_rounds(experiment, state, callbacks)

Each round is the jitted ``round_fn(state, data, key)``; the next round's host-side plan is
built while the device runs the current one. Every ``eval_every`` rounds (and after the last)
every replica is evaluated on all training and all test clients (paper, App. C.2.3) and the
callbacks receive an :class:`~deltafl_jax.run.callbacks.Evaluation`. Progress lines, output
files, TensorBoard and checkpoints are callbacks (:mod:`deltafl_jax.run.callbacks`).

The recorder (:class:`Recorder`) is the first callback of every run: it keeps the per-round
metrics [rounds, R], the per-client arrays of every evaluation [E, R, N] and the metrics
records, and builds the :class:`RunResult`. A resumed run continues them from the output files
(:meth:`Recorder.resume`, :mod:`deltafl_jax.run.resume`), so that it ends with the same outputs
as an uninterrupted one. Its summary names the parts of a replica's state that went non-finite
(:func:`nonfinite_summary`, from the round's state check: :mod:`deltafl_jax.run.divergence`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Sequence

import jax
import numpy as np

from deltafl_jax.engine.mesh import tree_to_host
from deltafl_jax.outputs import directory as outputs
from deltafl_jax.rounds import CLIENT_PART, NONFINITE, count_nonfinite_clients
from deltafl_jax.run.callbacks import Callback, Evaluation, RunContext


@dataclasses.dataclass
class RunResult:
    """What a run returns.

    final: replica key -> the last evaluation's metrics.
    history: every metrics.jsonl record, in order.
    state: the final ServerState (device arrays).
    summary: the JSON summary (also summary.json when there is an output dir).
    per_round: metric -> [rounds, R] (or [rounds]) host arrays of every round.
    per_client: the last evaluation's per-client arrays [R, N].
    client_history: "rounds" [E] and the per-client arrays of every evaluation [E, R, N].
    served: the final served models [R, ...] as host NumPy arrays (what models/ holds).
    personal: every training client's personal model [R, N, ...] (host), or None.
    rounds_done: rounds completed; stopped: the run ended early (reason in stop_reason).
    """

    final: Dict[str, Dict[str, float]]
    history: List[Dict[str, Any]]
    state: Any
    summary: Dict[str, Any]
    per_round: Dict[str, np.ndarray]
    per_client: Optional[Dict[str, np.ndarray]]
    client_history: Dict[str, np.ndarray]
    served: Any
    rounds_done: int
    stopped: bool = False
    stop_reason: str = ""
    personal: Any = None


def nonfinite_rounds(per_round: Mapping[str, Any]) -> Dict[str, np.ndarray]:
    """{part: [R] the first round (1-based) at which the part of each replica was not finite,
    0 where it never was} from the round metrics (lists or arrays of [R] per round, from
    round 1)."""
    out = {}
    for key, rows in per_round.items():
        if not key.startswith(NONFINITE) or not len(rows):
            continue
        bad = np.stack([np.asarray(v) for v in rows]) > 0          # [T, R]
        out[key[len(NONFINITE):]] = np.where(bad.any(0), bad.argmax(0) + 1, 0)
    return out


def nonfinite_summary(per_round: Mapping[str, Any], keys: Sequence[str],
                      clients: Optional[Mapping[str, np.ndarray]] = None) -> Dict[str, Any]:
    """summary.json's ``nonfinite``: {replica key: {part: {"round": the first round it was
    not finite[, "clients": the training clients whose own state is not finite at the end]}}}
    for the replicas and parts that went non-finite; {} when every state stayed finite.
    `clients`: {client part: [R] counts} (:func:`deltafl_jax.rounds.count_nonfinite_clients`)."""
    out: Dict[str, Any] = {}
    for part, first in nonfinite_rounds(per_round).items():
        for r in np.flatnonzero(first):
            entry = {"round": int(first[r])}
            if clients is not None and part in clients:
                entry["clients"] = int(np.asarray(clients[part])[r])
            out.setdefault(keys[r], {})[part] = entry
    return out


DEVICE_METRICS = "device_"   # per-device round metrics (bench/scaling.py reads them)


class Recorder(Callback):
    """Accumulates a run's histories (host NumPy) and builds its result."""

    def __init__(self):
        self.per_round: Dict[str, List[np.ndarray]] = {}
        self.client_history: Dict[str, List[np.ndarray]] = {"rounds": []}
        self.history: List[Dict[str, Any]] = []
        self.last: Optional[Evaluation] = None
        self.rounds_done = 0
        self.first_round_s: Optional[float] = None
        self.build_s = 0.0
        self._t0 = None

    def on_run_start(self, run: RunContext) -> None:
        self._t0 = time.perf_counter()
        self.rounds_done = run.start_round

    def on_round_end(self, run: RunContext, round: int, metrics) -> None:
        if self.first_round_s is None:
            self.first_round_s = time.perf_counter() - self._t0
        done = max((len(v) for v in self.per_round.values()), default=0)
        for k, v in metrics.items():
            if k.startswith(DEVICE_METRICS):
                continue   # [D]: a resumed run may have another device count
            v = np.asarray(v)
            if k not in self.per_round and k.startswith(NONFINITE):
                # a run resumed from files written without the state check: its earlier
                # rounds count 0 (each part is checked again from here on)
                self.per_round[k] = [np.zeros_like(v)] * done
            self.per_round.setdefault(k, []).append(v)
        self.rounds_done = round

    def on_evaluation(self, run: RunContext, evaluation: Evaluation) -> None:
        self.last = evaluation
        self.client_history["rounds"].append(evaluation.round)
        for k, v in evaluation.per_client.items():   # a sample's client ids stay integers
            kept = v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v
            self.client_history.setdefault(k, []).append(kept)
        self.history.extend(evaluation.records)

    def per_round_arrays(self) -> Dict[str, np.ndarray]:
        """metric -> [rounds, R]: every round so far (what rounds.npz holds)."""
        return {k: np.stack(v) for k, v in self.per_round.items()}

    def client_history_arrays(self) -> Dict[str, np.ndarray]:
        """"rounds" [E] and the per-client arrays [E, R, N] of every evaluation so far (what
        clients_history.npz holds)."""
        return {k: np.stack(v) if k != "rounds" else np.asarray(v)
                for k, v in self.client_history.items() if len(v) or k == "rounds"}

    def resume(self, found) -> None:
        """Continue the histories of a :class:`deltafl_jax.run.resume.Resume` (read back from
        the output files); the last evaluation is set by :meth:`on_evaluation`, when the
        resumed run has none left to do, by the runner."""
        self.per_round = {k: list(v) for k, v in found.per_round.items()}
        self.client_history = {k: list(v) for k, v in found.client_history.items()}
        self.client_history["rounds"] = [int(t) for t in found.client_history["rounds"]]
        self.history = list(found.records)
        self.rounds_done = int(found.round)

    def result(self, run: RunContext) -> RunResult:
        view = run.view
        last = self.last
        final = {} if last is None else {
            key: {k: float(v[r]) for k, v in last.summary.items()}
            for r, key in enumerate(view.names.keys)}
        total_s = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
        summary = _summary(view, final, total_s, self.first_round_s, self.build_s)
        summary["nonfinite"] = self.nonfinite(run)
        if run.end_reason:   # a complete run that ended before its last round
            summary["ended"] = {"round": self.rounds_done, "reason": run.end_reason}
        return RunResult(
            final=final, history=self.history, state=run.state, summary=summary,
            per_round=self.per_round_arrays(),
            per_client=None if last is None else last.per_client,
            client_history=self.client_history_arrays(),
            served=tree_to_host(view.served_params(run.state)),
            rounds_done=self.rounds_done, stopped=run.stop_requested,
            stop_reason=run.stop_reason, personal=tree_to_host(view.personal_params(run.state)))

    def nonfinite(self, run: RunContext) -> Dict[str, Any]:
        """summary.json's ``nonfinite`` (:func:`nonfinite_summary`):
        with the count of clients whose own state is not finite at the end, from the state,
        when a part of it went non-finite."""
        first = nonfinite_rounds(self.per_round)
        clients = None
        if any(p.partition(".")[0] == CLIENT_PART and f.any() for p, f in first.items()):
            clients = tree_to_host(count_nonfinite_clients(run.state))
        return nonfinite_summary(self.per_round, run.view.names.keys, clients)


def _summary(view, final, total_s, first_round_s, build_s) -> Dict[str, Any]:
    facts = view.facts
    return {
        "config": facts.config.flat(),
        "dataset": {"name": facts.dataset, **facts.dataset_stats},
        "model": facts.model,
        "replicas": list(view.names.records),
        "clients_per_round": facts.num_sampled,
        "clients_per_step": facts.lanes,
        "eval_chunk": facts.eval_chunk,
        "backend": jax.default_backend(),
        "timing": {"total_s": total_s, "first_round_s_incl_compile": first_round_s,
                   "build_s": build_s},
        "final": final,
        **({"privacy": facts.accounting.describe(view.labels)}
           if facts.accounting is not None else {}),
    }


# --------------------------------------------------------------------------------------------
# The loop


def evaluate(exp, state, t: int, metrics, elapsed: float) -> Evaluation:
    per_client = exp.evaluate(exp.served_params(state), t)
    per_client.update(exp.evaluate_personal(state, t))
    summary = exp.summarize(per_client)
    if exp.accounting is not None:   # client-level DP: epsilon of each replica so far
        summary = {**summary, "dp_epsilon": exp.accounting.epsilons(t)}
    clock = exp.virtual_time()
    if clock is not None:   # the virtual clock: seconds at the end of round t
        summary = {**summary, "virtual_time": clock}
    return Evaluation(round=t, per_client=per_client, summary=summary,
                      records=outputs.metrics_records(t, exp.names.records, summary, metrics,
                                                      elapsed),
                      elapsed_s=elapsed)


def ends_at(exp, t: int) -> bool:
    """Round `t` (1-based, counted) is the run's last by the virtual clock: every plan
    group's clock has reached ``--stop_at_virtual_time``."""
    clock = getattr(exp, "clock", None)
    return clock is not None and clock.counted == t and \
        clock.reached(exp.config.timing.stop_at_virtual_time)


def _emit(callbacks: Sequence[Callback], hook: str, *args) -> None:
    for cb in callbacks:
        getattr(cb, hook)(*args)


def run_rounds(exp, state, callbacks: Sequence[Callback] = (), start_round: int = 0,
               output_dir: Optional[str] = None, recorder: Optional[Recorder] = None
               ) -> RunResult:
    """Rounds start_round+1 .. T of `exp` from `state`; returns the :class:`RunResult`.

    The `recorder` (a fresh one by default, or one restored from a checkpoint) keeps the
    histories that make the result; it runs before the other callbacks. A callback may set
    ``run.stop_requested`` to end the run after the current round.
    """
    T = exp.config.training.num_rounds
    recorder = recorder if recorder is not None else Recorder()
    callbacks = [recorder, *callbacks]
    run = RunContext(view=exp.view(), num_rounds=T, start_round=start_round, state=state,
                     output_dir=output_dir)
    _emit(callbacks, "on_run_start", run)
    keys = exp.keys()
    t_start = time.perf_counter()
    pending = exp.round_data(start_round, state) if start_round < T else None
    for t in range(start_round, T):
        state, metrics = exp.round_fn(state, pending, keys)
        if t + 1 < T:
            pending = exp.round_data(t + 1, state)   # host work overlaps the device round
            #         (an algorithm that samples from its state waits for the round here)
        metrics = {**tree_to_host(metrics), **exp.count_round(t)}   # + the host's counts
        run.state = state
        ended = ends_at(exp, t + 1)
        if ended:
            run.end_reason = (f"--stop_at_virtual_time={exp.config.timing.stop_at_virtual_time:g}"
                              f" reached after round {t + 1}")
        _emit(callbacks, "on_round_end", run, t + 1, metrics)
        if (t + 1) % exp.config.evaluation.eval_every == 0 or t + 1 == T or ended:
            ev = evaluate(exp, state, t + 1, metrics, time.perf_counter() - t_start)
            _emit(callbacks, "on_evaluation", run, ev)
        state = run.state   # a callback may replace it (e.g. stop a diverged replica)
        if run.stop_requested or ended:
            break
    jax.block_until_ready(state)
    result = recorder.result(run)
    _emit(callbacks, "on_run_end", run, result)
    return result
