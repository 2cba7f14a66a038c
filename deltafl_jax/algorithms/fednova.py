"""FedNova (Wang, Liu, Liang, Joshi, Poor, *Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization*, NeurIPS 2020): federated averaging of normalised
updates, so that clients that take different numbers of local steps in a round do not pull the
model towards the objective weighted by their step counts.

Read from the authors' code: JYWa/FedNova at commit 47b4e096dfb19dc43c728896fff335a5befb645d
(``distoptim/FedNova.py``: ``FedNova.step`` and ``FedNova.average``; ``train_LocalSGD.py``).

In round t every sampled client k trains from w_t with the run's client optimizer for its own
tau_k local steps (its local epochs of its n_k examples, or ``--local_steps``, or fewer when
the round's clock caps its work) and keeps, beside its model, its **norm vector** a_k
(the paper's ||a_i||_1, ``local_normalizing_vec`` in the code), counted one local step at a time
in the client update's step state (:class:`NovaStep`):

- plain SGD (``--client_optimizer=sgd``): a_k = tau_k;
- heavy-ball momentum rho (``--client_optimizer=momentum``, v <- rho v + g, w <- w - gamma v,
  v_0 = 0 at each job): c_j = rho c_{j-1} + 1, a_k = sum_{j=1..tau_k} c_j
  = sum_j (1 - rho^j) / (1 - rho), the sum of the weights that w_t - w_k gives the tau_k
  gradients.

It sends its normalised update u_k = (w_k - w_t) / a_k = -gamma d_k (``client_final``'s
update; d_k the paper's normalised gradient) and (tau_k, a_k) as its output. The server takes,
with p_k = n_k / sum_S n (``--weighting=unweighted``: 1 / |S|) over the sampled clients whose
update is finite,

    tau_eff = sum_k p_k a_k,    Delta = tau_eff sum_k p_k u_k,

i.e. the paper's normalised averaging w_{t+1} = w_t - gamma tau_eff sum_k p_k d_k,

and the round's server optimizer applies Delta: the default w + Delta is the paper's and the
code's plain step; ``--server_optimizer=momentum --server_momentum=beta --server_lr=1`` is the
code's global momentum ``gmf`` = beta (its buffer v <- beta v + Delta / gamma, w <- w - gamma v
is v <- beta v + Delta, w <- w + v while gamma is constant). The L2 term (``--l2_reg``) is part
of each gradient, as the code's ``weight_decay``; it does not change a_k.

When every tau_k is equal, a_k is the same for every client and Delta is FedAvg's average
sum_k p_k (w_k - w_t) (up to rounding: the update is divided by a_k and multiplied back).

**Not offered.** FedNova refuses ``--client_optimizer=adam`` and ``adagrad`` (the paper and the
code give no a_k for them) and ``--dp_clip`` (no private version). Its cohort is FedAvg's:
every sampled client trains (theta = 1); Delta-FL's filter (theta < 1) is refused with one
line, since the code and the paper weigh the clients by p_k alone. The code's FedProx variant
(``mu`` > 0: a_k = sum_j (1 - gamma mu)^j, tau_eff = sum_k p_k tau_k) is not implemented. The
authors train every client each round with p_k = n_k / n; with a sampled cohort p_k is
renormalised over it, as FedAvg's weights are here.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.deltafl import (THETA_SWEEP, WEIGHTING, DeltaFLHyper, check_thetas,
                                            theta_one)
from deltafl_jax.algorithms.fedavg import size_weights
from deltafl_jax.algorithms.options import check_options
from deltafl_jax.algorithms.protocol import FederatedAlgorithm, average_delta, no_state
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients, Grid, Reporting
from deltafl_jax.engine.client import (ClientUpdate, LocalState, difference, local_init,
                                       local_step)
from deltafl_jax.errors import ConfigError

# The client optimizers whose norm vector a_k the paper and the authors' code define.
OPTIMIZERS = ("sgd", "momentum")


@dataclasses.dataclass(frozen=True)
class FedNovaOptions:
    """``weighting``: Delta-FL's option (the same flag, default and check): p_k = n_k / sum n
    (weighted) or uniform over the cohort (unweighted)."""

    weighting: str = WEIGHTING.field()


class NovaStep(NamedTuple):
    """The step state of FedNova's client update.

    local: the local model and the client optimizer's state.
    steps: [] int32, tau_k: the local steps taken so far.
    counter: [] float32, c_j = rho c_{j-1} + 1 (1 with plain SGD).
    norm: [] float32, a_k so far: the sum of the c_j.
    """

    local: LocalState
    steps: jax.Array
    counter: jax.Array
    norm: jax.Array


class NovaOutput(NamedTuple):
    """What a client sends beside its update: its local steps tau_k and its norm vector a_k."""

    steps: jax.Array
    norm: jax.Array


def normalised_update(momentum: float) -> ClientUpdate:
    """Local training with the run's client optimizer (momentum rho = `momentum`, 0 for
    plain SGD) that counts tau_k and a_k and returns (w_k - w_t) / a_k."""
    rho = float(momentum)

    def init(server_state, client_state, params, hyper, job):
        return NovaStep(local=local_init(server_state, client_state, params, hyper, job),
                        steps=jnp.int32(0), counter=jnp.float32(0.0), norm=jnp.float32(0.0))

    def step(state, grad_fn, hyper, job):
        counter = rho * state.counter + 1.0
        return NovaStep(local=local_step(state.local, grad_fn, hyper, job),
                        steps=state.steps + 1, counter=counter, norm=state.norm + counter)

    def final(state, client_state, params, hyper, job):
        del hyper, job
        a = state.norm
        inv = jnp.where(a > 0, 1.0 / jnp.where(a > 0, a, 1.0), 0.0)
        update = jax.tree.map(lambda d: (d * inv).astype(d.dtype),
                              difference(state.local.params, params))
        return client_state, update, NovaOutput(steps=state.steps, norm=a)

    return ClientUpdate(init=init, step=step, final=final)


def nova_delta(params, feedback):
    """(Delta, tau_eff) of the normalised averaging from the round's feedback: p_k the aggregation weights of the
    clients whose update is finite, u_k their normalised updates, a_k their norm vectors
    (``client_outputs.norm``); Delta = tau_eff sum p_k u_k / sum p_k with tau_eff = sum p_k a_k
    / sum p_k (zero when no update is finite)."""
    p = jnp.where(feedback.job_finite, feedback.weights, 0.0)
    total = jnp.sum(p)
    tau_eff = jnp.where(total > 0, jnp.sum(p * feedback.client_outputs.norm)
                        / jnp.where(total > 0, total, 1.0), 0.0)
    mean = average_delta(params, feedback)
    return jax.tree.map(lambda d: (tau_eff * d).astype(d.dtype), mean), tau_eff


def fednova(momentum: float = 0.0, options: FedNovaOptions = FedNovaOptions()
            ) -> FederatedAlgorithm:
    """FedNova with the client optimizer's momentum rho (0: plain SGD)."""
    check_options(options)
    client_weights = size_weights(options.weighting)   # p_k, as FedAvg's

    def server_update(state, params, feedback, hyper):
        del hyper
        delta, tau_eff = nova_delta(params, feedback)
        steps = jnp.where(feedback.job_finite, feedback.client_outputs.steps, 0)
        kept = jnp.maximum(jnp.sum(feedback.job_finite), 1)
        return delta, state, {"tau_eff": tau_eff,
                              "local_steps_mean": jnp.sum(steps) / kept}

    return FederatedAlgorithm(name="fednova", init=no_state, client_weights=client_weights,
                              server_update=server_update, uses_losses=False,
                              client_update=normalised_update(momentum))


def client_momentum(config) -> float:
    """rho of the run's client optimizer: --client_momentum with momentum, 0 with SGD."""
    return float(config.client.momentum) if config.client.name == "momentum" else 0.0


def validate(config) -> None:
    """--thetas in (0, 1], and a client optimizer whose norm vector is known."""
    check_thetas(config)
    if config.client.name not in OPTIMIZERS:
        raise ConfigError(
            f"--algorithm=fednova normalises each update by its local solver's norm vector, "
            f"which the paper gives for --client_optimizer=sgd or momentum; got "
            f"--client_optimizer={config.client.name}")


SPEC = AlgorithmSpec(
    name="fednova", display_name="FedNova",
    help="FedNova: each client's update normalised by its local steps (its norm vector a_k), "
    "scaled by tau_eff = sum p_k a_k",
    factory=lambda config, data, options: fednova(client_momentum(config), options),
    hyper=DeltaFLHyper, sweep=THETA_SWEEP, validate=validate, options_type=FedNovaOptions,
    grid=Grid(values=theta_one("fednova", "trains every sampled client (theta = 1)"),
              fixed_sweep=True),
    reporting=Reporting(names_value=False), clients=Clients(variable_cohort=True))
