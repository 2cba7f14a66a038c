"""Ditto (Li, Hu, Beirami, Smith, *Ditto: Fair and Robust Federated Learning Through
Personalization*, ICML 2021, Algorithm 1), as a personalisation layer over any global algorithm.

Each training client k keeps a personal model v_k (per-client state, from w_0). In round t
every sampled client, on each of its local minibatches:

- takes its personal step v <- v - eta (grad F_k(v) + lambda (v - w_t)), the gradient of
  h_k(v) = F_k(v) + (lambda/2)||v - w_t||^2 with w_t the round-start global model;
- takes the global algorithm's own local step on the same minibatch (FedAvg: w <- w - eta
  grad F_k(w)).

Both steps use the client optimizer at the same learning rate (the authors' single eta). The
server aggregates the global updates as the global algorithm does; the personal models never
leave the clients. A training client is served v_k (``client_model``); an unseen device adapts
the served global model w by ``--finetune_steps`` proximal steps of h (``adapt_step``).

**The layer.** :func:`ditto` wraps any :class:`FederatedAlgorithm`, as the server optimizer
wraps any aggregate: its client update runs the base's client update and the personal step
side by side, its client state is (the base's, v_k), and every sampled client works
(``all_sampled_work``): under Δ-FL's filter a client outside the tail still updates v_k while
its global update has weight 0. A method entry ``NAME+ditto`` (``--algorithm=deltafl+ditto``)
is Ditto over NAME (:func:`personalized`: NAME's sweeps crossed with ``--ditto_lambda``);
``--algorithm=ditto`` is Ditto over FedAvg, the paper's method, with lambda swept.

**Where this departs from the authors' code** (litian96/ditto 26d9b29,
``flearn/trainers/ditto.py``): clients are sampled uniformly here (the code draws them with
probability proportional to n_k); the server average follows ``--weighting`` (the code's
unweighted mean is ``--weighting=unweighted``); the code's optional per-step lambda selection on
a held-out split is not implemented.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, NamedTuple, Optional, Tuple

import jax

from deltafl_jax.algorithms.fedavg import DP_REQUIRES, FedAvgOptions, fedavg
from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import Sweep
from deltafl_jax.algorithms.protocol import FederatedAlgorithm
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients, Reporting
from deltafl_jax.engine.client import (AdaptState, ClientUpdate, optimizer_step)

LAYER = "ditto"
DEFAULT_LAMBDA = (0.1, 1.0, 2.0)   # the authors' lambda choices


class DittoHyper(NamedTuple):
    """ditto_lambda: [] lambda >= 0 (the global model is FedAvg's: its replicas are labelled
    theta = 1)."""

    ditto_lambda: float


class DittoClient(NamedTuple):
    """A client's own state: the global algorithm's (() for most) and its personal model."""

    base: Any
    personal: Any


class DittoStep(NamedTuple):
    """A client's step state: the global algorithm's, v, v's optimizer state, and w_t."""

    base: Any
    personal: Any
    personal_opt: Any
    anchor: Any


def proximal_step(v, opt_state, grads, anchor, lam, optimizer):
    """v' of one step on grad F_k(v) + lambda (v - anchor)."""
    grads = jax.tree.map(lambda g, p, a: g + lam * (p - a), grads, v, anchor)
    return optimizer_step(v, opt_state, grads, optimizer)


def ditto_update(base: ClientUpdate) -> ClientUpdate:
    """The base's client update with Ditto's personal step beside it on each minibatch."""

    def init(server_state, client_state, params, hyper, job):
        return DittoStep(base=base.init(server_state, client_state.base, params, hyper, job),
                         personal=client_state.personal,
                         personal_opt=job.optimizer.init(client_state.personal), anchor=params)

    def step(state, grad_fn, hyper, job):
        _, grads = grad_fn(state.personal)
        v, opt = proximal_step(state.personal, state.personal_opt, grads, state.anchor,
                               hyper.ditto_lambda, job.optimizer)
        return DittoStep(base=base.step(state.base, grad_fn, hyper, job), personal=v,
                         personal_opt=opt, anchor=state.anchor)

    def final(state, client_state, params, hyper, job):
        own, update, output = base.final(state.base, client_state.base, params, hyper, job)
        return DittoClient(base=own, personal=state.personal), update, output

    return ClientUpdate(init=init, step=step, final=final)


def adapt_step(state: AdaptState, grad_fn, hyper, job) -> AdaptState:
    """An unseen device's adaptation: a proximal step of h towards the served global model."""
    _, grads = grad_fn(state.params)
    params, opt = proximal_step(state.params, state.opt_state, grads, state.anchor,
                                hyper.ditto_lambda, job.optimizer)
    return state._replace(params=params, opt_state=opt)


def ditto(base: FederatedAlgorithm) -> FederatedAlgorithm:
    """Ditto over `base` (module docstring): its hyper-parameters must carry ``ditto_lambda``."""
    base_init = base.client_state_init

    def client_state_init(params, hyper):
        own = base_init(params, hyper) if base_init is not None else ()
        return DittoClient(base=own, personal=params)          # v_k = w_0

    def client_model(server_state, client_state, params, hyper):
        del server_state, params, hyper
        return client_state.personal

    return base._replace(name=f"{base.name}+{LAYER}", client_update=ditto_update(
        base.client_update), client_state_init=client_state_init, all_sampled_work=True,
        client_model=client_model, adapt_step=adapt_step)


