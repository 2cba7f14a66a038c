"""An AlgorithmSpec built from its records (Grid, Clients, Reporting): the replicas it makes,
the Ditto layer over it and the registry's checks, against hand-written grids; a spec given a
wrong record, or hyper fields its grid does not set, is refused with a TypeError naming it."""

import itertools
from typing import NamedTuple

import pytest

from conftest import tiny_config
from deltafl_jax.algorithms import registry
from deltafl_jax.algorithms.deltafl import THETA_SWEEP
from deltafl_jax.algorithms.deltafl_alt import SPEC as ALT
from deltafl_jax.algorithms.ditto import personalized
from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.minimal import plain_average
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients, Grid, Reporting
from deltafl_jax.replicas.labels import grid_for

ETA_EVERY = ALT.grid.cross[0]            # --eta_every, an integer sweep


class ToyHyper(NamedTuple):
    theta: float
    eta_every: float
    scale: float


def toy_spec(**records) -> AlgorithmSpec:
    fields = dict(grid=Grid(fixed={"scale": 2.0}, cross=(ETA_EVERY,)),
                  clients=Clients(variable_cohort=True, local_work=3.0),
                  reporting=Reporting(names_value=False, leaderboard=Board()))
    fields.update(records)
    return AlgorithmSpec(name="toy", display_name="Toy", help="plain averaging",
                         factory=lambda config, data, options: plain_average(),
                         hyper=ToyHyper, sweep=THETA_SWEEP, **fields)


def test_a_spec_of_records_makes_the_grid_its_records_describe():
    spec = toy_spec()
    config = tiny_config(thetas=(0.5, 1.0), eta_every=(1.0, 4.0))
    points = grid_for(spec, config).points
    # By hand: theta x T_eta, the crossed value an extra label coordinate, `scale` fixed.
    want = [(t, (("eta_every", e),), ToyHyper(theta=t, eta_every=e, scale=2.0))
            for t, e in itertools.product((0.5, 1.0), (1.0, 4.0))]
    assert [(p.label.theta, p.label.extra, p.hyper) for p in points] == want
    assert spec.reads() == ("thetas", "eta_every")
    assert spec.expected_work(points[0].label) == pytest.approx(3.0 * 0.5)
    assert not spec.clients.fixed_cohort
    assert registry.collect_options(list(registry.SPECS.values()) + [spec]) == \
        registry.options()


def test_the_ditto_layer_over_it_crosses_lambda_and_keeps_its_clients():
    layered = personalized(toy_spec())
    assert [s.flag for s in layered.grid.cross] == ["eta_every", "ditto_lambda"]
    assert layered.grid.fixed == {"scale": 2.0} and not layered.grid.tunes_l2
    assert layered.clients == Clients(variable_cohort=True, local_work=3.0)
    assert layered.reporting.leaderboard is None and not layered.reporting.names_value
    label = layered.label(0.5)
    assert layered.reporting.column_name(label, None, "Toy") == "Ditto over Toy"
    assert layered.hyper_for(0.5, eta_every=2.0, ditto_lambda=0.1) == \
        layered.hyper(theta=0.5, eta_every=2.0, scale=2.0, ditto_lambda=0.1)


@pytest.mark.parametrize("field,value,kind", [
    ("grid", {"fixed": {"scale": 2.0}}, "dict"),
    ("clients", Grid(), "Grid"),
    ("reporting", None, "NoneType"),
])
def test_a_wrong_record_is_a_type_error_naming_it(field, value, kind):
    record = {"grid": "Grid", "clients": "Clients", "reporting": "Reporting"}[field]
    with pytest.raises(TypeError, match=f"spec toy: {field} must be a {record}, got {kind}$"):
        toy_spec(**{field: value})


def test_hyper_fields_the_grid_does_not_set_are_a_type_error():
    with pytest.raises(TypeError, match=r"spec toy: hyper fields \['eta_every', 'scale', "
                                        r"'theta'\] must be"):
        toy_spec(grid=Grid(cross=(ETA_EVERY,)))     # `scale` neither swept nor fixed


@pytest.mark.parametrize("clients,fixed", [
    (Clients(), True),                                   # m clients a round
    (Clients(variable_cohort=True), False),              # Poisson and availability accepted
    (Clients(full_participation=True), True),            # all N every round
    (Clients(full_participation=True, variable_cohort=True), True),
])
def test_a_fixed_cohort_is_full_participation_or_no_variable_cohort(clients, fixed):
    assert clients.fixed_cohort is fixed
