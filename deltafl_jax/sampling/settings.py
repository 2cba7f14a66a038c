"""The ``Sampling`` settings group (``--client_sampling``) and the samplers it names.

:data:`SAMPLERS` maps each ``--client_sampling`` value to its class
(:mod:`deltafl_jax.sampling.samplers`); :meth:`Sampling.build` makes the run's sampler (each class's
``build``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Type

from deltafl_jax.declared import setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.samplers import CyclicSampler, FixedSampler, PoissonSampler, Sampler

# --client_sampling's values, in the flag's order: each names one Sampler class.
SAMPLERS: Dict[str, Type[Sampler]] = {c.name: c for c in (FixedSampler, PoissonSampler,
                                                           CyclicSampler)}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the server picks a round's clients among the online ones.

    sampler: fixed | poisson | cyclic (--client_sampling; :data:`SAMPLERS`).
    """

    sampler: str = setting(
        "fixed", "fixed: m distinct clients drawn uniformly each round | poisson: each client "
        "joins a round independently with probability q = m / N (DP's add-or-remove "
        "accounting) | cyclic: G = N // m fixed groups of m, round t trains group t mod G "
        "(DP-FTRL's participation)", flag="client_sampling", choices=tuple(SAMPLERS))

    def check(self) -> None:
        """ConfigError naming the flag at fault."""
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"--client_sampling must be one of {', '.join(SAMPLERS)}, got "
                              f"{self.sampler!r}")

    @property
    def variable(self) -> bool:
        """The sampler's cohorts vary in size (empty slots) with every client online."""
        return SAMPLERS[self.sampler].variable

    def build(self, num_clients: int, m: int, *, rounds: int,
              overflow_budget: float) -> Sampler:
        """The run's sampler of m of `num_clients` clients a round (:meth:`Sampler.build`)."""
        return SAMPLERS[self.sampler].build(num_clients, m, rounds=rounds,
                                            overflow_budget=overflow_budget)
