"""The server step: an optax transformation of the pseudo-gradient (Reddi et al., *Adaptive
Federated Optimization*, ICLR 2021, Algorithm 2, "FedOpt").

Every algorithm's server update yields an aggregate Delta_t (for the averaging algorithms
Delta_t = sum_k a_k (w_k - w_t) / sum_k a_k); the round then treats g_t = -Delta_t as a gradient
and applies ``server_optimizer.update(g_t, ...)``. With eta the server learning rate
(``--server_lr``) and beta1, beta2, tau (``--server_beta1``, ``--server_beta2``,
``--server_eps``):

- ``sgd``: w <- w + eta Delta (``optax.sgd``). At eta = 1 (the default) this is the step every
  algorithm of the papers takes (for FedAvg and Delta-FL the plain average of the local
  models), and the round applies it as it stands, w + Delta, with no optimizer state: as one
  fused expression w + s d, bit for bit the program before server optimizers existed (the
  optax form, w - 1 (-(s d)), rounds s d first and can differ in the last bit).
- ``momentum`` (FedAvgM, Hsu et al. 2019): v <- beta v + Delta, w <- w + eta v
  (``optax.sgd(momentum=beta)``, beta = ``--server_momentum``; v_{-1} = 0).
- ``adam`` (FedAdam): m <- beta1 m + (1 - beta1) Delta, v <- beta2 v + (1 - beta2) Delta^2,
  w <- w + eta m / (sqrt(v) + tau).
- ``yogi`` (FedYogi): as adam with v <- v - (1 - beta2) Delta^2 sign(v - Delta^2).
- ``adagrad`` (FedAdagrad): as adam with v <- v + Delta^2.

For the last three m_{-1} = 0 and v_{-1} = tau^2 (Algorithm 2 asks v_{-1} >= tau^2), with no bias
correction. optax's own transformations differ from Algorithm 2 there, so
:func:`scale_by_fedopt` implements them: ``optax.adam`` divides m and v by 1 - beta^t (bias
correction); ``optax.yogi`` also bias-corrects and starts m at its accumulator value instead of 0;
``optax.adagrad`` has no first moment and adds its eps inside the square root. ``sgd`` and
``momentum`` are optax's, whose definitions match.

The learning rate is injected (``optax.inject_hyperparams``) so that each replica carries its own
in the optimizer state: a list of ``--server_lr`` values trains as replicas of one program.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import optax

from deltafl_jax.declared import check_finite, declared, floats, from_flat, setting
from deltafl_jax.errors import ConfigError

NAMES = ("sgd", "momentum", "adam", "yogi", "adagrad")
DISPLAY = {"sgd": "SGD", "momentum": "momentum", "adam": "Adam", "yogi": "Yogi",
           "adagrad": "Adagrad"}
# The --server_* flags beside --server_lr that each optimizer reads, and how reports write
# each.
READS = {"sgd": (), "momentum": ("server_momentum",), "adagrad": ("server_beta1", "server_eps"),
         "adam": ("server_beta1", "server_beta2", "server_eps"),
         "yogi": ("server_beta1", "server_beta2", "server_eps")}
SYMBOLS = {"server_momentum": "β", "server_beta1": "β₁", "server_beta2": "β₂",
           "server_eps": "τ"}


class FedOptState(NamedTuple):
    """m, v: pytrees like the parameters (Algorithm 2's first and second moments)."""

    m: Any
    v: Any


def _second_moment(kind: str, beta2: float):
    """v_t from v_{t-1} and Delta_t^2 (Algorithm 2, line 12 of each variant)."""
    if kind == "adam":
        return lambda v, d2: beta2 * v + (1.0 - beta2) * d2
    if kind == "yogi":
        return lambda v, d2: v - (1.0 - beta2) * d2 * jnp.sign(v - d2)
    if kind == "adagrad":
        return lambda v, d2: v + d2
    raise ValueError(f"unknown adaptive server optimizer {kind!r}")


def scale_by_fedopt(kind: str, beta1: float, beta2: float, tau: float
                    ) -> optax.GradientTransformation:
    """Algorithm 2's direction m / (sqrt(v) + tau), with m and v the moments of the updates it
    receives, g = -Delta (v sees g^2 = Delta^2; m_g = -m_Delta), so that
    ``scale_by_learning_rate`` (which negates) makes the step w + eta m_Delta / (sqrt(v) + tau).
    """
    second = _second_moment(kind, beta2)

    def init(params):
        return FedOptState(m=jax.tree.map(jnp.zeros_like, params),
                           v=jax.tree.map(lambda p: jnp.full_like(p, tau * tau), params))

    def update(updates, state, params=None):
        del params
        m = jax.tree.map(lambda m, g: beta1 * m + (1.0 - beta1) * g, state.m, updates)
        v = jax.tree.map(lambda v, g: second(v, g * g), state.v, updates)
        direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + tau), m, v)
        return direction, FedOptState(m=m, v=v)

    return optax.GradientTransformation(init, update)


