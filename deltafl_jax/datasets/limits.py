"""Size limits applied to any loaded dataset (for CPU-sized runs and quick experiments)."""

from __future__ import annotations

import dataclasses

import numpy as np

from deltafl_jax.data import ClientData, DataError, FederatedDataset, is_generated


def _truncate(split: ClientData, max_examples: int) -> ClientData:
    if is_generated(split):
        return split.truncated(max_examples)
    sizes = np.minimum(split.sizes, max_examples)
    idx = np.concatenate([np.arange(lo, lo + n) for lo, n in zip(split.offsets[:-1], sizes)])
    return ClientData(x=split.x[idx], y=None if split.y is None else split.y[idx],
                      offsets=np.concatenate([[0], np.cumsum(sizes)]),
                      client_ids=split.client_ids)


def choose_clients(num_clients: int, max_clients: int, seed: int) -> np.ndarray:
    """Sorted positions of the clients kept by a limit of `max_clients` (all when there are no
    more): the first `max_clients` of a permutation drawn with `seed`. Loaders that can apply
    the limits before reading (StackOverflow) use this rule, so both ways keep the same ones."""
    if num_clients <= max_clients:
        return np.arange(num_clients)
    return np.sort(np.random.default_rng(seed).permutation(num_clients)[:max_clients])


def _subsample(split: ClientData, max_clients: int, seed: int) -> ClientData:
    if split.num_clients <= max_clients:
        return split
    return split.subset(choose_clients(split.num_clients, max_clients, seed))


def check_limits(config) -> None:
    """DataError (one line naming the flag) for a limit below 1; checked before any data are
    loaded (:func:`deltafl_jax.datasets.load_dataset`)."""
    for name in ("max_examples_per_client", "max_train_clients", "max_test_clients"):
        value = getattr(config.limits, name)
        if value is not None and value < 1:
            raise DataError(f"--{name} must be at least 1, got {value}")


def apply_limits(data: FederatedDataset, config) -> FederatedDataset:
    """Keep the first `max_examples_per_client` examples of each client (the text datasets keep
    contiguous text this way) and a seeded subset of `max_train_clients` / `max_test_clients`."""
    check_limits(config)
    train, test, kept = data.train, data.test, config.limits
    if kept.max_train_clients is not None:
        train = _subsample(train, kept.max_train_clients, config.data_seed + 1)
    if kept.max_test_clients is not None:
        test = _subsample(test, kept.max_test_clients, config.data_seed + 2)
    if kept.max_examples_per_client is not None:
        train = _truncate(train, kept.max_examples_per_client)
        test = _truncate(test, kept.max_examples_per_client)
    if train is data.train and test is data.test:
        return data
    return dataclasses.replace(data, train=train, test=test)
