"""What the tail leaderboard (``python -m experiments.leaderboard``) must know of an algorithm:
one :class:`Board` in its spec (``spec.reporting.leaderboard``; None: not a leaderboard
method, e.g. a control such as FedAvg-Sub or a variant of another method).

The leaderboard runs every spec with a board that applies to a dataset, tunes its parameters
on held-out training clients by the 90th percentile of the error (the papers' protocol) and
tabulates the tail; a method added later joins it by declaring its board.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, NamedTuple, Optional, Tuple


class BoardSetting(NamedTuple):
    """A leaderboard dataset as a method's ``applies`` sees it."""

    dataset: str            # the dataset's name (synthetic, shakespeare, femnist, sent140)
    model: str              # the model's name
    train_clients: int      # N, training clients
    clients_per_round: int  # m


@dataclasses.dataclass(frozen=True)
class Board:
    """How the leaderboard runs one algorithm.

    grid: flag -> values tuned on the validation clients, crossed with each other: the spec's
      swept flag, a flag of its grid's ``cross``, or ``server_lr`` (the round's server learning
      rate, when the server step is the round's). Empty: nothing to tune (FedAvg, SCAFFOLD).
    quick: the grid of the CPU set (smaller, to fit its time budget); None: `grid`.
    joins: (algorithm, swept value): the method IS that algorithm at that value, and its runs
      are that algorithm's replicas, in its program (FedAvg: Delta-FL at theta = 1).
    applies: (BoardSetting) -> "" when the method applies to the dataset, else why not (one
      line); None: it applies everywhere.
    """

    grid: Mapping[str, Tuple[float, ...]] = dataclasses.field(default_factory=dict)
    quick: Optional[Mapping[str, Tuple[float, ...]]] = None
    joins: Optional[Tuple[str, float]] = None
    applies: Optional[Callable[[BoardSetting], str]] = None

    def grid_for(self, quick: bool) -> Mapping[str, Tuple[float, ...]]:
        """The grid of the CPU set (`quick`) or the full one."""
        return dict(self.quick if quick and self.quick is not None else self.grid)

    def why_not(self, setting: BoardSetting) -> str:
        """'' when the method applies to `setting`, else the reason."""
        return "" if self.applies is None else self.applies(setting)


def needs_clients(m: int) -> Callable[[BoardSetting], str]:
    """applies: at least `m` clients per round (a method that compares the sampled clients)."""
    def applies(setting: BoardSetting) -> str:
        if setting.clients_per_round < m:
            return f"it compares the sampled clients: it needs m >= {m}"
        return ""
    return applies


def population_at_most(n: int) -> Callable[[BoardSetting], str]:
    """applies: at most `n` training clients (a method that trains every one every round)."""
    def applies(setting: BoardSetting) -> str:
        if setting.train_clients > n:
            return (f"it trains every training client every round, and {setting.dataset} has "
                    f"{setting.train_clients} (> {n})")
        return ""
    return applies
