"""Summaries of per-client losses and errors, as the papers report them (App. C.2.3).

- Train losses are weighted by alpha_k (proportional to n_k) over the training clients.
- Test errors (and test losses) are unweighted over the test clients.
- Percentiles are the lower weighted quantile by default (:func:`weighted_quantile`: the
  smallest client value whose cumulative weight reaches the level); ``method="linear"`` gives
  NumPy's linear interpolation (unweighted), which the reference scripts used.

**Tail metrics** (beside the percentiles; pure NumPy float64 functions of [R, N] rows, so
that any population of clients can be summarised with them):

- ``test_error_worst10``: the mean error of the worst 10% of the test clients, i.e. the
  superquantile (CVaR) of the client errors at level 0.9 (:func:`superquantile_rows`): the
  mean of the largest values that carry 10% of the clients' weight, the boundary client
  counted with the FRACTION of its weight that completes the 10%. With K clients of weight
  1/K each and 0.1 K = j + f (j whole, 0 <= f < 1) it is
  (sum of the j largest errors + f x the (j+1)-th largest) / (0.1 K). PropFair's and
  pFL-Bench's "worst 10%" (the mean of the lowest floor(0.1 K) accuracies, in error terms the
  mean of the floor(0.1 K) largest errors) is the same number when 0.1 K is a whole number;
  otherwise it drops the boundary client's fraction, so it is >= the superquantile and jumps
  as K passes a multiple of 10 (and is undefined for K < 10, where the superquantile is the
  largest error). The superquantile is the quantity Delta-FL minimises (on the losses).
- ``test_error_std``: the standard deviation of the client errors with ddof = 0 (the spread of
  the population of test clients, not an estimate from a sample), unweighted like the mean.
- ``test_share_below_target``: the share of test clients whose accuracy 1 - error is below
  the target accuracy (``ExperimentConfig.target_accuracy``, ``--target_accuracy``, 0.5 by
  default: the clients the model gets wrong more often than right); only for classifiers
  (a regression's "error" is its loss).
"""

from __future__ import annotations

import re

import jax
import numpy as np

from deltafl_jax.superquantile import weighted_quantile

PERCENTILE_METHODS = ("lower", "linear")
WORST_LEVEL = 0.9               # test_error_worst10: the superquantile at 0.9
DEFAULT_TARGET_ACCURACY = 0.5   # test_share_below_target
TAIL_KEYS = ("test_error_worst10", "test_error_std", "test_share_below_target")


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
    # cast on the host: one compiled program per shape, not one per eager conversion
    out = _lower_percentiles(values.astype(np.float32), w.astype(np.float32),
                             levels.astype(np.float32))
    return np.asarray(out, np.float64)


def _row_weights(values: np.ndarray, weights) -> np.ndarray:
    """[N] float64 weights (None: 1 each); ValueError unless finite, >= 0, not all zero."""
    n = values.shape[1]
    w = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    if w.shape != (n,) or not np.all(np.isfinite(w)) or np.any(w < 0) or not w.sum() > 0:
        raise ValueError(f"weights must be {n} finite values >= 0, not all 0")
    return w


def superquantile_rows(values, level: float = WORST_LEVEL, weights=None) -> np.ndarray:
    """[R]: the superquantile (CVaR) at `level` of each row of [R, N] `values` (weights [N],
    None: equal): the weighted mean of the largest values carrying the share 1 - level of the
    weight, the boundary value counted with the fraction of its weight that completes it
    (module docstring). level = 0 is the weighted mean, level -> 1 the largest value (level =
    1 gives the largest value of positive weight). A NaN in a row (a diverged client) counts
    as the largest value, so the row's result is NaN."""
    values = np.atleast_2d(np.asarray(values, np.float64))
    if not 0.0 <= float(level) <= 1.0:
        raise ValueError(f"the superquantile's level must be in [0, 1], got {level}")
    w = _row_weights(values, weights)
    order = np.argsort(-np.where(np.isnan(values), np.inf, values), axis=1, kind="stable")
    v = np.take_along_axis(values, order, axis=1)                 # largest first, NaN first
    wv = w[order]
    if float(level) == 1.0:
        return np.where(np.any(np.isnan(values[:, w > 0]), axis=1), np.nan,
                        np.max(np.where(wv > 0, v, -np.inf), axis=1))
    tail = (1.0 - float(level)) * w.sum()
    before = np.cumsum(wv, axis=1) - wv                          # weight of the larger values
    share = np.clip(tail - before, 0.0, wv)                      # each value's part of the tail
    return np.sum(np.where(share > 0, v * share, 0.0), axis=1) / tail


