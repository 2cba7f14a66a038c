"""Who takes part in a round, decided on the host from the seed: which clients are online
(availability) and which of them the server chooses (the sampler,
:mod:`deltafl_jax.sampling.samplers`; its settings group :class:`Sampling`)."""

from deltafl_jax.sampling.samplers import (Cohort, CyclicSampler, FixedSampler, PoissonSampler,
                                           Sampler, WeightedSampler)
from deltafl_jax.sampling.settings import SAMPLERS, Sampling

__all__ = ["Cohort", "CyclicSampler", "FixedSampler", "PoissonSampler", "Sampler",
           "WeightedSampler", "SAMPLERS", "Sampling"]
