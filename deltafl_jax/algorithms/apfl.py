"""APFL (Deng, Kamani, Mahdavi, *Adaptive Personalized Federated Learning*, 2020, Algorithm 1
with adaptive alpha), as FedJAX writes it (google/fedjax, ``fedjax/algorithms/apfl.py``).

Every training client k keeps a personal model v_k and its mixing weight alpha_k (per-client
state, :class:`APFLClient`); the model it is served is the mixture
alpha_k v_k + (1 - alpha_k) w (``client_model``). In round t each sampled client starts a copy
w of the global model w_t and, on each of its K_k local minibatches, with
v_bar = alpha v + (1 - alpha) w and every gradient taken at the step's start:

- w steps on grad f(w) (the run's client optimizer, as FedAvg's local step);
- v steps on grad f(v_bar) (its own client-optimizer state; ``--apfl_v_gradient``);
- alpha <- clip(alpha - eta_alpha <v - w, grad f(v_bar)>, 0, 1) (a plain projected step:
  <v - w, grad f(v_bar)> is d f(v_bar) / d alpha), with eta_alpha = ``--apfl_alpha_lr`` x the
  round's client learning rate gamma.

v_k and alpha_k persist (written back when the client's update is finite); the server averages
the w_k as FedAvg does (n_k, or uniform with ``--weighting=unweighted``; FedJAX weighs by
the number of examples), and its server step and optimizers apply. A client sampled for the
first time starts v from the round's w_t (FedJAX's default client state), so a client never
sampled is served w, as FedJAX serves a client without a state; an unseen device is served
w and adapts by plain fine-tuning (``adapt_step`` None).

**Where FedJAX departs from the paper, and the options.**

- ``--apfl_mixing``: ``leaf`` (default): one alpha per parameter leaf (kernel, bias, ...), as
  FedJAX; ``model``: one scalar alpha per client, as the paper (its gradient is the sum of
  the leaves' inner products). Per leaf is the default because FedJAX is the reference code
  this was checked against; it lets a layer be personalised more than another.
- ``--apfl_v_gradient``: ``fedjax`` (default): v steps on grad f(v_bar), as FedJAX writes
  it; ``paper``: on alpha grad f(v_bar), the chain rule's d f(v_bar) / d v (Algorithm 1).
  FedJAX omits the factor alpha, so its v is trained as a full model while the paper's moves
  little while alpha is small (and not at all at alpha = 0).
- ``--apfl_alpha_lr``: eta_alpha / gamma. FedJAX steps alpha with the client optimizer at
  gamma (1 here, with plain SGD); the paper with the models' eta_t (also 1). 0 keeps alpha
  at its initial value (the paper's fixed-alpha APFL). alpha gets neither the L2 term nor
  the optimizer's state (momentum, Adam), which apply to w and v only.
- The initial alpha is swept (``--apfl_alpha``, default 0.25, 0.5, 0.75, the paper's values).

The authors' own code (FedTorch) mixes the two models' outputs rather than their parameters
and keeps alpha fixed by default; this follows the paper's and FedJAX's parameter mixture.
At alpha = 0 with ``--apfl_alpha_lr=0`` the global model is FedAvg's bit for bit (w's local
steps are FedAvg's). A client whose personal model or alpha is not finite is dropped like
one whose update is not (it adds nothing and keeps its state). APFL has no private version.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.deltafl import WEIGHTING
from deltafl_jax.algorithms.fedavg import FedAvgOptions, fedavg
from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import Sweep, check_options
from deltafl_jax.algorithms.protocol import FederatedAlgorithm
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients, Reporting
from deltafl_jax.declared import Bounds, setting
from deltafl_jax.engine.client import ClientUpdate, LocalState, difference, optimizer_step
from deltafl_jax.engine import tree_all_finite
from deltafl_jax.errors import ConfigError

DEFAULT_ALPHA = (0.25, 0.5, 0.75)
MIXINGS = ("leaf", "model")
V_GRADIENTS = ("fedjax", "paper")

class APFLHyper(NamedTuple):
    """alpha0: [] every client's initial mixing weight in [0, 1]."""

    alpha0: float


@dataclasses.dataclass(frozen=True)
class APFLOptions:
    """FedAvg's ``weighting`` and APFL's own options (module docstring)."""

    weighting: str = WEIGHTING.field()
    apfl_alpha_lr: float = setting(
        1.0, "apfl: alpha's step size as a multiple of the client learning rate (1: the models' "
        "step, as FedJAX and the paper; 0: alpha fixed at --apfl_alpha)", bounds=Bounds(0.0))
    apfl_mixing: str = setting(
        "leaf", "apfl: leaf: one alpha per parameter leaf (FedJAX) | model: one alpha per "
        "client (the paper)", choices=MIXINGS)
    apfl_v_gradient: str = setting(
        "fedjax", "apfl: fedjax: v steps on grad f(v_bar) | paper: on alpha grad f(v_bar) (the "
        "chain rule, Algorithm 1)", choices=V_GRADIENTS)


class APFLClient(NamedTuple):
    """One client's state: v (personal model, like the parameters), alpha (a pytree of []
    per parameter leaf, or one [] with --apfl_mixing=model) and seen ([] 1.0 once the client
    has trained; 0.0 before)."""

    v: object
    alpha: object
    seen: object


