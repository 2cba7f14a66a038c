"""Each client's availability p_i (``--availability_probs``), shared by the generated models
that draw from it (bernoulli, markov, cyclic's phase window): its settings group and its laws.

- ``uniform``: p_i = ``--availability_p``.
- ``data``, as the FedAU paper's code draws it (IBM/fedau, commit 6e9cce9b, util/util.py:
  ``data_participation_each_node``): p_i = max(p_min, C p_mean <d_i, w>) with d_i client i's
  label distribution (its label counts over its examples), w ~ Dir(alpha_p 1_C) drawn once
  from ``[availability_seed, 0, MODEL_STREAM, 1]`` and C the number of labels (defaults
  p_mean 0.1, p_min 0.02, alpha_p 0.1, as there).
- ``more_data`` / ``less_data``, as FLGo's MDF / LDF modes (WwZzz/easyFL, commit 19de9fb4,
  flgo/simulator/default_simulator.py): p_i = n_i^beta / max_j n_j^beta (MDF, beta 0.0001)
  and p_i = n_i^-beta / max_j n_j^-beta (LDF, beta 0.5), n_i client i's example count.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from deltafl_jax.declared import setting
from deltafl_jax.errors import ConfigError, DataError
from deltafl_jax.sampling.availability.base import MODEL_STREAM, Population, flag_text

PROBABILITIES = ("uniform", "data", "more_data", "less_data")

# FLGo's default beta of its MDF and LDF modes.
SIZE_BETA = {"more_data": 0.0001, "less_data": 0.5}

_DIRICHLET = 1   # the word of the Dirichlet weights' MODEL_STREAM key


@dataclasses.dataclass(frozen=True)
class ProbabilitySettings:
    """Each client's availability p_i (module docstring)."""

    probabilities: str = setting(
        "uniform", "bernoulli, markov, cyclic: each client's availability p_i: uniform "
        "(--availability_p) | data (FedAU: max(p_min, C p_mean <label distribution, "
        "Dir(alpha)>)) | more_data | less_data (FLGo's MDF / LDF: n_i^(+-beta) / its max)",
        flag="availability_probs", choices=PROBABILITIES)
    p: float = setting(0.1, "--availability_probs=uniform: every client's p_i",
                       flag="availability_p")
    p_mean: float = setting(0.1, "--availability_probs=data: p_mean", flag="availability_p_mean")
    p_min: float = setting(0.02, "--availability_probs=data: p_min, the smallest p_i",
                           flag="availability_p_min")
    alpha: float = setting(0.1, "--availability_probs=data: alpha of the Dirichlet weights "
                           "over the labels", flag="availability_alpha")
    size_beta: Optional[float] = setting(
        None, "--availability_probs=more_data|less_data: beta; unset: FLGo's (0.0001 for "
        "more_data, 0.5 for less_data)", flag="availability_size_beta", kind="float")

    def __post_init__(self):
        for name, value in (("availability_p", self.p), ("availability_p_min", self.p_min)):
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{flag_text(name, value)}: a probability must be in [0, 1]")
        if not 0.0 < self.p_mean <= 1.0:
            raise ConfigError(f"{flag_text('availability_p_mean', self.p_mean)}: must be in "
                              f"(0, 1]")
        if not self.alpha > 0.0:
            raise ConfigError(f"{flag_text('availability_alpha', self.alpha)}: must be > 0")
        if self.size_beta is not None and not self.size_beta >= 0.0:
            raise ConfigError(f"{flag_text('availability_size_beta', self.size_beta)}: must "
                              f"be >= 0")


def reads_labels(settings: Any) -> bool:
    """Whether p_i under `settings` reads the clients' label counts (``data``)."""
    return settings.probabilities == "data"


def check_probabilities(p: np.ndarray, what: str) -> np.ndarray:
    """`p` as float64 [N] in [0, 1], or a ConfigError naming `what` and the first bad one."""
    p = np.asarray(p, np.float64)
    bad = np.flatnonzero(~((p >= 0.0) & (p <= 1.0)))
    if bad.size:
        raise ConfigError(f"{what} gives client {bad[0]} the availability {p[bad[0]]:g}, "
                          f"outside [0, 1]")
    return p


def data_probabilities(settings: Any, label_counts: Optional[np.ndarray]) -> np.ndarray:
    """FedAU's data-correlated p_i = max(p_min, C p_mean <d_i, w>), w ~ Dir(alpha 1_C)
    (IBM/fedau util/util.py); d_i: client i's label counts over its examples (0 when it has
    none)."""
    if label_counts is None:
        raise ConfigError("--availability_probs=data needs the clients' label counts; this "
                          "dataset has none (not a classification task)")
    counts = np.asarray(label_counts, np.float64)   # [N, C]
    if counts.ndim != 2 or np.any(counts < 0):
        raise DataError(f"label counts must be [clients, labels] and >= 0, got shape "
                        f"{counts.shape}")
    totals = counts.sum(axis=1, keepdims=True)
    d = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    num_labels = counts.shape[1]
    rng = np.random.default_rng([int(settings.seed), 0, MODEL_STREAM, _DIRICHLET])
    w = rng.dirichlet(np.full(num_labels, settings.alpha))
    p = np.maximum(settings.p_min, num_labels * settings.p_mean * (d @ w))
    return check_probabilities(p, f"--availability_probs=data with "
                                  f"{flag_text('availability_p_mean', settings.p_mean)}")


def size_probabilities(settings: Any, sizes: np.ndarray) -> np.ndarray:
    """FLGo's MDF (n_i^beta / max) or LDF (n_i^-beta / max) availability."""
    n = np.asarray(sizes, np.float64)
    if n.size == 0 or np.any(n <= 0):
        raise DataError(f"--availability_probs={settings.probabilities} needs every client to "
                        f"hold examples")
    beta = SIZE_BETA[settings.probabilities] if settings.size_beta is None else settings.size_beta
    c = n ** (beta if settings.probabilities == "more_data" else -beta)
    return c / c.max()


def client_probabilities(settings: Any, clients: Population) -> np.ndarray:
    """[N] p_i of every training client under ``--availability_probs``."""
    if settings.probabilities == "uniform":
        return np.full(clients.num_clients, settings.p, np.float64)
    if settings.probabilities == "data":
        p = data_probabilities(settings, clients.label_counts)
    else:
        p = size_probabilities(settings, clients.sizes)
    if p.shape != (clients.num_clients,):
        raise DataError(f"availability: {p.shape[0]} clients' data for {clients.num_clients} "
                        f"clients")
    return p


def sometimes_online(p: np.ndarray, settings: Any) -> np.ndarray:
    """`p`, or a ConfigError when every p_i is 0 (no client is ever online)."""
    if not np.any(p > 0.0):
        raise ConfigError(f"--availability={settings.model} with --availability_probs="
                          f"{settings.probabilities}: every client has availability 0, no "
                          f"client is ever online")
    return p
