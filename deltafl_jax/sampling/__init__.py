"""Who takes part in a round, decided on the host from the seed: which clients are online
(availability) and which of them the server chooses (the sampler)."""
