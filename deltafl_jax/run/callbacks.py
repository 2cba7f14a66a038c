"""The hooks of the run loop (:func:`deltafl_jax.run.loop.run_rounds`).

The loop itself only runs rounds and, every ``eval_every`` rounds, evaluates every replica on
all training and all test clients (paper, App. C.2.3). Everything else plugs in as a
:class:`Callback`: progress lines, ``metrics.jsonl`` and the other output files, TensorBoard,
checkpoints, multi-host writing. Callbacks see host (NumPy) values and the latest device state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from deltafl_jax.replicas.labels import ReplicaNames


@dataclasses.dataclass
class Evaluation:
    """One evaluation of every replica, after `round` rounds.

    round: rounds completed (1-based).
    per_client: "train_loss", "train_error", "test_loss", "test_error" -> [R, N] float64.
    summary: metric name -> [R] (train_loss_mean, train_loss_p90, test_error_p90, ...).
    records: one JSON-able dict per replica, as written to metrics.jsonl.
    elapsed_s: seconds since the first round started.
    """

    round: int
    per_client: Dict[str, np.ndarray]
    summary: Dict[str, np.ndarray]
    records: List[Dict[str, Any]]
    elapsed_s: float


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What a run is, in the terms its progress lines and summary.json state: the dataset
    (name, Table 1 statistics, client counts), the model (name; classify: its errors are
    misclassification rates, not losses), the settings, m, the lanes and evaluation chunk, the
    backend, the start-up placement line, and the privacy ledger of a private run."""

    dataset: str
    dataset_stats: Dict[str, Any]
    train_clients: int
    test_clients: int
    model: str
    classify: bool
    config: Any
    num_sampled: int
    lanes: int
    eval_chunk: int
    backend: str
    placement_line: str
    accounting: Any = None


@dataclasses.dataclass(frozen=True)
class RunView:
    """What callbacks see of the experiment: the replicas' names, the run's facts, and the
    functions that serve, evaluate and summarise a state's models (and build w_0).

    names: the replicas' keys, method columns and labels as written
    (:class:`~deltafl_jax.replicas.labels.ReplicaNames`): what the standard callbacks read.
    labels: the replicas' :class:`~deltafl_jax.replicas.labels.ReplicaLabel` s, hyper-parameter
    values included, for a callback that needs those.
    evaluate(params, round) -> per-client arrays (:class:`Evaluation`); summarize(per_client)
    -> metric name -> [R]; served_params(state) -> the models evaluated and saved [R, ...];
    initial_state() -> the round state at w_0; personal_params(state) -> every training
    client's personal model [R, N, ...], or None (an algorithm without per-client models).
    """

    labels: Sequence[Any]
    names: ReplicaNames
    facts: RunFacts
    evaluate: Callable[..., Dict[str, np.ndarray]]
    summarize: Callable[[Dict[str, np.ndarray]], Dict[str, np.ndarray]]
    served_params: Callable[[Any], Any]
    initial_state: Callable[[], Any]
    personal_params: Callable[[Any], Any] = lambda state: None


@dataclasses.dataclass
class RunContext:
    """What callbacks may read: a narrow view of the experiment, the rounds, and the latest
    state.

    view: the :class:`RunView` of the experiment.
    num_rounds: T. start_round: rounds already done when this process started (resume).
    state: the latest ServerState (device arrays; do not keep references across rounds,
      the round donates its buffers). A callback may replace it with a ServerState of the
      same structure; the next round starts from that.
    output_dir: where outputs go (None: nothing is written).
    stop_requested: a callback sets it to end the run after the current round.
    end_reason: why a complete run ended before its last round ("" : it did not).
    """

    view: Optional[RunView]
    num_rounds: int
    start_round: int = 0
    state: Any = None
    output_dir: Optional[str] = None
    stop_requested: bool = False
    stop_reason: str = ""
    end_reason: str = ""


class Callback:
    """Base class: every hook is optional."""

    def on_run_start(self, run: RunContext) -> None:
        pass

    def on_round_end(self, run: RunContext, round: int, metrics: Dict[str, np.ndarray]) -> None:
        """After round `round` (1-based); metrics: host arrays [R] or scalars."""

    def on_evaluation(self, run: RunContext, evaluation: Evaluation) -> None:
        pass

    def on_run_end(self, run: RunContext, result: Any) -> None:
        pass
