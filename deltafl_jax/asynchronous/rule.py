"""A buffered asynchronous rule: the part of FedBuff, FedAsync and their kin that differs.

Every buffered method trains the buffer's K jobs, each from its base version w_{tau_k}, and
turns their updates Delta_k = w_k - w_{tau_k} into one server step. A method is then a
:class:`BufferedRule`:

- ``staleness``: s(tau), the host's weight of an update tau versions old (float64 on the
  host, float32 on the device): FedBuff's polynomial 1/sqrt(1 + tau) by default
  (:func:`polynomial`);
- ``weights``: the job weights a_k of the step (0: the job does not train), from the
  :class:`StepContext` before training; None: a_k = s(tau_k);
- ``uses_losses``: the step evaluates F_k(w_{tau_k}), each buffered client's mean loss at its
  base version (plus (l2/2) ||w_{tau_k}||^2), into ``StepContext.losses`` before ``weights``;
- ``aggregate``: Delta from the :class:`StepContext` after training (``delta_sum`` = sum_k
  a_k Delta_k over the finite updates, ``weight_sum``), applied through the server optimizer
  from the current version;
- ``client_update``: the worker's local objective, an
  :class:`~deltafl_jax.engine.client.ClientUpdate` (FedAsync's proximal term); None: the
  run's local SGD;
- ``refill_before_step``: the job that the completion filling the buffer frees starts before
  the server step, from the old version (FedScale), rather than after it;
- ``draw_busy``: a new job's client is drawn among all online clients, those still training
  included (FedScale), rather than among the idle ones.

A spec's ``asynchronous`` field is an :class:`AsyncStep`: the rule built from the run's
configuration and the spec's typed options, and the K it fixes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import numpy as np

from deltafl_jax.asynchronous.scheduler import AsyncSettings


def polynomial(tau) -> np.ndarray:
    """s(tau) = 1 / sqrt(1 + tau): FedBuff's polynomial staleness scaling (float64), which
    FedScale uses too (since its commit 549e426); FLSim's is sqrt(2) times this."""
    return 1.0 / np.sqrt(1.0 + np.asarray(tau, np.float64))


class StepContext(NamedTuple):
    """What a rule's hooks read of one server step, per replica (R) and buffered job (K).

    state: the :class:`~deltafl_jax.asynchronous.step.BufferedState` before the step.
    slots: [R, K] int32 the ring slot of each job's base version; staleness: [R, K] int32
    tau_k; stale_weights: [R, K] float32 s(tau_k), 0 for an empty slot; sizes: [R, K] the
    jobs' examples; hyper: the replicas' hyper-parameters (leaves [R]); losses: [R, K]
    F_k(w_{tau_k})
    when the rule ``uses_losses``, else None. After training: job_weights [R, K] the a_k
    used, delta_sum (leaves [R, ...]) sum_k a_k Delta_k over the trained jobs with a finite
    update, weight_sum [R] sum_k a_k over the same jobs, kept [R, K] bool those jobs.
    """

    state: Any
    slots: jax.Array
    staleness: jax.Array
    stale_weights: jax.Array
    sizes: jax.Array
    hyper: Any
    losses: Optional[jax.Array] = None
    job_weights: Optional[jax.Array] = None
    delta_sum: Any = None
    weight_sum: Optional[jax.Array] = None
    kept: Optional[jax.Array] = None


def staleness_weights(ctx: StepContext) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """a_k = s(tau_k), no metrics: FedBuff's, FedAsync's and FedScale's job weights."""
    return ctx.stale_weights, {}


@dataclasses.dataclass(frozen=True)
class BufferedRule:
    """One buffered asynchronous method (module docstring)."""

    aggregate: Callable[[StepContext], Any]
    staleness: Callable[[Any], np.ndarray] = polynomial
    weights: Callable[[StepContext], Tuple[jax.Array, Dict[str, jax.Array]]] = \
        staleness_weights
    uses_losses: bool = False
    client_update: Any = None
    refill_before_step: bool = False
    draw_busy: bool = False


@dataclasses.dataclass(frozen=True)
class AsyncStep:
    """What an asynchronous spec (``AlgorithmSpec.asynchronous``) gives the run.

    make: (the run's configuration, the spec's typed options) -> its :class:`BufferedRule`;
    buffer_size: the K the method fixes (FedAsync: 1), None: ``--buffer_size``.
    """

    make: Callable[[Any, Any], BufferedRule]
    buffer_size: Optional[int] = None

    def settings(self, given: AsyncSettings) -> AsyncSettings:
        """The run's settings: `given` (the ``asynchronous`` group), K fixed where the method
        fixes it."""
        if self.buffer_size is None:
            return given
        return dataclasses.replace(given, buffer_size=self.buffer_size)
