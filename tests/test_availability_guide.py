"""The availability guide's facts against the code (docs/guides/availability.md):

- FLASH's state names: each state the guide's table lists is read, with the effect the table
  gives it (hand-written state traces: a device is ready while locked, on WiFi and charging),
  and a state it does not list is refused;
- which models a report's quintiles split by availability: under ``--availability_probs=uniform``
  every client of ``bernoulli``, ``markov`` and ``cyclic=phase`` has the same rate (the
  quintiles are groups of ids), under ``data`` the rates differ, and ``more_data`` at its default
  beta keeps them within 0.1% (n_i / max n)^0.0001.
"""

import os
import re

import numpy as np
import pytest

from deltafl_jax.errors import DataError
from deltafl_jax.sampling.availability import AvailabilitySettings, build_availability
from deltafl_jax.sampling.traces import flash_ready_times

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                     "guides", "availability.md")


def _documented_states():
    """{state: what the guide's table says it sets} of the FLASH table."""
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("| state | sets |"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.strip().startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0])
        effects = [e.strip() for e in cells[1].split(",")]
        for i, name in enumerate(names):
            rows[name] = effects[i] if len(effects) == len(names) else effects[0]
    return rows


def _trace(*states):
    """One device's FLASH messages: the k-th state at 10 k s, then screen_unlock at
    60 + 10 k s (k states)."""
    lines = [f"2020-01-02 00:00:{10 * (k + 1):02d}\t{s}" for k, s in enumerate(states)]
    return "\n".join(lines + [f"2020-01-02 00:01:{10 * len(states):02d}\tscreen_unlock"])


READY = ("screen_lock", "wifi", "battery_charged_on")   # locked, on WiFi, charging


def _ready(*states):
    got = flash_ready_times("device 'x'", _trace(*states))
    return got is not None and len(got[0]) > 0


def test_the_guides_flash_states_have_their_documented_effect():
    rows = _documented_states()
    assert len(rows) >= 12 and rows["wifi"] == "on WiFi"
    # What undoes readiness: each documented 'not ...' / 'unlocked' state after a ready set.
    undo = {"not charging": "charging", "not on WiFi": "on WiFi", "unlocked": "locked"}
    for name, effect in rows.items():
        state = "57%" if name == "NN%" else name
        if effect in ("charging", "on WiFi", "locked"):
            others = [s for s in READY if s != {"charging": "battery_charged_on",
                                                "on WiFi": "wifi",
                                                "locked": "screen_lock"}[effect]]
            assert not _ready(*others), name           # the other two alone: not ready
            assert _ready(*others, state), name        # this state completes them
        elif effect in undo:
            # ready from the 3rd line, then this state: the interval closes at its time
            ready, _, _ = flash_ready_times("device 'x'", _trace(*READY, state))
            assert ready == [[30.0, 40.0]], name
        else:
            assert effect.startswith("nothing"), (name, effect)
            ready, _, _ = flash_ready_times("device 'x'", _trace(*READY, state))
            assert ready == [[30.0, 100.0]], name       # still ready until screen_unlock
    assert _ready(*[s.upper() for s in READY])          # compared in lower case
    with pytest.raises(DataError, match="unknown state 'bluetooth_on'"):
        flash_ready_times("device 'x'", _trace(*READY, "bluetooth_on"))


def _rates(model, probs, **kw):
    n = 40
    sizes = np.arange(10, 10 + 25 * n, 25)
    labels = np.random.default_rng(0).integers(0, 30, (n, 10))
    settings = AvailabilitySettings(model=model, probabilities=probs, **kw)
    return build_availability(settings, num_clients=n, sizes=sizes, label_counts=labels,
                              num_rounds=50).rates()


@pytest.mark.parametrize("model,kw", [("bernoulli", {}), ("markov", {}),
                                      ("cyclic", {"cyclic": "phase"})])
def test_uniform_probabilities_give_every_client_one_rate(model, kw):
    """The guide: under --availability_probs=uniform the quintiles split nothing; under data
    they split by the clients' differing rates."""
    uniform = _rates(model, "uniform", **kw)
    assert np.ptp(uniform) == 0.0
    assert np.ptp(_rates(model, "data", **kw)) > 0.01


def test_more_data_at_its_default_beta_barely_differs():
    sizes = np.arange(10, 10 + 25 * 40, 25)
    rates = _rates("bernoulli", "more_data")
    np.testing.assert_allclose(rates, (sizes / sizes.max()) ** 1e-4, rtol=1e-12)
    assert rates.min() > 0.999 and np.ptp(rates) > 0
