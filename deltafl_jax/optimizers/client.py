"""The client optimizer: the optax transformation of a client's local steps.

Every local step takes the minibatch gradient g of the client's objective, adds the paper's L2
term (App. C.2.2: g + lambda w, ``optax.add_decayed_weights``) and hands the sum to the client
optimizer, whose state starts afresh at each job (FedJAX's ``federated_averaging(grad_fn,
client_optimizer, server_optimizer, ...)``). With gamma the round's client learning rate
(``--learning_rate`` and its decay) and ``--client_optimizer``:

- ``sgd`` (default): w <- w - gamma (g + lambda w), i.e. the papers' step
  w <- (1 - gamma lambda) w - gamma g (``optax.sgd``);
- ``momentum``: v <- beta v + (g + lambda w), w <- w - gamma v (``optax.sgd(momentum=beta)``,
  beta = ``--client_momentum``, v_0 = 0 at each job);
- ``adam``: Kingma and Ba's Adam with bias correction (``optax.adam``; ``--client_beta1``,
  ``--client_beta2``, ``--client_eps``), so L2-regularised Adam, not AdamW;
- ``adagrad``: Duchi et al.'s Adagrad (``optax.adagrad``: accumulator from 0.1, eps
  ``--client_eps``).

The learning rate and lambda are the job's replica's (traced values: a sweep of learning rates
or of lambda trains in one program).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Tuple

import optax

from deltafl_jax.declared import check_finite, declared, finite_in, from_flat, setting
from deltafl_jax.errors import ConfigError

NAMES = ("sgd", "momentum", "adam", "adagrad")
DISPLAY = {"sgd": "SGD", "momentum": "momentum", "adam": "Adam", "adagrad": "Adagrad"}
# The --client_* flags that each optimizer reads beside --learning_rate.
READS = {"sgd": (), "momentum": ("client_momentum",),
         "adam": ("client_beta1", "client_beta2", "client_eps"), "adagrad": ("client_eps",)}
SYMBOLS = {"client_momentum": "β", "client_beta1": "β₁", "client_beta2": "β₂",
           "client_eps": "ε"}


@dataclasses.dataclass(frozen=True)
class ClientOptimizer:
    """The client optimizer of a run (module docstring)."""

    name: str = setting(
        "sgd", "the client's local step on g + lambda w: sgd (the papers') | momentum | adam | "
        "adagrad; its state starts afresh at each client's job", flag="client_optimizer",
        choices=NAMES)
    momentum: float = setting(0.9, "--client_optimizer=momentum: beta of v <- beta v + g",
                              flag="client_momentum")
    beta1: float = setting(0.9, "--client_optimizer=adam: beta1", flag="client_beta1")
    beta2: float = setting(0.999, "--client_optimizer=adam: beta2", flag="client_beta2")
    eps: float = setting(1e-8, "--client_optimizer=adam / adagrad: eps", flag="client_eps")

    def check(self) -> None:
        """ConfigError naming the flag at fault."""
        if self.name not in NAMES:
            raise ConfigError(f"unknown --client_optimizer={self.name!r}; choose one of "
                              f"{', '.join(NAMES)}")
        for flag, v in (("client_momentum", self.momentum), ("client_beta1", self.beta1),
                        ("client_beta2", self.beta2)):
            if not finite_in(v, 0.0, 1.0, high_open=True):
                raise ConfigError(f"--{flag} must be a number in [0, 1), got {v!r}")
        check_finite("client_eps", self.eps, 0.0, low_open=True)

    @property
    def is_default(self) -> bool:
        return self.name == "sgd"

    def reads(self) -> Tuple[str, ...]:
        return READS[self.name]

    def settings(self) -> Tuple[Tuple[str, float], ...]:
        """(flag, value) of each flag it reads."""
        return tuple((flag, float(getattr(self, FIELDS[flag]))) for flag in self.reads())

    def describe(self) -> str:
        """'Adam, client_beta1=0.9, ...' for the start-up line."""
        return ", ".join([DISPLAY[self.name]] + [f"{f}={v:g}" for f, v in self.settings()])

    def transformation(self, learning_rate, l2) -> optax.GradientTransformation:
        """The local step at `learning_rate` with the L2 term `l2` (scalars, traced or not):
        the chain of ``add_decayed_weights(l2)`` and the optimizer."""
        name = self.name
        if name == "sgd":
            opt = optax.sgd(learning_rate)
        elif name == "momentum":
            opt = optax.sgd(learning_rate, momentum=self.momentum)
        elif name == "adam":
            opt = optax.adam(learning_rate, b1=self.beta1, b2=self.beta2, eps=self.eps)
        else:
            opt = optax.adagrad(learning_rate, eps=self.eps)
        return optax.chain(optax.add_decayed_weights(l2), opt)


# The ClientOptimizer field of each --client_* flag beside --client_optimizer.
FIELDS = {flag.name: name for name, flag in declared(ClientOptimizer) if name != "name"}


def from_run_config(config: Mapping[str, Any]) -> ClientOptimizer:
    """The client optimizer of a finished run (summary.json's ``config``); runs written before
    client optimizers existed took plain SGD."""
    return from_flat(ClientOptimizer, config)
