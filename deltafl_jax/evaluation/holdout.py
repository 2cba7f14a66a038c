"""Every client's own held-out data (``--client_holdout=f``), for personalised evaluation.

Δ-FL's papers evaluate the served model on devices that never trained (the test clients). A
personalised method is judged on two populations, as TFF's personalisation evaluation and
pFL-Bench do:

- **seen clients**: each training client keeps a fraction f of its examples out of training;
  its served model (its personal model, for an algorithm with per-client models) is evaluated
  on them;
- **unseen devices**: each test client splits its examples the same way into an adaptation
  part and a held-out part; the served model, adapted on the adaptation part
  (``--finetune_steps``), is evaluated on the held-out part.

Client k of n_k examples holds out h_k = min(max(1, round(f n_k)), n_k - 1) of them (f n_k
rounded half to even), drawn without replacement from the stream
``[data_seed, HOLDOUT_STREAM, split, k]`` (the same examples whatever the run's seeds); both
parts keep the client's order. A client needs at least two examples. f = 0 leaves the data as
it is, bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import numpy as np

from deltafl_jax.data import ClientData, FederatedDataset, is_generated
from deltafl_jax.errors import ConfigError

HOLDOUT_STREAM = 0x401D
_SPLITS = {"train": 0, "test": 1}


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """The held-out parts, client-aligned with the dataset's splits.

    fraction: f. train_held: the held-out examples of each training client (the dataset's
    ``train`` then holds the rest). test_adapt / test_held: each test client's adaptation and
    held-out examples (the dataset's ``test`` keeps every example, for the papers' metrics).
    """

    fraction: float
    train_held: ClientData
    test_adapt: ClientData
    test_held: ClientData

    def population(self, data: FederatedDataset, name: str) -> Tuple[ClientData, ClientData]:
        """(adaptation split, held-out split) of the population `name` ("seen": the training
        clients, adapting on their training data; "unseen": the test clients)."""
        if name == "seen":
            return data.train, self.train_held
        return self.test_adapt, self.test_held


def held_counts(sizes, fraction: float) -> np.ndarray:
    """h_k = min(max(1, round(f n_k)), n_k - 1) for each client size n_k."""
    n = np.asarray(sizes, np.int64)
    return np.minimum(np.maximum(1, np.rint(fraction * n).astype(np.int64)), n - 1)


def _split(split: ClientData, fraction: float, seed: int, which: str):
    """(kept, held) of every client of `split`."""
    h = held_counts(split.sizes, fraction)
    kept_rows, held_rows = [], []
    for k in range(split.num_clients):
        lo, n = int(split.offsets[k]), int(split.sizes[k])
        rng = np.random.default_rng([int(seed), HOLDOUT_STREAM, _SPLITS[which], k])
        held = np.zeros(n, bool)
        held[rng.choice(n, size=int(h[k]), replace=False)] = True
        kept_rows.append(lo + np.flatnonzero(~held))
        held_rows.append(lo + np.flatnonzero(held))

    def part(rows, sizes):
        idx = np.concatenate(rows)
        return ClientData(x=split.x[idx], y=None if split.y is None else split.y[idx],
                          offsets=np.concatenate([[0], np.cumsum(sizes)]),
                          client_ids=split.client_ids)

    return part(kept_rows, split.sizes - h), part(held_rows, h)


def hold_out(data: FederatedDataset, fraction: float, seed: int) -> FederatedDataset:
    """`data` with every client's held-out part set aside (module docstring); `data` itself
    when f = 0. ConfigError naming --client_holdout when it cannot be done."""
    if not fraction or (data.holdout is not None and data.holdout.fraction == fraction):
        return data        # nothing to hold out, or held out already (a built experiment's)
    if not 0 < fraction < 1:
        raise ConfigError(f"--client_holdout must be in [0, 1), got {fraction!r}")
    if data.holdout is not None:
        raise ConfigError(f"--client_holdout={fraction:g}: the data already hold out "
                          f"{data.holdout.fraction:g} of each client")
    for name, split in (("train", data.train), ("test", data.test)):
        if is_generated(split):
            raise ConfigError("--client_holdout needs the clients' examples in memory; a "
                              "population generated on demand has none (leave "
                              "--synthetic_on_demand off and use fewer clients)")
        small = np.flatnonzero(split.sizes < 2)
        if small.size:
            raise ConfigError(f"--client_holdout: {name} client {int(small[0])} has "
                              f"{int(split.sizes[small[0]])} example; each client needs at "
                              f"least 2 (raise --min_client_examples)")
    train_fit, train_held = _split(data.train, fraction, seed, "train")
    test_adapt, test_held = _split(data.test, fraction, seed, "test")
    return dataclasses.replace(data, train=train_fit, holdout=HeldOut(
        fraction=float(fraction), train_held=train_held, test_adapt=test_adapt,
        test_held=test_held))