@dataclasses.dataclass(frozen=True)
class ServerOptimizer:
    """The server optimizer of a run (module docstring).

    name: one of :data:`NAMES`. learning_rates: eta, one value or several (swept as replicas).
    momentum: beta of ``momentum``. beta1, beta2, eps: beta1, beta2, tau of the adaptive ones.
    """

    name: str = setting(
        "sgd", "the server step on the pseudo-gradient -Delta: sgd (w + eta Delta; eta = 1: the "
        "plain average) | momentum (FedAvgM) | adam (FedAdam) | yogi (FedYogi) | adagrad "
        "(FedAdagrad), as Reddi et al. 2021, Algorithm 2", flag="server_optimizer", choices=NAMES)
    learning_rates: Tuple[float, ...] = setting(
        (1.0,), "server learning rate eta; several values train as replicas of one program",
        flag="server_lr", parse=floats)
    momentum: float = setting(0.9, "momentum: beta of v <- beta v + Delta",
                              flag="server_momentum")
    beta1: float = setting(0.9, "adam / yogi / adagrad: beta1 of the first moment",
                           flag="server_beta1")
    beta2: float = setting(0.99, "adam / yogi: beta2 of the second moment", flag="server_beta2")
    eps: float = setting(1e-3, "adam / yogi / adagrad: tau, added to sqrt(v) (and v_{-1} = "
                         "tau^2)", flag="server_eps")

    def __post_init__(self):
        lrs = self.learning_rates
        object.__setattr__(self, "learning_rates",
                           tuple(lrs) if isinstance(lrs, (tuple, list)) else (lrs,))

    def check(self) -> None:
        """ConfigError naming the flag at fault."""
        if self.name not in NAMES:
            raise ConfigError(f"unknown --server_optimizer={self.name!r}; choose one of "
                              f"{', '.join(NAMES)}")
        lrs = self.learning_rates
        if not lrs:
            raise ConfigError("--server_lr must list at least one value")
        for v in lrs:
            _number("server_lr", v, low=0.0, low_ok=False)
        if len(set(lrs)) != len(lrs):
            raise ConfigError(f"--server_lr lists a value twice: {list(lrs)}")
        for flag, v in (("server_momentum", self.momentum), ("server_beta1", self.beta1),
                        ("server_beta2", self.beta2)):
            _number(flag, v, low=0.0, low_ok=True, high=1.0)
        _number("server_eps", self.eps, low=0.0, low_ok=False)

    @property
    def is_default(self) -> bool:
        """The plain average w + Delta (sgd at learning rate 1): what every algorithm's paper
        describes, and what an algorithm without a server optimizer accepts."""
        return self.name == "sgd" and tuple(self.learning_rates) == (1.0,)

    def reads(self) -> Tuple[str, ...]:
        """The --server_* flags that this optimizer reads beside --server_lr."""
        return READS[self.name]

    def settings(self) -> Tuple[Tuple[str, float], ...]:
        """(flag, value) of each flag it reads beside --server_lr."""
        return tuple((flag, float(getattr(self, FIELDS[flag]))) for flag in self.reads())

    def describe(self) -> str:
        """One line for the start of a run: 'Adam, server_lr=0.01,0.03, server_beta1=0.9, ...'."""
        lrs = ",".join(f"{v:g}" for v in self.learning_rates)
        return ", ".join([f"{DISPLAY[self.name]}, server_lr={lrs}"]
                         + [f"{flag}={v:g}" for flag, v in self.settings()])

    def transformation(self) -> Optional[optax.GradientTransformation]:
        """The transformation of g = -Delta, with its learning rate injected (state field
        ``hyperparams["learning_rate"]``: set per replica by :func:`init_states`); None for
        the default step w + Delta."""
        if self.is_default:
            return None
        name, momentum = self.name, self.momentum
        beta1, beta2, tau = self.beta1, self.beta2, self.eps

        def make(learning_rate):
            if name == "sgd":
                return optax.sgd(learning_rate)
            if name == "momentum":
                return optax.sgd(learning_rate, momentum=momentum)
            return optax.chain(scale_by_fedopt(name, beta1, beta2, tau),
                               optax.scale_by_learning_rate(learning_rate))

        return optax.inject_hyperparams(make)(learning_rate=1.0)


# The ServerOptimizer field of each --server_* flag beside --server_optimizer and --server_lr.
FIELDS = {flag.name: name for name, flag in declared(ServerOptimizer)
          if name not in ("name", "learning_rates")}


def from_run_config(config: Mapping[str, Any]) -> ServerOptimizer:
    """The server optimizer of a finished run, from its stored configuration (summary.json's
    ``config``); runs written before server optimizers existed took the plain step."""
    return from_flat(ServerOptimizer, config)


def _number(flag, v, low, low_ok, high=math.inf):
    check_finite(flag, v, low, high, low_open=not low_ok, high_open=True)


def init_states(transformation: Optional[optax.GradientTransformation], params,
                learning_rates):
    """The optimizer state of every replica (params: leaves [R, ...]; learning_rates: [R]);
    () for the default step."""
    if transformation is None:
        return ()
    state = jax.vmap(transformation.init)(params)
    lr = jnp.asarray(learning_rates, jnp.float32)
    return state._replace(hyperparams={**state.hyperparams, "learning_rate": lr})


def server_step(transformation: Optional[optax.GradientTransformation], params, delta,
                opt_state):
    """(w', state'): the update of -Delta applied to w, for every replica (leaves [R, ...]);
    w + Delta for the default step (transformation None)."""
    if transformation is None:
        return optax.apply_updates(params, delta), opt_state
    grads = jax.tree.map(jnp.negative, delta)
    updates, opt_state = jax.vmap(transformation.update)(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
