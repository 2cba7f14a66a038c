"""Who takes part in a round, decided on the host from the seed: which clients are online
(availability) and which of them the server chooses (the sampler,
:mod:`deltafl_jax.sampling.samplers`; its settings group :class:`Sampling`)."""

from deltafl_jax.sampling.samplers import (SAMPLERS, Cohort, CyclicSampler, FixedSampler,
                                           PoissonSampler, Sampler, Sampling, WeightedSampler)

__all__ = ["Cohort", "CyclicSampler", "FixedSampler", "PoissonSampler", "Sampler",
           "WeightedSampler", "SAMPLERS", "Sampling"]
