"""Summaries of per-client losses and errors, as the papers report them (App. C.2.3).

- Train losses are weighted by alpha_k (proportional to n_k) over the training clients.
- Test errors (and test losses) are unweighted over the test clients.
- Percentiles are the lower weighted quantile by default (:func:`weighted_quantile`: the
  smallest client value whose cumulative weight reaches the level); ``method="linear"`` gives
  NumPy's linear interpolation (unweighted), which the reference scripts used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.superquantile import weighted_quantile

PERCENTILE_METHODS = ("lower", "linear")


@jax.jit
def _lower_percentiles(values, weights, levels):
    """values [R, N], weights [N], levels [L] in [0, 1] -> [R, L]."""
    per_level = jax.vmap(lambda v, q: weighted_quantile(v, weights, q), in_axes=(None, 0))
    return jax.vmap(lambda v: per_level(v, levels))(values)


def percentiles(values, weights, percents, method: str = "lower") -> np.ndarray:
    """[R, N] values, [N] weights (None: unweighted), percents in [0, 100] -> [R, L]."""
    values = np.asarray(values, np.float64)
    if method == "linear":
        if weights is not None:
            raise ValueError("linear percentiles are unweighted")
        return np.percentile(values, list(percents), axis=1).T
    if method != "lower":
        raise ValueError(f"unknown percentile method {method!r}")
    w = np.ones(values.shape[1]) if weights is None else np.asarray(weights, np.float64)
    levels = np.asarray(percents, np.float64) / 100.0
    out = _lower_percentiles(jnp.asarray(values, jnp.float32), jnp.asarray(w, jnp.float32),
                             jnp.asarray(levels, jnp.float32))
    return np.asarray(out, np.float64)


def summarize(train_loss, train_sizes, test_error, test_loss, percents,
              method: str = "lower") -> dict:
    """Per-replica summaries: name -> [R] array.

    Args:
      train_loss: [R, N_train] per-client loss F_k on the training clients.
      train_sizes: [N_train] n_k (the alpha_k weights).
      test_error: [R, N_test] per-client misclassification rate on the test clients.
      test_loss: [R, N_test] per-client mean loss on the test clients.
    """
    train_loss = np.asarray(train_loss, np.float64)
    test_error = np.asarray(test_error, np.float64)
    alpha = np.asarray(train_sizes, np.float64)
    alpha = alpha / alpha.sum()
    out = {"train_loss_mean": train_loss @ alpha}
    train_w = None if method == "linear" else alpha
    for p, v in zip(percents, percentiles(train_loss, train_w, percents, method).T):
        out[f"train_loss_p{p}"] = v
    out["test_error_mean"] = test_error.mean(axis=1)
    for p, v in zip(percents, percentiles(test_error, None, percents, method).T):
        out[f"test_error_p{p}"] = v
    out["test_loss_mean"] = np.asarray(test_loss, np.float64).mean(axis=1)
    return out


WORST_FRACTION = 0.1   # the "worst 10%" of the personalisation benchmarks


def worst_mean(values, fraction: float = WORST_FRACTION) -> np.ndarray:
    """[R] the mean of the worst `fraction` of each row's N client values: the superquantile
    (CVaR) at level 1 - fraction of the uniform distribution over the clients, i.e.
    max over weights q <= 1 / (fraction N), sum q = 1, of sum_k q_k v_k: the floor(fraction N)
    largest values in full and the next with the remaining fraction (PropFair's and pFL-Bench's
    "worst 10%" when fraction N is a whole number)."""
    values = np.asarray(values, np.float64)
    n = values.shape[1]
    mass = fraction * n
    srt = -np.sort(-values, axis=1)                     # largest first (NaN first)
    whole = int(np.floor(mass))
    total = srt[:, :whole].sum(axis=1)
    if whole < n:
        total = total + (mass - whole) * srt[:, whole]
    return total / mass


def summarize_population(name: str, error, loss, percents, method: str = "lower") -> dict:
    """The test errors' summaries for a population of clients (each counts once):
    ``{name}_error_mean``, ``{name}_error_p{p}``, ``{name}_error_worst10`` and
    ``{name}_loss_mean``, each [R]."""
    error = np.asarray(error, np.float64)
    out = {f"{name}_error_mean": error.mean(axis=1)}
    for p, v in zip(percents, percentiles(error, None, percents, method).T):
        out[f"{name}_error_p{p}"] = v
    out[f"{name}_error_worst10"] = worst_mean(error)
    out[f"{name}_loss_mean"] = np.asarray(loss, np.float64).mean(axis=1)
    return out
