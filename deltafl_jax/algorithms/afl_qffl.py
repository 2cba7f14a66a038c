"""q-FFL at q = 10, the stand-in for AFL that the Delta-FL papers report (CISS 2021, Sec. V).
The round is :func:`deltafl_jax.algorithms.qffl.qffl`; ``--qffl_q`` is not read."""

from __future__ import annotations

from deltafl_jax.algorithms.qffl import Q_SWEEP, QFFLHyper, qffl
from deltafl_jax.algorithms.spec import AlgorithmSpec, Grid

AFL_QFFL_Q = 10.0

SPEC = AlgorithmSpec(
    name="afl_qffl", display_name="AFL (q-FFL proxy)",
    help="q-FFL at q = 10, the papers' stand-in for AFL",
    factory=lambda config, data, options: qffl(), hyper=QFFLHyper, sweep=Q_SWEEP,
    grid=Grid(values=lambda config, given: (AFL_QFFL_Q,), fixed_sweep=True))
