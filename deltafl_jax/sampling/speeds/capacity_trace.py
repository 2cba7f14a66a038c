"""``--client_speed=capacity_trace``: FedScale's ``client_device_capacity``
(SymbioticLab/FedScale, benchmark/dataset/data/device_info/README.md): a pickle
``{client_id: {'computation': c, 'communication': b}}`` with c the device's inference latency
in milliseconds per sample (AI-Benchmark) and b its bandwidth in kbit/s (MobiPerf). Client i
gets the entry at position i mod T of the file's T entries (``--client_speed_assign=modulo``)
or perm[i mod T] for a permutation drawn from the data seed (``seed``; word 5 of the stream).
(FedScale's aggregator gives its client c, counted from 1, the entry whose key is c mod T.)
The pickle is read with the data-only unpickler of :mod:`deltafl_jax.sampling.traces`.

A trace's computation is an inference latency; a training step's forward and backward pass
cost about three forward passes, so FedScale multiplies it by ``augmentation_factor`` = 3 and
divides by 1000 (ms -> s). It is kept (``--client_speed_train_factor``, 3): per_example_s =
3 c / 1000. A kbit/s is 128 bytes a second (FedScale's kbit of 1024 bits), so a trace
device's communication time is FedScale's to the bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from deltafl_jax.declared import finite_in, setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.speeds.base import BYTES_PER_KBPS, STREAM, DeviceSpeeds, check_ids
from deltafl_jax.sampling.speeds.uniform import check_positive
from deltafl_jax.sampling.traces import read_pickle

ASSIGNMENTS = ("modulo", "seed")
TRACE_TRAIN_FACTOR = 3.0        # FedScale's augmentation_factor
_ASSIGN = 5                     # the word of the assignment's key


@dataclasses.dataclass(frozen=True)
class CapacityTraceSettings:
    """The trace's file, its factor from inference to training, the clients' devices."""

    client_speed_trace: str = setting(
        "", "--client_speed=capacity_trace: FedScale's client_device_capacity pickle "
        "{client_id: {'computation': ms per sample (inference), 'communication': kbit/s}}")
    client_speed_train_factor: float = setting(
        TRACE_TRAIN_FACTOR, "capacity_trace: training seconds per example = this x the "
        "trace's inference ms per sample / 1000 (FedScale's augmentation_factor 3: backward "
        "about twice forward)")
    client_speed_assign: str = setting(
        "modulo", "capacity_trace: client i gets the trace entry i mod T in the file's order "
        "(modulo) or perm[i mod T] for a permutation drawn from the data seed (seed)",
        choices=ASSIGNMENTS)

    def check(self) -> None:
        check_positive(self, "client_speed_train_factor")


class TraceSpeeds(DeviceSpeeds):
    """Client i replays device assign[i] of a capacity trace: per-example seconds and bytes a
    second per trace device."""

    name = "capacity_trace"
    summary = "capacity_trace (--client_speed_trace)"
    position = 3
    settings = CapacityTraceSettings

    @classmethod
    def check(cls, settings) -> None:
        if not settings.client_speed_trace:
            raise ConfigError("--client_speed=capacity_trace needs --client_speed_trace=PATH")

    @classmethod
    def build(cls, settings, num_clients: int, data_seed: int) -> "TraceSpeeds":
        _, compute_ms, kbps = load_capacity_trace(settings.client_speed_trace)
        assign = trace_assignment(settings.client_speed_assign, num_clients, compute_ms.size,
                                  data_seed)
        return cls(settings.client_speed_train_factor * compute_ms / 1000.0,
                   kbps * BYTES_PER_KBPS, assign)

    def __init__(self, example_s: np.ndarray, bandwidth_Bps: np.ndarray, assign: np.ndarray):
        super().__init__(assign.size, 0.0, 0.0)
        self.device_example_s = np.asarray(example_s, np.float64)
        self.device_bandwidth = np.asarray(bandwidth_Bps, np.float64)
        self.assign = np.asarray(assign, np.int64)

    def per_example_s(self, ids: np.ndarray) -> np.ndarray:
        return self.device_example_s[self.assign[check_ids(ids, self.num_clients)]]

    def bandwidth_Bps(self, ids: np.ndarray) -> np.ndarray:
        return self.device_bandwidth[self.assign[check_ids(ids, self.num_clients)]]


def _positive(entry, key, field: str, path: str) -> float:
    value = entry.get(field) if isinstance(entry, dict) else None
    try:
        value = float(value)
    except (TypeError, ValueError):
        value = float("nan")
    if not finite_in(value, 0.0, low_open=True):
        raise ConfigError(f"--client_speed_trace={path}: device {key!r} needs a '{field}' "
                          f"> 0, got {entry.get(field) if isinstance(entry, dict) else entry!r}")
    return value


def load_capacity_trace(path: str):
    """(keys, computation ms per sample [T], communication kbit/s [T]) of FedScale's
    client_device_capacity pickle, in the file's order; ConfigError (one line) for a file
    that cannot be read, does not parse, is empty or holds a bad entry."""
    data = read_pickle(path, "client_speed_trace", "a FedScale client_device_capacity pickle",
                       ConfigError)
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"--client_speed_trace={path}: a capacity trace is a non-empty dict "
                          f"{{client_id: {{'computation': ms, 'communication': kbps}}}}")
    keys = list(data)
    compute = np.array([_positive(data[k], k, "computation", path) for k in keys])
    kbps = np.array([_positive(data[k], k, "communication", path) for k in keys])
    return keys, compute, kbps


def trace_assignment(assign: str, num_clients: int, num_devices: int,
                     data_seed: int) -> np.ndarray:
    """[N] the trace device (position in the file) of each client: i mod T, or perm[i mod T]
    for a permutation drawn from the data seed."""
    index = np.arange(num_clients, dtype=np.int64) % num_devices
    if assign == "modulo":
        return index
    rng = np.random.default_rng([int(data_seed), 0, STREAM, _ASSIGN])
    return rng.permutation(num_devices)[index]


MODEL = TraceSpeeds