def std_rows(values, weights=None, ddof: int = 0) -> np.ndarray:
    """[R]: the standard deviation of each row; weights [N] (None: equal) give the weighted
    population std sqrt(sum w (x - mean_w)^2 / sum w) (ddof must then be 0)."""
    values = np.atleast_2d(np.asarray(values, np.float64))
    if weights is None:
        return values.std(axis=1, ddof=ddof)
    if ddof:
        raise ValueError("a weighted std is the population one (ddof = 0)")
    w = _row_weights(values, weights)
    mean = values @ w / w.sum()
    return np.sqrt(np.square(values - mean[:, None]) @ w / w.sum())


def share_below_target(error, target_accuracy: float, weights=None) -> np.ndarray:
    """[R]: the (weighted) share of clients whose accuracy 1 - error is below
    `target_accuracy`, per row of [R, N] misclassification rates. A NaN error counts as
    below (a diverged client)."""
    error = np.atleast_2d(np.asarray(error, np.float64))
    w = _row_weights(error, weights)
    below = ~(1.0 - error >= float(target_accuracy))   # NaN: below
    return below.astype(np.float64) @ w / w.sum()


def tail_summaries(test_error, target_accuracy=DEFAULT_TARGET_ACCURACY) -> dict:
    """The tail metrics of the module docstring: name -> [R], from [R, N] test errors
    (unweighted); ``test_share_below_target`` only when `target_accuracy` is not None (a
    classifier)."""
    out = {"test_error_worst10": superquantile_rows(test_error, WORST_LEVEL),
           "test_error_std": std_rows(test_error)}
    if target_accuracy is not None:
        out["test_share_below_target"] = share_below_target(test_error, target_accuracy)
    return out


def summarize(train_loss, train_sizes, test_error, test_loss, percents,
              method: str = "lower", target_accuracy=DEFAULT_TARGET_ACCURACY) -> dict:
    """Per-replica summaries: name -> [R] array.

    Args:
      train_loss: [R, N_train] per-client loss F_k on the training clients.
      train_sizes: [N_train] n_k (the alpha_k weights).
      test_error: [R, N_test] per-client misclassification rate on the test clients.
      test_loss: [R, N_test] per-client mean loss on the test clients.
      target_accuracy: of ``test_share_below_target`` (None: a regression, not computed).
    Returns the means and percentiles, then the tail metrics (:func:`tail_summaries`).
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
    out.update(tail_summaries(test_error, target_accuracy))
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


def perplexity_summaries(per_client, percents=(90,)) -> dict:
    """A language model's per-client perplexity exp(mean token loss of the client), for each
    population whose [R, N] losses `per_client` holds: ``test_loss`` (the unseen test
    clients) and, with ``--client_holdout``, the personalised evaluation's ``seen_loss``,
    ``unseen_loss`` and their ``_ft<k>`` variants after k adaptation steps (``train_loss``
    holds the L2 term, and is left out): ``{name}_ppl_mean`` (the unweighted mean over the
    clients), ``{name}_ppl_p{p}`` (lower percentiles) and ``{name}_ppl_worst10``
    (:func:`worst_mean`: the mean of the worst 10%), each [R]."""
    out = {}
    names = [k[:-len("_loss")] for k in per_client
             if re.fullmatch(r"(test|seen|unseen)(_ft\d+)?_loss", k)]
    for name in names:
        ppl = np.exp(np.asarray(per_client[f"{name}_loss"], np.float64))
        out[f"{name}_ppl_mean"] = ppl.mean(axis=1)
        for p, v in zip(percents, percentiles(ppl, None, percents).T):
            out[f"{name}_ppl_p{p}"] = v
        out[f"{name}_ppl_worst10"] = worst_mean(ppl)
    return out


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
