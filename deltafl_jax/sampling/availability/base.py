"""What every availability model is: the online sets of a run's rounds, and the declaration a
model's module makes once (its name, its settings group, what it needs and gives, its build).

A model is one module of :mod:`deltafl_jax.sampling.availability` whose ``MODEL`` is a
subclass of :class:`Availability`. The class is both the model's declaration, read by the run
without naming the model (class attributes and the class methods :meth:`~Availability.check`,
:meth:`~Availability.needs_labels` and :meth:`~Availability.build`), and what its build
returns: an object asked who is online in round r of seed s (:meth:`~Availability.online`).
The package collects the models and merges their settings groups into the one flat group
:class:`~deltafl_jax.sampling.availability.AvailabilitySettings` (``--availability`` and its
flags; docs/guides/availability.md, "Adding an availability model").

Every draw is NumPy's from a ``SeedSequence`` key of four words whose third word is one of the
stream ids below (0xA7A1..0xA7A3) and whose fourth is >= 1. A SeedSequence key pads with
zeros, so no three-word key of the project (:mod:`deltafl_jax.sampling.plan`'s
``[seed, round, 0..4]``, the evaluation sample's, the synthetic clients') equals one here, and
no other four-word key has these third words:

- ``[seed, round, STREAM, word]``: the round's draws (a Bernoulli round, a Markov step);
- ``[seed, 0, SEED_STREAM, word]``: a seed's draws made once (Markov's start, cyclic phases);
- ``[availability_seed, 0, MODEL_STREAM, what]``: draws of the model itself, the same for
  every seed of the run (the Dirichlet weights of data-correlated probabilities, the
  assignment of clients to traces by seed), so :meth:`Availability.rates` needs no seed.

`word` is the model's own (:attr:`Availability.word`, distinct across models: the package
refuses two models of one word).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import numpy as np

STREAM = 0xA7A1        # [seed, round, STREAM, word]: a round's draws
SEED_STREAM = 0xA7A2   # [seed, 0, SEED_STREAM, word]: a seed's draws made once
MODEL_STREAM = 0xA7A3  # [availability_seed, 0, MODEL_STREAM, what]: the model's own draws


def flag_text(name: str, value) -> str:
    """``--name=value`` as an error message writes it (a float by ``%g``)."""
    return f"--{name}={value:g}" if isinstance(value, float) else f"--{name}={value}"


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """The settings of a model that has no flags of its own."""


@dataclasses.dataclass(frozen=True)
class Population:
    """The clients a model is built over: num_clients N; sizes [N] int64 their example
    counts; label_counts [N, C] int64 their examples per label (None: the model does not read
    them, :meth:`Availability.needs_labels`, or the data has no labels); num_rounds the run's
    rounds T."""

    num_clients: int
    sizes: np.ndarray
    label_counts: Optional[np.ndarray]
    num_rounds: int


class Availability:
    """Who of the N training clients is online in each round of one seed's run; subclassed by
    each model, whose class attributes declare it.

    name: ``--availability``'s value. summary: its line in the flag's help. position: its
    place in listings (the flag's choices and help, the flag reference), low first.
    settings: its own settings group (a frozen dataclass of
    :func:`deltafl_jax.declared.setting` fields whose flags start with ``availability_``;
    :class:`NoSettings` for none), merged into AvailabilitySettings. word: the fourth word of
    its streams' keys (module docstring). everyone: every client is online every round, so a
    run draws no online sets (``always``). replays: the online sets are the same for every
    seed (a file replayed: a schedule, a trace), so a round's probabilities are exact means
    over the run's rounds (:func:`deltafl_jax.run.resolve.participation_probabilities`).
    covers_test: the model can be built over the test devices too, so that their errors are
    split by availability (a schedule covers the training clients only).

    The base class's online sets are everyone's."""

    name = ""
    summary = ""
    position = 100
    settings: type = NoSettings
    word = 0
    everyone = False
    replays = False
    covers_test = True

    def __init__(self, num_clients: int):
        self.num_clients = int(num_clients)

    # ---- the declaration: read from the class, before anything is built

    @classmethod
    def check(cls, settings: Any) -> None:
        """ConfigError (one line naming the flag) for settings this model cannot run with,
        checked when it is the chosen model (a file it needs and was not given); the model's
        settings group checks its own values whatever the model."""
        del settings

    @classmethod
    def needs_labels(cls, settings: Any) -> bool:
        """Whether :meth:`build` reads the clients' label counts under `settings`."""
        del settings
        return False

    @classmethod
    def build(cls, settings: Any, clients: Population) -> "Availability":
        """The model over `clients` under `settings` (the run's AvailabilitySettings);
        ConfigError or DataError (one line) when it cannot run (a bad file, a probability
        outside [0, 1], no client online in any round)."""
        raise NotImplementedError(f"availability model {cls.name!r} has no build")

    # ---- a built model: asked round by round

    def online(self, seed: int, round_idx: int) -> np.ndarray:
        """Sorted int64 ids in [0, N) of the clients online in round `round_idx` of seed
        `seed`'s run; a pure function of (seed, round) for stateless models. Stateful models
        (markov) are called for one seed in increasing round order from 0, or from the round
        after the one their `restore`d state ends at (any other order is recomputed from
        round 0)."""
        del seed, round_idx
        return np.arange(self.num_clients, dtype=np.int64)

    def rates(self) -> np.ndarray:
        """[N] float64: each client's probability of being online in a round under the
        model's law (a schedule or trace: its empirical rate over the rounds of the run)."""
        return np.ones(self.num_clients, np.float64)

    def state(self, seed: int) -> Dict[str, np.ndarray]:
        """What a resumed run needs to go on bit for bit: {} for a stateless model."""
        del seed
        return {}

    def restore(self, seed: int, state: Dict[str, np.ndarray], next_round: int) -> None:
        """Take up `state` (from :meth:`state`) so that the next round asked is
        `next_round`; a stateless model has nothing to restore."""
        del seed, state, next_round
