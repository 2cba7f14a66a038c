"""The client's own problem: what one sampled client does with its local steps.

An algorithm owns its client update (fedjax's ``for_each_client``): three pure functions over a
*step state*, a pytree that the engine's lanes carry from one local step to the next without
looking inside (:class:`ClientUpdate`):

- ``init(server_state, client_state, params, hyper, job) -> step_state`` when a lane starts the
  client's job: from the replica's algorithm state, the client's own state (``()`` for an
  algorithm without one), the round's global model w_t and the replica's hyper-parameters;
- ``step(step_state, grad_fn, hyper, job) -> step_state`` on each local step; ``grad_fn(p)``
  returns (loss, gradient) of the masked mean loss of this step's minibatch at p, and may be
  called on several models (Ditto's personal and global models on one minibatch);
- ``final(step_state, client_state, params, hyper, job) -> (client_state', update, output)``
  when the job ends: the client's new state (written back when the update is finite), its
  update (a pytree like params, w_k - w_t for the averaging methods: what the server's
  aggregate sums with weight a_k, clipped first under client-level DP) and an output that
  reaches the server update as ``feedback.client_outputs`` (None: nothing).

:class:`ClientJob` tells the functions about the job: the client optimizer at the replica's
learning rate of this round (an optax transformation; its state starts afresh at each job),
that learning rate and l2, and the job's local steps K_k.

:data:`LOCAL_SGD` is the default: K_k steps of the client optimizer on the client's loss from
w_t, update w_k - w_t. With the default optimizer (``sgd``) the step is the papers'
w <- (1 - gamma lambda) w - gamma grad (App. C.2.2).

The three signatures are :class:`typing.Protocol` classes (:class:`ClientInitFn`,
:class:`ClientStepFn`, :class:`ClientFinalFn`; ``grad_fn`` is a :class:`GradFn`), with
positional-only parameters, as the lanes call them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, Tuple

import jax
import optax

Params = Any      # a pytree like the model's parameters
StepState = Any   # the pytree the lanes carry between a job's local steps


class ClientJob(NamedTuple):
    """One client's job, as its update sees it (values of one lane).

    optimizer: the client optimizer at this job's learning rate and l2 (optax; chain of the
      paper's L2 term and the optimizer).
    learning_rate: [] float32, the replica's client learning rate this round (gamma).
    l2: [] float32, the replica's lambda.
    steps: [] int32, the job's local steps K_k.
    key: the replica's key of this round (``fold_in(seed key, round)``; fold in the client
      for a client's own draws, ``fold_in(key, client)``); None where the engine has none
      (the adaptation of the personalised evaluation).
    client: [] int32, the client's index among the training clients (-1: none).
    size: [] int32, its examples n_k.
    """

    optimizer: optax.GradientTransformation
    learning_rate: Any
    l2: Any
    steps: Any
    key: Any = None
    client: Any = None
    size: Any = None


class GradFn(Protocol):
    """grad_fn(p) -> (loss, gradient): the masked mean loss of this step's minibatch at p
    ([] float32) and its gradient (a pytree like p)."""

    def __call__(self, params: Params, /) -> Tuple[jax.Array, Params]: ...


class ClientInitFn(Protocol):
    """init(server_state, client_state, params, hyper, job) -> step_state."""

    def __call__(self, server_state: Any, client_state: Any, params: Params, hyper: Any,
                 job: ClientJob, /) -> StepState: ...


class ClientStepFn(Protocol):
    """step(step_state, grad_fn, hyper, job) -> step_state: one local step."""

    def __call__(self, state: StepState, grad_fn: GradFn, hyper: Any,
                 job: ClientJob, /) -> StepState: ...


class ClientFinalFn(Protocol):
    """final(step_state, client_state, params, hyper, job) -> (client_state', update,
    output)."""

    def __call__(self, state: StepState, client_state: Any, params: Params, hyper: Any,
                 job: ClientJob, /) -> Tuple[Any, Params, Any]: ...


class ClientUpdate(NamedTuple):
    """An algorithm's client update: init, step and final (module docstring)."""

    init: ClientInitFn
    step: ClientStepFn
    final: ClientFinalFn


class LocalState(NamedTuple):
    """The step state of plain local training: params (the local model) and the client
    optimizer's state."""

    params: Params
    opt_state: Any


