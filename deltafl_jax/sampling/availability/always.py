"""``--availability=always``: every client, every round (what runs did before availability
existed); a run under it draws no online sets."""

from __future__ import annotations

from deltafl_jax.sampling.availability.base import Availability, Population


class Always(Availability):
    """Every client online in every round."""

    name = "always"
    summary = "always (everyone)"
    position = 0
    everyone = True
    covers_test = False   # nothing to split the test devices by

    @classmethod
    def build(cls, settings, clients: Population) -> "Always":
        del settings
        return cls(clients.num_clients)


MODEL = Always
