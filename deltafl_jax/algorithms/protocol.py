"""The round's protocol: the pure functions an algorithm gives the engine, and what the server
learns from a round.

A round of every algorithm here has the same shape (Algorithm 2 of the Delta-FL paper; the
baselines of the CISS 2021 paper, Table I):

1. the engine computes each sampled client's loss F_k(w_t) on its whole training data (unless
   the algorithm declares that it does not use them: ``uses_losses=False``);
2. ``client_weights`` turns the round's :class:`RoundContext` (F, n, the state, the replica's
   hyper-parameters, key and sampled ids) into aggregation weights a_k >= 0; a_k = 0 means
   that the client does no local work (the Delta-FL filter, FedAvg-Sub's subset, ...);
3. the engine runs LocalUpdate on every client with a_k > 0: the algorithm's client update
   (``client_update``: ``init`` / ``step`` / ``client_final`` over a step state that the lanes
   carry, :mod:`deltafl_jax.engine.client`; by default minibatch SGD from w_t with the client
   optimizer) and returns the sums of a_k u_k over them, and each job's own results
   (:class:`ClientFeedback`);
4. ``server_update`` returns the aggregate Delta (and the algorithm's new state);
5. the round's server optimizer turns Delta into the new global model
   (:mod:`deltafl_jax.optimizers.server`: w + Delta by default).

The functions act on ONE replica; the round vmaps them over replicas. Hyper-parameters that may
differ between replicas (theta, q, t, mu, ...) arrive in ``hyper``, the algorithm's own typed
NamedTuple; the rest are captured when the factory builds the algorithm
(:class:`~deltafl_jax.algorithms.spec.AlgorithmSpec`).

Each hook's signature is a :class:`typing.Protocol` below (:class:`InitFn`,
:class:`ClientWeightsFn`, :class:`ServerUpdateFn`, ...; the client update's in
:mod:`deltafl_jax.engine.client`), so a type checker follows what the engine passes: the
parameters are positional-only, as the engine calls them. :mod:`deltafl_jax.algorithms.minimal`
is the smallest algorithm that fills them (plain averaging).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional, Protocol, Tuple

import jax
import jax.numpy as jnp
import optax

from deltafl_jax.engine import LOCAL_SGD, ClientUpdate
from deltafl_jax.engine.client import AdaptState, ClientJob, GradFn

Params = Any   # a pytree like the model's parameters
State = Any    # the algorithm's server state (a pytree; ``()`` for none)
Hyper = Any    # the replica's hyper-parameters: the algorithm's NamedTuple of [] arrays
Metrics = Mapping[str, jax.Array]


class RoundContext(NamedTuple):
    """What step 2 of a round knows about one replica's sampled clients: the argument of
    ``client_weights`` (values of one replica; the round vmaps over replicas).

    state: the algorithm's state (``init``'s, as the previous ``server_update`` left it).
    losses: [m] float32 F_k(w_t) of the sampled clients (NaN with ``uses_losses=False``; 0 on
      an empty slot of a cohort whose size varies).
    sizes: [m] int32 their example counts n_k (0: an empty slot).
    hyper: the replica's hyper-parameters (:data:`Hyper`).
    key: the replica's key of this round (``fold_in(seed key, round)``).
    clients: [m] int32 the sampled clients' ids (indices into the training clients).
    """

    state: State
    losses: jax.Array
    sizes: jax.Array
    hyper: Hyper
    key: jax.Array
    clients: jax.Array


class ClientFeedback(NamedTuple):
    """What the server learns from one round, for one replica.

    losses: [m] F_k(w_t) of the sampled clients (with the L2 term when l2 > 0).
    sizes: [m] their example counts n_k.
    weights: [m] the a_k that ``client_weights`` returned.
    delta_sum: pytree, sum over trained clients with a finite update of a_k u_k (u_k the
      update that the client update returned: w_k - w_t for local SGD).
    weight_sum: [] sum of a_k over the same clients.
    job_sqnorm: [m] ||u_k||^2 of each trained client.
    job_finite: [m] the client trained and its update is finite.
    job_trained: [m] the client trained.
    learning_rate: [] this round's client learning rate.
    clients: [m] int32 ids of the sampled clients (indices into the training clients).
    client_outputs: pytree, leaves [m, ...]: what the client update's ``final`` returned as
      each trained client's output (None for an algorithm without one; zeros for clients that
      did not train; possibly NaN for a client whose update was not finite: mask with
      ``job_finite``).
    probe_losses: [m'] the losses F_i of the round's second, uniform sample of clients at the
      model that ``probe`` chose (None without a probe); probe_clients: [m'] their ids.
    """

    losses: jax.Array
    sizes: jax.Array
    weights: jax.Array
    delta_sum: Params
    weight_sum: jax.Array
    job_sqnorm: jax.Array
    job_finite: jax.Array
    job_trained: jax.Array
    learning_rate: jax.Array
    clients: Any = None
    client_outputs: Any = None
    probe_losses: Any = None
    probe_clients: Any = None


class InitFn(Protocol):
    """init(params, hyper) -> state: the algorithm's state before the first round (also
    ``client_state_init``'s shape: ONE client's initial state)."""

    def __call__(self, params: Params, hyper: Hyper, /) -> State: ...


class ClientWeightsFn(Protocol):
    """client_weights(ctx) -> [m] float32 a_k >= 0 (step 2 of the round)."""

    def __call__(self, ctx: RoundContext, /) -> jax.Array: ...


class PrivateWeightsFn(Protocol):
    """A private version's client_weights(ctx, z) -> [m] a_k: as :class:`ClientWeightsFn`,
    with the replica's noise multiplier z ([] float32) for the noise of what it releases."""

    def __call__(self, ctx: RoundContext, z: jax.Array, /) -> jax.Array: ...


class ServerUpdateFn(Protocol):
    """server_update(state, params, feedback, hyper) -> (Delta, state', metrics): Delta a
    pytree like params (what the round's server optimizer applies), metrics [] scalars."""

    def __call__(self, state: State, params: Params, feedback: ClientFeedback,
                 hyper: Hyper, /) -> Tuple[Params, State, Metrics]: ...


class EvalParamsFn(Protocol):
    """eval_params(state, params) -> the parameters to evaluate and save."""

    def __call__(self, state: State, params: Params, /) -> Params: ...


class ClientModelFn(Protocol):
    """client_model(server_state, client_state, params, hyper) -> the model served to one
    training client."""

    def __call__(self, server_state: State, client_state: Any, params: Params,
                 hyper: Hyper, /) -> Params: ...


class AdaptStepFn(Protocol):
    """adapt_step(adapt_state, grad_fn, hyper, job) -> adapt_state: one step of a device
    adapting its served model (``--finetune_steps``)."""

    def __call__(self, state: AdaptState, grad_fn: GradFn, hyper: Hyper,
                 job: ClientJob, /) -> AdaptState: ...


class SamplingFn(Protocol):
    """sampling(state) -> [N] float32 the probabilities of the round's draws."""

    def __call__(self, state: State, /) -> jax.Array: ...


class ProbeFn(Protocol):
    """probe(state, params, feedback, hyper) -> the model at which the round's second sample
    is evaluated."""

    def __call__(self, state: State, params: Params, feedback: ClientFeedback,
                 hyper: Hyper, /) -> Params: ...


class WeightBoundFn(Protocol):
    """(hyper, m) -> a number ([] array or float): a private version's a_max, fixed
    denominator or floor for a cohort of m clients."""

    def __call__(self, hyper: Hyper, m: int, /) -> Any: ...


class PrivateAggregate(NamedTuple):
    """How an algorithm's average of the updates is made differentially private
    (:mod:`deltafl_jax.privacy.dp`); the engine clips each update to --dp_clip C first.

    max_weight(hyper, m) -> a_max: the largest weight a_k one client can get (the sum's
      sensitivity is C a_max; the noise N(0, (z C a_max)^2 I) is added to it).
    denominator(hyper, m) -> D: the fixed denominator (DP-FedAvg's expected weight of a
      round); None: the kept weight sum_k a_k, released with noise N(0, (z a_max)^2) and
      floored at floor(hyper, m) when z > 0 (so that a round that keeps few clients does not
      divide the noise by a small number), at a_max without noise (the plain average).
    releases: the noise multipliers (noise std over the replace-one sensitivity), relative to
      z, of the round's further Gaussian releases (the model update's, 1/2, is not listed):
      what the accountant composes.
    client_weights(ctx, z) -> [m] a_k under DP (:class:`PrivateWeightsFn`; None: the
      algorithm's own, which must not read the losses).
    add_remove_releases: the same releases' multipliers over their add-or-remove
      sensitivity (Poisson client sampling), in the same order.
    """

    max_weight: WeightBoundFn
    denominator: Optional[WeightBoundFn] = None
    releases: Tuple[float, ...] = ()
    client_weights: Optional[PrivateWeightsFn] = None
    floor: Optional[WeightBoundFn] = None
    add_remove_releases: Tuple[float, ...] = ()


class FederatedAlgorithm(NamedTuple):
    """The pure functions of one algorithm (optax-style: built by a factory, never jitted here).

    init(params, hyper) -> state;
    client_weights(ctx) -> [m] a_k, from the round's :class:`RoundContext`;
    server_update(state, params, feedback, hyper) -> (Delta, state, dict of scalar metrics):
      Delta, a pytree like params, is the aggregate that the round's server optimizer applies
      (w + Delta by default: :func:`average_delta` gives the weighted average of the updates);
    eval_params(state, params) -> the parameters to evaluate and save (None: params);
    uses_losses: client_weights or server_update read the losses F_k(w_t). False (FedAvg,
      FedProx): the round skips step 1, the evaluation of the sampled clients at w_t, and
      their losses arrive as NaN.

    The client's own problem (fedjax's ``for_each_client``):
    client_update: what each working client does with its local steps, a
      :class:`~deltafl_jax.engine.client.ClientUpdate` (init, step, final over a step state
      the lanes carry; default :data:`~deltafl_jax.engine.client.LOCAL_SGD`, the papers' local
      SGD with the run's client optimizer). FedProx adds its proximal gradient in ``step``,
      SCAFFOLD its control variates, Ditto trains a second model.
    client_state_init(params, hyper) -> ONE client's initial state; every training client of
      every replica starts from it (leaves [R, N, ...] in the round state), and ``final``'s
      new state is written back for the clients whose update is finite.
    all_sampled_work: every sampled client runs its client update, including those whose
      weight a_k is 0 (their update adds nothing, their own state still changes: Ditto over
      Delta-FL's personal models); False: only the clients with a_k > 0 work.

    Per-client models (personalisation; evaluated on each client's held-out data,
    ``--client_holdout``):
    client_model(server_state, client_state, params, hyper) -> the model served to a training
      client from its own state (Ditto: v_k; APFL: alpha_k v_k + (1 - alpha_k) w); params is
      the served global model. None: every client is served the global model.
    adapt_step(adapt_state, grad_fn, hyper, job) -> adapt_state: how a device adapts the
      model it was served on its own data before it is evaluated (``--finetune_steps``), over
      an :class:`~deltafl_jax.engine.client.AdaptState` (Ditto: its proximal step towards the
      served global model). None: plain fine-tuning with the client optimizer
      (:func:`~deltafl_jax.engine.client.fine_tune_step`).

    Sampling and probing (DRFA):
    sampling(state) -> [N] the probabilities with which the round draws its m clients (with
      replacement), from the replica's state; the host reads them after the previous round,
      and each replica then gets its own plan. None: the run's sampler (uniform, Poisson,
      cyclic).
    probe(state, params, feedback, hyper) -> a model at which the round evaluates a second
      sample of m clients drawn uniformly (independently of the first), whose losses reach
      ``server_update`` as ``feedback.probe_losses`` (DRFA: the average of the sampled
      clients' snapshot models). None: no second sample.

    private: how its average is made differentially private (:class:`PrivateAggregate`);
      None: it has no private version (with its options), and --dp_clip is refused.
    steps_without_clients: its Delta moves the model in a round in which no client's update
      reached the aggregate (MIFA's stored updates); False: with a server optimizer such a
      round keeps the model and the optimizer's state.
    """

    name: str
    init: InitFn
    client_weights: ClientWeightsFn
    server_update: ServerUpdateFn
    eval_params: Optional[EvalParamsFn] = None
    uses_losses: bool = True
    client_update: ClientUpdate = LOCAL_SGD
    client_state_init: Optional[InitFn] = None
    all_sampled_work: bool = False
    client_model: Optional[ClientModelFn] = None
    adapt_step: Optional[AdaptStepFn] = None
    sampling: Optional[SamplingFn] = None
    probe: Optional[ProbeFn] = None
    private: Optional[PrivateAggregate] = None
    steps_without_clients: bool = False


def scaled_delta(params: Params, delta_sum: Params, total: jax.Array) -> Params:
    """delta_sum / total in the dtype of params (zero when total is 0)."""
    scale = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    return jax.tree.map(lambda w, d: (scale * d).astype(w.dtype), params, delta_sum)


def average_delta(params: Params, feedback: ClientFeedback) -> Params:
    """Delta = sum_k a_k (w_k - w) / sum_k a_k over the trained clients with a finite update;
    zero if there is none. The round's server step w + Delta (server optimizer ``sgd`` at
    learning rate 1) is the reference code's plain average of the local models."""
    return scaled_delta(params, feedback.delta_sum, feedback.weight_sum)


def apply_delta(params: Params, delta: Params) -> Params:
    """w + Delta, as the round's default server step computes it (``optax.apply_updates``)."""
    return optax.apply_updates(params, delta)


def no_state(params: Params, hyper: Hyper) -> State:
    """The state of an algorithm without one: ``()``."""
    del params, hyper
    return ()


def zeros_like_params(params: Params, hyper: Hyper) -> Params:
    """A state of zeros like the parameters (SCAFFOLD's control variates, FedDyn's g_k)."""
    del hyper
    return jax.tree.map(jnp.zeros_like, params)
