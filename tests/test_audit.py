"""The audit of the reported epsilon (deltafl_jax.studies.audit): a canary client in half of 4000
short DP-FedAvg runs under Poisson sampling, a membership test on the released updates, and
Clopper-Pearson bounds on its rates. With the simulator's noise the lower bound stays below
the epsilon that the accountant reports; with the noise removed the same audit finds the
canary, and its lower bound exceeds that epsilon (so the test can fail)."""

import math

import numpy as np
import pytest
from scipy import stats

from deltafl_jax.studies import audit


def test_clopper_pearson_and_the_bound_from_the_rates():
    """The bounds are scipy's beta quantiles, and a test with TPR 0.5 and FPR 0.01 on 10^6
    runs each gives about log(50)."""
    lo, hi = audit.clopper_pearson(30, 100, 0.025)
    assert lo == pytest.approx(stats.beta.ppf(0.025, 30, 71))
    assert hi == pytest.approx(stats.beta.ppf(0.975, 31, 70))
    assert audit.clopper_pearson(0, 50, 0.05)[0] == 0.0
    assert audit.clopper_pearson(50, 50, 0.05)[1] == 1.0
    n = 1_000_000
    scores_in = np.r_[np.ones(n // 2), np.zeros(n // 2)]
    scores_out = np.r_[np.ones(n // 100), np.zeros(n - n // 100)]
    e = audit.epsilon_lower_bound(scores_in, scores_out, 0.5, 0.0, 0.025)
    assert math.log(50) - 0.1 < e < math.log(50)


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_the_audit_stays_below_the_reported_epsilon_and_finds_the_canary_without_noise():
    setting = audit.CanaryAudit()          # N = 50, q = 0.2, 3 rounds, z = 1, delta = 1e-5
    lower, reported = audit.run_audit(setting, noise=True)
    assert 3.0 < reported < 3.6            # PLD, add-or-remove, for this setting
    assert lower < reported
    lower_plain, _ = audit.run_audit(setting, noise=False)
    assert lower_plain > reported          # without noise the canary shows
