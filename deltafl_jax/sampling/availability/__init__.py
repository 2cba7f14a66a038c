"""Who of the N training clients is online in each round: the availability models, one module
each, and the table the run looks them up in (``--availability``).

Availability is decided on the host, per client and round, before the server samples its
cohort among the clients online (see :mod:`deltafl_jax.sampling`). A model is a module of this
package whose ``MODEL`` is a subclass of
:class:`~deltafl_jax.sampling.availability.base.Availability` declaring its name, its
settings group, what it needs and gives and its build (the base module also gives the streams
of the draws). The package finds the models itself, so adding one is one file
(docs/guides/availability.md, "Adding an availability model"):

- :data:`TABLE`: name -> model class, every module's ``MODEL``, ordered by its ``position``;
- :class:`AvailabilitySettings`: ``--availability`` (the model's name), the clients'
  probabilities' group (:mod:`~deltafl_jax.sampling.availability.probabilities`),
  ``--availability_seed`` and every model's own group, merged into one flat group (the
  configuration's ``online``; its flags, defaults and stored names are the groups' own);
- :func:`build_availability`: the chosen model's build (a table lookup).

The shipped models (their laws are in ``docs/guides/availability.md``): ``always``
(:mod:`.always`), ``bernoulli`` (:mod:`.bernoulli`), ``markov`` (:mod:`.markov`), ``cyclic``
(:mod:`.cyclic`), ``schedule`` (:mod:`.schedule`) and ``trace`` (:mod:`.trace`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from deltafl_jax.declared import declared_models, given, group_of, merged_group, setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.availability.always import Always
from deltafl_jax.sampling.availability.base import (MODEL_STREAM, SEED_STREAM, STREAM,
                                                    Availability, Population)
from deltafl_jax.sampling.availability.bernoulli import Bernoulli
from deltafl_jax.sampling.availability.cyclic import Cyclic, CyclicLabels
from deltafl_jax.sampling.availability.markov import Markov
from deltafl_jax.sampling.availability.probabilities import ProbabilitySettings
from deltafl_jax.sampling.availability.schedule import Schedule
from deltafl_jax.sampling.availability.trace import Trace

PREFIX = "availability_"   # every model setting's flag starts with it


def discover(package: str, path) -> Tuple[type, ...]:
    """The models of `package` (:func:`deltafl_jax.declared.declared_models`: every module's
    ``MODEL``, by position then name); TypeError also for two models of one stream word."""
    found = declared_models(package, path, Availability, PREFIX)
    words: Dict[int, type] = {}
    for model in found:
        if model.word in words:
            raise TypeError(f"availability models {words[model.word].__name__} and "
                            f"{model.__name__} share the stream word {model.word}")
        if model.word:
            words[model.word] = model
    return found


TABLE: Dict[str, type] = {m.name: m for m in discover(__name__, __path__)}
MODELS: Tuple[str, ...] = tuple(TABLE)


def settings_class(table: Dict[str, type]) -> type:
    """The merged settings group of the models of `table`: ``model`` (``--availability``, one
    of the table's names), the probabilities' group, ``seed``, then each model's own group in
    the table's order, flat. When one is made, every group given other values than its
    defaults checks them (:func:`deltafl_jax.declared.given`; the chosen model's group always),
    then the chosen model its
    :meth:`~deltafl_jax.sampling.availability.base.Availability.check`; its ``chosen`` is the
    chosen model's class. TypeError when two groups declare one field differently
    (:func:`deltafl_jax.declared.merged_group`)."""
    groups = (ProbabilitySettings,) + tuple(dict.fromkeys(m.settings for m in table.values()))
    model = ("model", str, setting(
        "always", "who is online each round: " + " | ".join(m.summary for m in table.values()),
        flag="availability", choices=tuple(table)))
    seed = ("seed", int, setting(
        0, "seeds the draws of the model itself (data-correlated weights, traces assigned by "
        "seed), the same for every --seeds", flag="availability_seed"))

    def check(self) -> None:   # the groups' own checks (whatever the model), the model's
        if self.model not in table:
            raise ConfigError(f"--availability must be one of {', '.join(table)}, got "
                              f"{self.model!r}")
        chosen = table[self.model]
        for group in groups:   # a group left at its defaults (valid) is not entered
            if group is chosen.settings or given(self, group):
                group_of(self, group)
        chosen.check(self)

    return merged_group(
        "AvailabilitySettings", __name__, "Which clients are online in a round: "
        "``--availability`` and the flags of every model's settings group, merged flat (module "
        "docstring; docs/guides/availability.md).",
        (model, ProbabilitySettings, seed) + groups[1:],
        {"__post_init__": check, "chosen": property(
            lambda self: table[self.model], doc="The chosen model's class (its declaration).")})


AvailabilitySettings: Any = settings_class(TABLE)


def build_availability(settings, *, num_clients: int, sizes: np.ndarray,
                       label_counts: Optional[np.ndarray], num_rounds: int) -> Availability:
    """The availability model of a run: `settings` an :class:`AvailabilitySettings`, sizes [N]
    the training clients' example counts, label_counts [N, C] their label counts (None: no
    labels), num_rounds the run's rounds. Raises ConfigError or DataError (one line) for a
    model under which it cannot run (a bad file, a probability outside [0, 1], no client
    online in any round)."""
    return settings.chosen.build(settings, Population(
        num_clients=int(num_clients), sizes=sizes, label_counts=label_counts,
        num_rounds=int(num_rounds)))


__all__ = ["AvailabilitySettings", "Availability", "Population", "TABLE", "MODELS",
           "build_availability", "STREAM", "SEED_STREAM", "MODEL_STREAM", "Always",
           "Bernoulli", "Markov", "Cyclic", "CyclicLabels", "Schedule", "Trace"]