class APFLStep(NamedTuple):
    """A client's step state: the local copy of the global model, the personal model (each
    with its optimizer state) and alpha."""

    w: LocalState
    v: LocalState
    alpha: object


def leaf_alphas(alpha, params):
    """alpha as a pytree like params' leaves (a scalar alpha repeated on every leaf)."""
    if jax.tree.structure(alpha) == jax.tree.structure(params):
        return alpha
    return jax.tree.map(lambda _: alpha, params)


def mixture(alpha, v, w):
    """alpha v + (1 - alpha) w, leaf by leaf (alpha: per leaf or one scalar)."""
    return jax.tree.map(lambda a, x, y: a * x + (1.0 - a) * y, leaf_alphas(alpha, w), v, w)


def alpha_gradient(alpha, v, w, grads):
    """d f(v_bar) / d alpha = <v - w, grad f(v_bar)>, per leaf or summed for a scalar alpha."""
    per_leaf = jax.tree.map(lambda x, y, g: jnp.sum((x - y) * g), v, w, grads)
    if jax.tree.structure(alpha) == jax.tree.structure(v):
        return per_leaf
    return sum(jax.tree.leaves(per_leaf))


def apfl_update(options: APFLOptions) -> ClientUpdate:
    """The client update of APFL with `options` (module docstring)."""
    paper = options.apfl_v_gradient == "paper"

    def init(server_state, client, params, hyper, job):
        del server_state, hyper
        v = jax.tree.map(lambda x, w: jnp.where(client.seen > 0, x, w), client.v, params)
        return APFLStep(w=LocalState(params, job.optimizer.init(params)),
                        v=LocalState(v, job.optimizer.init(v)), alpha=client.alpha)

    def step(state, grad_fn, hyper, job):
        del hyper
        w, v, alpha = state.w.params, state.v.params, state.alpha
        _, gw = grad_fn(w)
        _, gbar = grad_fn(mixture(alpha, v, w))
        gv = jax.tree.map(jnp.multiply, leaf_alphas(alpha, w), gbar) if paper else gbar
        lr = options.apfl_alpha_lr * job.learning_rate
        alpha = jax.tree.map(lambda a, g: jnp.clip(a - lr * g, 0.0, 1.0), alpha,
                             alpha_gradient(alpha, v, w, gbar))
        return APFLStep(w=LocalState(*optimizer_step(w, state.w.opt_state, gw, job.optimizer)),
                        v=LocalState(*optimizer_step(v, state.v.opt_state, gv, job.optimizer)),
                        alpha=alpha)

    def final(state, client, params, hyper, job):
        """(v, alpha, seen = 1; w_k - w_t, NaN when v or alpha is not finite; no output)."""
        del hyper, job
        new = APFLClient(v=state.v.params, alpha=state.alpha,
                         seen=jnp.ones_like(client.seen))
        ok = tree_all_finite((new.v, new.alpha))
        delta = jax.tree.map(lambda d: jnp.where(ok, d, jnp.nan), difference(state.w.params,
                                                                             params))
        return new, delta, None

    return ClientUpdate(init=init, step=step, final=final)


def apfl(options: APFLOptions = APFLOptions()) -> FederatedAlgorithm:
    """APFL with hyper.alpha0: FedAvg's round with APFL's client update and client model."""
    check_options(options)

    def client_state_init(params, hyper):
        alpha = jnp.asarray(hyper.alpha0, jnp.float32)
        if options.apfl_mixing == "leaf":
            alpha = jax.tree.map(lambda _: alpha, params)
        return APFLClient(v=params, alpha=alpha, seen=jnp.zeros((), jnp.float32))

    def client_model(server_state, client, params, hyper):
        """alpha v + (1 - alpha) w for a client that has trained; w for one never sampled."""
        del server_state, hyper
        mixed = mixture(client.alpha, client.v, params)
        return jax.tree.map(lambda x, w: jnp.where(client.seen > 0, x, w), mixed, params)

    return fedavg(FedAvgOptions(weighting=options.weighting))._replace(
        name="apfl", client_update=apfl_update(options), client_state_init=client_state_init,
        client_model=client_model, private=None)


def check_alphas(config) -> None:
    for a in config.sweep("apfl_alpha"):
        if isinstance(a, (int, float)) and not isinstance(a, bool) and a > 1:
            raise ConfigError(f"--apfl_alpha must lie in [0, 1], got {a!r}")


SPEC = AlgorithmSpec(
    name="apfl", display_name="APFL",
    help="APFL: personal model v_k and mixing weight alpha_k per client, served "
    "alpha_k v_k + (1 - alpha_k) w; the global model averaged as FedAvg's",
    factory=lambda config, data, options: apfl(options), hyper=APFLHyper,
    options_type=APFLOptions, validate=check_alphas,
    clients=Clients(local_work=2.0),   # the steps of w and of v on each minibatch
    sweep=Sweep(flag="apfl_alpha", field="alpha0", default=DEFAULT_ALPHA, minimum=0.0,
                help="apfl: initial mixing weights alpha in [0, 1], swept", symbol="α₀"),
    # The leaderboard evaluates the global model on unseen test clients: FedAvg's, whatever
    # alpha_0 (only the personal models depend on it), so the CPU set trains one value.
    reporting=Reporting(leaderboard=Board(grid={"apfl_alpha": DEFAULT_ALPHA},
                                          quick={"apfl_alpha": (0.5,)})))
