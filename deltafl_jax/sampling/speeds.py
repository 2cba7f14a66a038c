"""How fast each client's device is: compute seconds per example and network bandwidth.

A device's job in a synchronous round or an asynchronous slot is: download the model, run its
local steps, upload its update. Its virtual duration (:func:`job_seconds`, FedScale's formula,
SymbioticLab/FedScale commit 7ec441c2, fedscale/cloud/internal/client_metadata.py
``ClientMetadata.get_completion_time``) is::

    seconds = per_example_s x examples + (download bytes + upload bytes) / bandwidth_Bps

with the whole model downloaded and uploaded (model_bytes each way). Everything here is host-side
NumPy and deterministic from the data seed.

The models (``--client_speed``; defaults in :class:`TimingSettings`):

- ``uniform``: every client computes one example in ``--client_speed_example_s`` seconds
  (0.005 s, FedScale's ``mean_seconds_per_sample``) and has ``--client_speed_kbps`` (10^4
  kbit/s, about 10 Mbit/s; an assumption, FedScale's own rates come from its trace).
- ``lognormal``: client i computes one example in example_s x max(1e-4, exp(mu + sigma Z_i))
  seconds with Z_i standard normal, mu = ``--client_speed_mu`` (1) and sigma =
  ``--client_speed_sigma`` (0.6): FedScale's ``get_completion_time_lognormal`` draws its
  device factor as ``max(0.0001, lognormal(1, tail_skew = 0.6))`` times 0.005 s a sample, and
  the defaults keep that law (median 0.005 e = 13.6 ms an example, mean 0.005 e^1.18 = 16.3
  ms). Its bandwidth is kbps x exp(sigma_b Z'_i), sigma_b = ``--client_speed_kbps_sigma`` (0.6,
  the same skew; FedScale takes bandwidth from its trace), Z'_i independent of Z_i: the median
  is ``--client_speed_kbps``.
- ``capacity_trace``: FedScale's ``client_device_capacity`` (benchmark/dataset/data/
  device_info/README.md there): a pickle ``{client_id: {'computation': c, 'communication':
  b}}`` with c the device's inference latency in milliseconds per sample (AI-Benchmark) and b
  its bandwidth in kbit/s (MobiPerf). Client i gets the entry at position i mod T of the
  file's T entries (``--client_speed_assign=modulo``) or perm[i mod T] for a permutation drawn
  from the data seed (``seed``). (FedScale's aggregator gives its client c, counted from 1, the
  entry whose key is c mod T.) The pickle is read with the data-only unpickler of
  :mod:`deltafl_jax.sampling.traces`.

The constant factors kept from FedScale:

- a trace's computation is an inference latency; a training step's forward and backward pass
  cost about three forward passes, so FedScale multiplies it by ``augmentation_factor`` = 3
  and divides by 1000 (ms -> s). It is kept (``--client_speed_train_factor``, 3): per_example_s
  = 3 c / 1000. The generated models' example_s is already a training time (FedScale's
  lognormal model applies no such factor), so it is not applied to them.
- FedScale counts the model's size in kbit as bytes x 8 / 1024 and divides it by the trace's
  kbit/s, so one kbit/s is 1024 / 8 = 128 bytes a second here: bandwidth_Bps = 128 kbps, and a
  trace device's communication time is FedScale's to the bit.
- download and upload are both the whole model (FedScale's upload_size = download_size =
  the model's size), hence the 2 model_bytes of :func:`job_seconds`.

Generated speeds need no table: client i's normal draws are a counter-based hash of its id,
keyed by the data seed, so asking any k ids costs O(k) whatever N (10^6 host-kept clients) and
the same id gets the same speed whichever other ids are asked with it. The keys are words of
``SeedSequence([data_seed, 0, STREAM, what])`` (STREAM is this module's, so no key elsewhere in
the project equals them); a draw is SplitMix64's finaliser of key + golden x (id + 1) (Steele,
Lea and Flood 2014), two such 53-bit uniforms give one normal by Box and Muller's transform.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from deltafl_jax.declared import finite_in, setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.traces import read_pickle

STREAM = 0x5BD1   # [data_seed, 0, STREAM, what]: the keys of the generated speeds

MODELS = ("none", "uniform", "lognormal", "capacity_trace")
ASSIGNMENTS = ("modulo", "seed")

BYTES_PER_KBPS = 1024.0 / 8.0   # FedScale's kbit: 1024 bits
TRACE_TRAIN_FACTOR = 3.0        # FedScale's augmentation_factor
LOGNORMAL_FLOOR = 1e-4          # FedScale's max(0.0001, device factor)

# Words of the keys: two uniforms per normal, one normal for compute, one for bandwidth.
_COMPUTE, _BANDWIDTH, _ASSIGN = (1, 2), (3, 4), 5

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _flag(name: str, value) -> str:
    return f"--{name}={value:g}" if isinstance(value, float) else f"--{name}={value}"


@dataclasses.dataclass(frozen=True)
class TimingSettings:
    """Device speeds and the virtual clock of the rounds (module docstring;
    :mod:`deltafl_jax.sampling.clock`)."""

    client_speed: str = setting(
        "none", "each client's device speed, which puts rounds on a virtual clock: none (no "
        "clock) | uniform (every client --client_speed_example_s and --client_speed_kbps) | "
        "lognormal (FedScale's: example_s x exp(mu + sigma Z) an example, kbps x exp(sigma_b "
        "Z')) | capacity_trace (--client_speed_trace)", choices=MODELS)
    client_speed_trace: str = setting(
        "", "--client_speed=capacity_trace: FedScale's client_device_capacity pickle "
        "{client_id: {'computation': ms per sample (inference), 'communication': kbit/s}}")
    client_speed_example_s: float = setting(
        0.005, "uniform, lognormal: seconds of training compute per example (lognormal: "
        "times exp(mu + sigma Z)); FedScale's mean_seconds_per_sample")
    client_speed_mu: float = setting(
        1.0, "lognormal: mu of the device factor exp(mu + sigma Z) (FedScale's 1)")
    client_speed_sigma: float = setting(
        0.6, "lognormal: sigma of the compute factor (FedScale's tail_skew 0.6)")
    client_speed_kbps: float = setting(
        10000.0, "uniform, lognormal: the bandwidth in kbit/s (1 kbit = 1024 bits, as "
        "FedScale), the median under lognormal")
    client_speed_kbps_sigma: float = setting(
        0.6, "lognormal: sigma of the bandwidth factor exp(sigma_b Z')")
    client_speed_train_factor: float = setting(
        TRACE_TRAIN_FACTOR, "capacity_trace: training seconds per example = this x the "
        "trace's inference ms per sample / 1000 (FedScale's augmentation_factor 3: backward "
        "about twice forward)")
    client_speed_assign: str = setting(
        "modulo", "capacity_trace: client i gets the trace entry i mod T in the file's order "
        "(modulo) or perm[i mod T] for a permutation drawn from the data seed (seed)",
        choices=ASSIGNMENTS)
    round_deadline: Optional[float] = setting(
        None, "seconds of virtual time a synchronous round waits: clients not finished by "
        "then are dropped (or keep their partial work, --partial_work)", kind="float")
    partial_work: bool = setting(
        False, "with --round_deadline: a client past the deadline keeps the local steps it "
        "completed and uploaded by then (dropped if none)")
    over_select: float = setting(
        1.0, "sample ceil(r m) clients and keep the m first to finish (ties by client id)")
    stop_at_virtual_time: Optional[float] = setting(
        None, "end the run at the first round that ends at or after this many virtual "
        "seconds", kind="float")
    mean_online_seconds: Optional[float] = setting(
        None, "clients go offline in the middle of a job: an online client's remaining online "
        "session is exponential with this mean (seconds of virtual time), so a job of d "
        "seconds survives with probability exp(-d / mean); a lost job is not aggregated; "
        "unset: a started job always finishes", kind="float")

    def check(self) -> None:
        """ConfigError (one line naming the flag) for a setting that cannot run."""
        if self.client_speed not in MODELS:
            raise ConfigError(f"--client_speed must be one of {', '.join(MODELS)}, got "
                              f"{self.client_speed!r}")
        if self.client_speed == "capacity_trace" and not self.client_speed_trace:
            raise ConfigError("--client_speed=capacity_trace needs --client_speed_trace=PATH")
        for name in ("client_speed_example_s", "client_speed_kbps",
                     "client_speed_train_factor"):
            if not finite_in(getattr(self, name), 0.0, low_open=True):
                raise ConfigError(f"{_flag(name, getattr(self, name))}: must be > 0")
        for name in ("client_speed_sigma", "client_speed_kbps_sigma"):
            if not finite_in(getattr(self, name), 0.0):
                raise ConfigError(f"{_flag(name, getattr(self, name))}: must be >= 0")
        if not finite_in(self.client_speed_mu):
            raise ConfigError(f"{_flag('client_speed_mu', self.client_speed_mu)}: must be "
                              f"a finite number")
        self._check_clock()

    def _check_clock(self) -> None:
        for name in ("round_deadline", "stop_at_virtual_time", "mean_online_seconds"):
            value = getattr(self, name)
            if value is not None and not finite_in(value, 0.0, low_open=True):
                raise ConfigError(f"{_flag(name, float(value))}: must be > 0 seconds")
        if not finite_in(self.over_select, 1.0):
            raise ConfigError(f"{_flag('over_select', float(self.over_select))}: must be >= 1")
        if self.partial_work and self.round_deadline is None:
            raise ConfigError("--partial_work needs --round_deadline (the time at which work "
                              "stops)")
        if not self.active:
            for name, off in (("round_deadline", None), ("stop_at_virtual_time", None),
                              ("over_select", 1.0), ("mean_online_seconds", None)):
                if getattr(self, name) != off:
                    raise ConfigError(f"--{name} needs a virtual clock: give --client_speed="
                                      f"uniform|lognormal|capacity_trace")

    @property
    def active(self) -> bool:
        """Whether rounds run on a virtual clock (False: --client_speed=none)."""
        return self.client_speed != "none"

    def slots(self, m: int) -> int:
        """M = ceil(over_select x m), the slots sampled for m kept clients."""
        return int(math.ceil(self.over_select * m - 1e-9))


def _check_ids(ids, num_clients: int) -> np.ndarray:
    ids = np.asarray(ids, np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= num_clients)):
        raise ValueError(f"client ids must be a 1-D array of ids in [0, {num_clients})")
    return ids


class DeviceSpeeds:
    """Per-client device speed: compute seconds per example and network bytes per second.

    The base class is ``uniform``: every client the same."""

    name = "uniform"

    def __init__(self, num_clients: int, example_s: float, bandwidth_Bps: float):
        self.num_clients = int(num_clients)
        self.example_s = float(example_s)
        self.bandwidth = float(bandwidth_Bps)

    def per_example_s(self, ids: np.ndarray) -> np.ndarray:
        """[k] float64 > 0: seconds of training compute per example of clients `ids`."""
        return np.full(_check_ids(ids, self.num_clients).shape, self.example_s)

    def bandwidth_Bps(self, ids: np.ndarray) -> np.ndarray:
        """[k] float64 > 0: bytes a second, download and upload, of clients `ids`."""
        return np.full(_check_ids(ids, self.num_clients).shape, self.bandwidth)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (uint64 arithmetic wraps modulo 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def stream_keys(data_seed: int, count: int) -> np.ndarray:
    """[count + 1] uint64 keys: word w of SeedSequence([data_seed, 0, STREAM, 0])."""
    return np.random.SeedSequence([int(data_seed), 0, STREAM, 0]).generate_state(
        count + 1, np.uint64)


def hashed_uniform(key: np.uint64, ids: np.ndarray) -> np.ndarray:
    """[k] float64 in (0, 1]: a uniform per id, a pure function of (key, id)."""
    x = _mix64(np.uint64(key) + _GOLDEN * (ids.astype(np.uint64) + np.uint64(1)))
    return ((x >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53


def hashed_normal(keys: np.ndarray, words, ids: np.ndarray) -> np.ndarray:
    """[k] standard normal draws per id (Box-Muller of two hashed uniforms)."""
    u1 = hashed_uniform(keys[words[0]], ids)
    u2 = hashed_uniform(keys[words[1]], ids)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


class LognormalSpeeds(DeviceSpeeds):
    """example_s x max(1e-4, exp(mu + sigma Z_i)) seconds an example, bandwidth x
    exp(sigma_b Z'_i) bytes a second, Z_i, Z'_i hashed from the data seed and the id."""

    name = "lognormal"

    def __init__(self, num_clients: int, example_s: float, bandwidth_Bps: float, *,
                 mu: float, sigma: float, bandwidth_sigma: float, data_seed: int):
        super().__init__(num_clients, example_s, bandwidth_Bps)
        self.mu, self.sigma, self.bandwidth_sigma = float(mu), float(sigma), float(bandwidth_sigma)
        self.keys = stream_keys(data_seed, _ASSIGN)

    def per_example_s(self, ids: np.ndarray) -> np.ndarray:
        ids = _check_ids(ids, self.num_clients)
        z = hashed_normal(self.keys, _COMPUTE, ids)
        return self.example_s * np.maximum(LOGNORMAL_FLOOR, np.exp(self.mu + self.sigma * z))

    def bandwidth_Bps(self, ids: np.ndarray) -> np.ndarray:
        ids = _check_ids(ids, self.num_clients)
        z = hashed_normal(self.keys, _BANDWIDTH, ids)
        return self.bandwidth * np.exp(self.bandwidth_sigma * z)


class TraceSpeeds(DeviceSpeeds):
    """Client i replays device assign[i] of a capacity trace: per-example seconds and bytes a
    second per trace device."""

    name = "capacity_trace"

    def __init__(self, example_s: np.ndarray, bandwidth_Bps: np.ndarray, assign: np.ndarray):
        super().__init__(assign.size, 0.0, 0.0)
        self.device_example_s = np.asarray(example_s, np.float64)
        self.device_bandwidth = np.asarray(bandwidth_Bps, np.float64)
        self.assign = np.asarray(assign, np.int64)

    def per_example_s(self, ids: np.ndarray) -> np.ndarray:
        return self.device_example_s[self.assign[_check_ids(ids, self.num_clients)]]

    def bandwidth_Bps(self, ids: np.ndarray) -> np.ndarray:
        return self.device_bandwidth[self.assign[_check_ids(ids, self.num_clients)]]


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


def build_speeds(settings: TimingSettings, *, num_clients: int,
                 data_seed: int) -> Optional[DeviceSpeeds]:
    """The run's device speeds (None: --client_speed=none). A capacity trace is read here
    (ConfigError naming the file when it cannot be used)."""
    settings.check()
    if not settings.active:
        return None
    bandwidth = settings.client_speed_kbps * BYTES_PER_KBPS
    if settings.client_speed == "uniform":
        return DeviceSpeeds(num_clients, settings.client_speed_example_s, bandwidth)
    if settings.client_speed == "lognormal":
        return LognormalSpeeds(num_clients, settings.client_speed_example_s, bandwidth,
                               mu=settings.client_speed_mu, sigma=settings.client_speed_sigma,
                               bandwidth_sigma=settings.client_speed_kbps_sigma,
                               data_seed=data_seed)
    _, compute_ms, kbps = load_capacity_trace(settings.client_speed_trace)
    assign = trace_assignment(settings.client_speed_assign, num_clients, compute_ms.size,
                              data_seed)
    return TraceSpeeds(settings.client_speed_train_factor * compute_ms / 1000.0,
                       kbps * BYTES_PER_KBPS, assign)


def job_seconds(speeds: DeviceSpeeds, ids: np.ndarray, examples: np.ndarray,
                model_bytes: int) -> np.ndarray:
    """[k] virtual seconds of clients `ids`' jobs of `examples` [k] examples each:
    per_example_s x examples + 2 model_bytes / bandwidth_Bps.

    FedScale's formula (``get_completion_time``): compute per example times the examples
    processed, plus the model's download and its upload, each the whole model, over the
    device's bandwidth. Of FedScale's constant factors, the factor 3 from inference to
    training time is kept in a capacity trace's per_example_s (the trace measures inference;
    --client_speed_train_factor), and its kbit of 1024 bits in the bytes a second of a kbit/s
    (so a trace device's times are FedScale's); no other factor is applied here."""
    ids = np.asarray(ids, np.int64)
    examples = np.asarray(examples, np.float64)
    transfer = 2.0 * float(model_bytes) / speeds.bandwidth_Bps(ids)
    return speeds.per_example_s(ids) * examples + transfer
