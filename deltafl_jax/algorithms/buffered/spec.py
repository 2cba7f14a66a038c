"""What a buffered asynchronous rule's spec is: :func:`rule_spec`, and the checks every
asynchronous run shares (:func:`check_asynchronous`).

A rule module of this package (:mod:`deltafl_jax.algorithms.buffered`) exports one
:class:`~deltafl_jax.algorithms.spec.AlgorithmSpec` whose ``asynchronous`` field is an
:class:`~deltafl_jax.asynchronous.rule.AsyncStep`; :func:`rule_spec` writes the fields that
every rule shares: Delta-FL's hyper-parameters and theta sweep (trained at theta = 1 alone
unless the rule sweeps theta), no synchronous factory of its own (FedAvg's round is never
run: the run steps the rule's server instead), the asynchronous checks.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from deltafl_jax.algorithms.deltafl import THETA_SWEEP, DeltaFLHyper, check_thetas, theta_one
from deltafl_jax.algorithms.fedavg import fedavg
from deltafl_jax.algorithms.options import NoOptions
from deltafl_jax.algorithms.spec import AlgorithmSpec, Grid, Reporting
from deltafl_jax.asynchronous.rule import AsyncStep
from deltafl_jax.errors import ConfigError


def async_validator(step: AsyncStep) -> Callable[[Any], None]:
    """A spec's ``validate`` for `step`: the thetas (:func:`check_thetas`), then
    :func:`check_asynchronous`."""

    def validate(config) -> None:
        check_thetas(config)
        check_asynchronous(config, step)
    return validate


def check_asynchronous(config, step: AsyncStep) -> None:
    """ConfigError (one line naming the flag) for what an asynchronous run cannot combine
    with: a synchronous round's deadline and over-selection, a client sampler other than the
    scheduler's uniform draw, client-level DP (its accountant counts synchronous cohorts), a
    personalised evaluation; and its own settings (K <= C)."""
    name = config.algorithm
    t = config.timing
    flag = ("--round_deadline" if t.round_deadline is not None else "--partial_work"
            if t.partial_work else "--over_select" if t.over_select != 1.0 else None)
    if flag:
        raise ConfigError(f"{flag}: --algorithm={name} has no rounds to end by a deadline; its "
                          "clients train as slots free up (--concurrency, --buffer_size)")
    if config.sampling.sampler != "fixed":
        raise ConfigError(f"--client_sampling={config.sampling.sampler}: --algorithm={name} "
                          "starts an idle online client, uniformly, whenever a slot frees up")
    if config.privacy.enabled:
        raise ConfigError(f"--dp_clip: --algorithm={name} has no private version (the DP "
                          "accountant counts synchronous cohorts)")
    if config.personal.client_holdout > 0:
        raise ConfigError(f"--client_holdout: --algorithm={name} has no personalised "
                          "evaluation")
    step.settings(config.asynchronous).check()


def rule_spec(name: str, display_name: str, help: str, step: AsyncStep, *,
              options_type: type = NoOptions, sweeps_theta: bool = False,
              why: str = "trains every update it buffers (theta = 1)",
              reporting: Optional[Reporting] = None) -> AlgorithmSpec:
    """The spec of a buffered rule: `step` as its ``asynchronous``, its options group, and
    theta = 1 alone (a refusal saying `why` for another --thetas) unless `sweeps_theta`;
    `reporting`: how reports name it (default: by its display name alone)."""
    grid = Grid() if sweeps_theta else Grid(values=theta_one(name, why), fixed_sweep=True)
    return AlgorithmSpec(
        name=name, display_name=display_name, help=help,
        factory=lambda config, data, options: fedavg()._replace(name=name),
        hyper=DeltaFLHyper, sweep=THETA_SWEEP, options_type=options_type,
        validate=async_validator(step), grid=grid,
        reporting=reporting or Reporting(names_value=False), asynchronous=step)
