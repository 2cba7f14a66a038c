"""The run loop: rounds, periodic evaluation, and hooks.

    result = run_rounds(experiment, state, callbacks)

Each round is the jitted ``round_fn(state, data, key)``; the next round's host-side plan is
built while the device runs the current one. Every ``eval_every`` rounds (and after the last)
every replica is evaluated on all training and all test clients (paper, App. C.2.3) and the
callbacks receive an :class:`~deltafl_jax.run.callbacks.Evaluation`. Progress lines, output
files, TensorBoard and checkpoints are callbacks (:mod:`deltafl_jax.run.callbacks`).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import jax

from deltafl_jax import outputs
from deltafl_jax.engine.mesh import tree_to_host
from deltafl_jax.run.callbacks import Callback, Evaluation, RunContext
from deltafl_jax.run.recorder import Recorder, RunResult


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