def optimizer_step(params, opt_state, grads, optimizer: optax.GradientTransformation):
    """One step of `optimizer` on `grads`: (params', opt_state')."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def difference(a, b):
    """a - b, leaf by leaf (a client's update w_k - w_t)."""
    return jax.tree.map(lambda x, y: x - y, a, b)


def local_init(server_state: Any, client_state: Any, params: Params, hyper: Any,
               job: ClientJob) -> LocalState:
    """Start from w_t with a fresh optimizer state."""
    del server_state, client_state, hyper
    return LocalState(params=params, opt_state=job.optimizer.init(params))


def local_step(state: LocalState, grad_fn: GradFn, hyper: Any, job: ClientJob) -> LocalState:
    """One optimizer step on the minibatch gradient."""
    del hyper
    _, grads = grad_fn(state.params)
    return LocalState(*optimizer_step(state.params, state.opt_state, grads, job.optimizer))


def local_final(state: LocalState, client_state: Any, params: Params, hyper: Any,
                job: ClientJob) -> Tuple[Any, Params, Any]:
    """The update w_k - w_t; the client's state unchanged; no output."""
    del hyper, job
    return client_state, difference(state.params, params), None


LOCAL_SGD = ClientUpdate(init=local_init, step=local_step, final=local_final)


class CorrectedState(NamedTuple):
    """The step state of local SGD on a corrected gradient: local (the local model and the
    optimizer's state) and the job's context (what the correction reads)."""

    local: LocalState
    context: Any


class ContextFn(Protocol):
    """context(server_state, client_state, params, hyper) -> a job's context."""

    def __call__(self, server_state: Any, client_state: Any, params: Params,
                 hyper: Any, /) -> Any: ...


class CorrectFn(Protocol):
    """correct(grads, params, context, hyper) -> the corrected gradient."""

    def __call__(self, grads: Params, params: Params, context: Any, hyper: Any, /) -> Params: ...


def corrected_sgd(context: ContextFn, correct: CorrectFn,
                  final: Optional[ClientFinalFn] = None) -> ClientUpdate:
    """Local SGD whose every minibatch gradient is corrected before the client optimizer's
    step, the shape of FedProx, SCAFFOLD and FedDyn:

    context(server_state, client_state, params, hyper) -> the job's context, kept in the step
      state (FedProx: w_t; SCAFFOLD: c - c_k; FedDyn: g_k - w_t);
    correct(grads, params, context, hyper) -> the corrected gradient at the local params;
    final(state, client_state, params, hyper, job) -> (client_state', update, output) over a
      :class:`CorrectedState` (None: local SGD's: the state unchanged, w_k - w_t, no output).
    """

    def init(server_state, client_state, params, hyper, job):
        return CorrectedState(local=local_init(server_state, client_state, params, hyper, job),
                              context=context(server_state, client_state, params, hyper))

    def step(state, grad_fn, hyper, job):
        w = state.local.params
        _, grads = grad_fn(w)
        grads = correct(grads, w, state.context, hyper)
        return state._replace(local=LocalState(*optimizer_step(w, state.local.opt_state, grads,
                                                               job.optimizer)))

    def plain_final(state, client_state, params, hyper, job):
        return local_final(state.local, client_state, params, hyper, job)

    return ClientUpdate(init=init, step=step, final=final or plain_final)


class AdaptState(NamedTuple):
    """The step state of a device adapting its model before it is evaluated
    (``--finetune_steps``; TFF's personalisation evaluation).

    Attributes:
        params: the model being adapted (from the model served to the device: the global
            model, or a training client's personal model).
        opt_state: the client optimizer's state.
        anchor: the global model the device was served (Ditto's proximal centre).
    """

    params: Params
    opt_state: Any
    anchor: Params


def fine_tune_step(state: AdaptState, grad_fn: GradFn, hyper: Any,
                   job: ClientJob) -> AdaptState:
    """Plain fine-tuning: one client-optimizer step on the device's own minibatch."""
    del hyper
    _, grads = grad_fn(state.params)
    return state._replace(**dict(zip(("params", "opt_state"), optimizer_step(
        state.params, state.opt_state, grads, job.optimizer))))