def proximal_bound(config) -> Optional[float]:
    """The bound on eta a of a gradient step on a quadratic of curvature a with the run's
    client optimizer, past which the step grows the distance to the minimum instead of
    shrinking it: 2 for SGD (v - w <- (1 - eta a)(v - w), and |1 - eta a| < 1 iff 0 < eta a < 2),
    2 (1 + beta) for heavy-ball momentum; None for Adam and Adagrad, whose step is scaled by
    the gradients' own size."""
    name = config.client.name
    if name == "sgd":
        return 2.0
    if name == "momentum":
        return 2.0 * (1.0 + float(config.client.momentum))
    return None


def stability_cautions(config, replicas) -> Tuple[str, ...]:
    """One line per (learning rate, lambda, l2) of the run at which Ditto's proximal step
    v <- v - eta (grad F_k(v) + lambda (v - w_t) + l2 v) is past :func:`proximal_bound`:
    the term lambda (v - w_t) + l2 v alone has curvature lambda + l2, so at eta (lambda + l2)
    >= the bound the personal models oscillate about w_t without shrinking (for a convex F_k,
    which only adds curvature, with a growing amplitude until they are not finite). The rates checked: each replica's first (largest) client learning rate, and
    --finetune_lr when the unseen devices adapt with it."""
    bound = proximal_bound(config)
    if bound is None:
        return ()
    personal = config.personal
    adapts = personal.client_holdout > 0 and any(int(k) > 0 for k in personal.finetune_steps)
    lines, said = [], set()
    for r in range(replicas.size):
        lam, l2 = float(replicas.hyper.ditto_lambda[r]), float(replicas.l2[r])
        rates = [("learning rate", float(replicas.schedules[r](0)))]
        if adapts and personal.finetune_lr is not None:
            rates.append(("--finetune_lr", float(personal.finetune_lr)))
        for what, eta in rates:
            product = eta * (lam + l2)
            if product < bound or (what, eta, lam, l2) in said:
                continue
            said.add((what, eta, lam, l2))
            lines.append(
                f"ditto: λ = {lam:g} with {what} η = {eta:g}"
                + (f" and l2 = {l2:g}" if l2 else "")
                + f": η (λ + l2) = {product:g} >= {bound:g}, past the stability bound of the "
                f"personal step v <- v - η (∇F_k(v) + λ (v - w_t)) with "
                f"--client_optimizer={config.client.name}; the personal models "
                f"diverge (choose η (λ + l2) < {bound:g})")
    return tuple(lines)


LAMBDA_SWEEP = Sweep(flag="ditto_lambda", field="ditto_lambda", default=DEFAULT_LAMBDA,
                     minimum=0.0, symbol="λ",
                     help="ditto: lambda >= 0 of the personal objective F_k(v) + (lambda/2)"
                     "||v - w_t||^2, swept")


SPEC = AlgorithmSpec(
    name="ditto", display_name="Ditto",
    help="Ditto: FedAvg's global model, and each client's personal model v_k trained on "
    "F_k(v) + (lambda/2)||v - w_t||^2 beside it",
    factory=lambda config, data, options: ditto(fedavg(options)), hyper=DittoHyper,
    options_type=FedAvgOptions, dp_requires=DP_REQUIRES, sweep=LAMBDA_SWEEP,
    cautions=stability_cautions,
    clients=Clients(local_work=2.0),   # a personal step beside the global one on each minibatch
    # The leaderboard evaluates the global model on unseen test clients: FedAvg's, whatever
    # lambda (only the personal models v_k depend on it), so the CPU set trains one value.
    reporting=Reporting(leaderboard=Board(grid={"ditto_lambda": DEFAULT_LAMBDA},
                                          quick={"ditto_lambda": (1.0,)})))


@functools.lru_cache(maxsize=None)
def _hyper_type(base_hyper: Any) -> type:
    """The base's hyper NamedTuple with a ``ditto_lambda`` field."""
    return collections.namedtuple(f"{base_hyper.__name__}Ditto",
                                  base_hyper._fields + ("ditto_lambda",))


def personalized(base: AlgorithmSpec) -> AlgorithmSpec:
    """Ditto over `base`: its sweeps crossed with --ditto_lambda, its options and its server
    step; reports name it 'Ditto over <base's column>'."""
    base_column = base.reporting.column_name
    base_cautions = base.warnings

    def column_name(label, options, head):
        inner = base_column(label, options, head) if base_column is not None else head
        return f"Ditto over {inner}"

    return dataclasses.replace(
        base, name=f"{base.name}+{LAYER}", display_name=base.display_name,
        help=f"Ditto over {base.name}",
        factory=lambda config, data, options: ditto(base.factory(config, data, options)),
        hyper=_hyper_type(base.hyper),
        grid=dataclasses.replace(base.grid, cross=tuple(base.grid.cross) + (LAMBDA_SWEEP,),
                                 tunes_l2=False),
        reporting=dataclasses.replace(base.reporting, column_name=column_name, leaderboard=None),
        cautions=lambda config, replicas: (base_cautions(config, replicas)
                                           + stability_cautions(config, replicas)))
