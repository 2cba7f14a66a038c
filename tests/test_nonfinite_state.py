"""The round's check of its state (a NaN or an infinity in the model, the server optimizer's
state, the algorithm's state, the clients' own state or DP's state): the check on hand-made
states against NumPy's isfinite part by part, a Ditto run whose personal models blow up
(lambda = 1e30) counted per replica, named in a warning line, its seen-client metrics NaN, and
stopped or kept as ``--stop_on_divergence`` says; Ditto's up-front warning past its proximal
step's stability bound eta (lambda + l2) >= 2."""

import json
import os
import subprocess
import sys
from typing import NamedTuple

import jax
import numpy as np
import pytest

from conftest import tiny_config
from deltafl_jax import run_experiment
from deltafl_jax.algorithms import registry
from deltafl_jax.replicas.labels import grid_for
from deltafl_jax.rounds import (NONFINITE, ServerState, count_nonfinite_clients,
                                state_nonfinite)
from deltafl_jax.run.divergence import StopOnDivergence
from deltafl_jax.run.loop import nonfinite_rounds

R, N, M = 3, 7, 4


class Algo(NamedTuple):
    c: object
    lam: object


class Client(NamedTuple):
    base: object
    personal: object


def hand_made_state():
    """In NumPy (the checks run jitted: no compile per operation run eagerly)."""
    rng = np.random.default_rng(0)
    f = lambda *s: rng.normal(size=s).astype(np.float32)
    return ServerState(
        params={"Dense_0": {"kernel": f(R, 5, 2), "bias": f(R, 2)}},
        algo_state=Algo(c={"kernel": f(R, 5, 2)}, lam=f(R, N)), round=np.int32(4),
        active=np.ones((R,), bool),
        server_opt_state=({"mu": f(R, 5, 2), "count": np.zeros((R,), np.int32)},),
        client_state=Client(base=f(R, N, 2), personal={"kernel": f(R, N, 5, 2)}),
        dp={"clip": f(R), "noise": f(R, 2, 5, 2)})


# (the part's name, the path of a leaf in it) for a NaN planted in each part in turn
PARTS = [("params", ("params", "Dense_0", "bias")),
         ("server_opt_state", ("server_opt_state", 0, "mu")),
         ("algo_state.c", ("algo_state", "c", "kernel")),
         ("algo_state.lam", ("algo_state", "lam")),
         ("client_state.base", ("client_state", "base")),
         ("client_state.personal", ("client_state", "personal", "kernel")),
         ("dp", ("dp", "noise"))]


def planted(state, path, index, value=np.nan):
    """`state` with `value` at `index` of the leaf at `path`."""
    tree = {k: getattr(state, k) for k in ("params", "algo_state", "server_opt_state",
                                           "client_state", "dp")}
    node = tree[path[0]]
    for step in path[1:-1]:
        node = node[step] if not hasattr(node, "_fields") else getattr(node, step)
    last = path[-1]
    leaf = node[last] if not hasattr(node, "_fields") else getattr(node, last)
    new = np.array(leaf)
    new[index] = value
    rebuilt = jax.tree_util.tree_map_with_path(
        lambda p, x: new if x is leaf else x, tree[path[0]])
    return state.replace(**{path[0]: rebuilt})


def numpy_reference(state, clients):
    """Per part: [R] 1 where any float of the replica's part is not finite; for a client
    part, the count of `clients`' rows that are not."""
    out = {}
    groups = {"params": state.params, "server_opt_state": state.server_opt_state,
              "algo_state.c": state.algo_state.c, "algo_state.lam": state.algo_state.lam,
              "client_state.base": state.client_state.base,
              "client_state.personal": state.client_state.personal, "dp": state.dp}
    for name, part in groups.items():
        leaves = [np.asarray(x) for x in jax.tree.leaves(part)
                  if np.issubdtype(np.asarray(x).dtype, np.floating)]
        if name.startswith("client_state"):
            bad = np.zeros((R, clients.shape[1]), bool)
            for x in leaves:
                for r in range(R):
                    bad[r] |= ~np.isfinite(x[r, clients[r]].reshape(clients.shape[1], -1)
                                           ).all(1)
            out[name] = bad.sum(1)
        else:
            out[name] = np.array([any(not np.isfinite(x[r]).all() for x in leaves)
                                  for r in range(R)], np.int32)
    return out


def test_a_finite_state_reports_nothing_and_each_planted_nan_its_part():
    state = hand_made_state()
    clients = np.asarray([[0, 2, 4, 6], [1, 2, 3, 5], [6, 5, 4, 3]], np.int32)
    real = np.ones((R, M), bool)
    check = jax.jit(state_nonfinite)
    got = jax.device_get(check(state, clients, real))
    assert sorted(got) == sorted(NONFINITE + name for name, _ in PARTS)
    assert all(not np.any(v) for v in got.values())
    for name, path in PARTS:
        index = ((1, 3) if name.startswith("client_state") else (1,))   # replica 1, client 3
        bad = planted(state, path, index, np.nan if "personal" not in name else np.inf)
        got = jax.device_get(check(bad, clients, real))
        want = numpy_reference(bad, np.asarray(clients))
        for part, counts in want.items():
            np.testing.assert_array_equal(got[NONFINITE + part], counts, err_msg=name)
        expected = np.zeros(R, np.int32)
        expected[1] = 1
        np.testing.assert_array_equal(got[NONFINITE + name], expected, err_msg=name)
        assert all(not np.any(v) for k, v in got.items() if k != NONFINITE + name), name


def test_client_rows_outside_the_round_and_empty_slots_are_not_the_rounds():
    """A client's row changes only in its round: the round counts its own clients' rows
    (the empty slots of a Poisson cohort left out); the closing count reads all N."""
    state = planted(hand_made_state(), ("client_state", "personal", "kernel"), (0, 5))
    state = planted(state, ("client_state", "personal", "kernel"), (2, 1))
    clients = np.asarray([[0, 1, 2, 3], [0, 1, 2, 3], [1, 4, 1, 1]], np.int32)
    real = np.asarray([[True] * 4, [True] * 4, [True, True, False, False]])
    got = jax.device_get(jax.jit(state_nonfinite)(state, clients, real))
    np.testing.assert_array_equal(got[NONFINITE + "client_state.personal"], [0, 0, 1])
    total = jax.device_get(jax.jit(count_nonfinite_clients)(state))
    assert sorted(total) == ["client_state.base", "client_state.personal"]
    np.testing.assert_array_equal(total["client_state.personal"], [1, 0, 1])
    np.testing.assert_array_equal(total["client_state.base"], [0, 0, 0])


def test_the_round_a_stopped_replica_stopped_at_is_read_back_from_the_round_metrics():
    """A resumed run finds the round of a state that went non-finite in rounds.npz."""
    per_round = {NONFINITE + "params": [np.array([0, 0]), np.array([0, 1]),
                                        np.array([0, 1])],
                 NONFINITE + "client_state.personal": [np.array([0, 0]), np.array([0, 0]),
                                                       np.array([3, 2])],
                 "num_selected": [np.array([4, 4])] * 3}
    first = nonfinite_rounds(per_round)
    np.testing.assert_array_equal(first["params"], [0, 2])
    np.testing.assert_array_equal(first["client_state.personal"], [3, 3])
    stop = StopOnDivergence(per_round=per_round)
    from deltafl_jax.replicas.labels import ReplicaLabel
    label = ReplicaLabel("ditto", 1.0, 1, param_name="ditto_lambda", param_value=1.0)
    assert stop.stopped_at(label, 1, default=9) == 2
    assert stop.stopped_at(label, 0, default=9) == 3


def ditto_config(**overrides):
    """Ditto at lambda = 0.1 and 1e30 over the 12 training clients of tiny_synthetic, every
    client in every round (the personal models at 1e30 turn non-finite in round 1: v - w is
    0 at the first local step, then scaled by 1e30 per step)."""
    base = dict(algorithm="ditto", thetas=(), ditto_lambda=(0.1, 1e30), num_rounds=2,
                eval_every=1, clients_per_round=12, learning_rate=0.05, batch_size=8,
                client_holdout=0.25, verbose=True)
    base.update(overrides)
    return tiny_config(**base)


def test_ditto_at_a_huge_lambda_is_counted_named_and_marked(tiny_synthetic):
    lines = []
    result = run_experiment(ditto_config(), tiny_synthetic, log=lines.append)
    good, bad = (lab.key() for lab in grid_for(registry.get("ditto"), ditto_config()).build().labels)
    # independent of the check: the personal models the run ends with, in NumPy
    personal = [np.asarray(x) for x in jax.tree.leaves(result.personal)]
    not_finite = np.zeros(personal[0].shape[:2], bool)
    for x in personal:
        not_finite |= ~np.isfinite(x.reshape(x.shape[0], x.shape[1], -1)).all(-1)
    assert not not_finite[0].any() and not_finite[1].all()     # every client at 1e30
    n = not_finite.shape[1]
    # counted per replica and per round (every client works in every round)
    counts = result.per_round[NONFINITE + "client_state.personal"]
    np.testing.assert_array_equal(counts, [[0, n], [0, n]])
    assert not result.per_round[NONFINITE + "params"].any()   # the global model is fine
    assert result.summary["nonfinite"] == {
        bad: {"client_state.personal": {"round": 1, "clients": n}}}
    # named once, with the round, the replica and the part
    warned = [line for line in lines if "is not finite" in line]
    assert warned == [f"warning: round 1, replica {bad}: the clients' own state "
                      f"(client_state.personal) of {n} of the round's clients is not finite; "
                      f"it trains on (--stop_on_divergence stops it) and the metrics computed "
                      f"from a non-finite model are NaN"]
    # the seen clients' metrics from those models are marked: NaN, the good replica's not
    assert np.isnan(result.per_client["seen_error"][1]).all()
    assert np.isfinite(result.per_client["seen_error"][0]).all()
    for key in ("seen_error_mean", "seen_error_p90", "seen_error_worst10",
                "participation_gap"):
        assert np.isnan(result.final[bad][key]) and np.isfinite(result.final[good][key]), key
    # the unseen devices are served the (finite) global model
    assert np.isfinite(result.final[bad]["unseen_error_mean"])
    assert "diverged" not in result.summary and np.asarray(result.state.active).all()


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_stop_on_divergence_stops_a_replica_whose_state_is_not_finite(tiny_synthetic):
    # one client lane: the good replica's clients are dealt alike whether or not the other's
    # work (as test_divergence's bit-for-bit comparison)
    plain = run_experiment(ditto_config(verbose=False, clients_per_step=1), tiny_synthetic)
    stopped = run_experiment(ditto_config(verbose=False, clients_per_step=1,
                                          stop_on_divergence=True), tiny_synthetic)
    good, bad = plain.final
    assert stopped.summary["diverged"] == {bad: 1}
    np.testing.assert_array_equal(np.asarray(stopped.state.active), [True, False])
    assert stopped.final[good] == plain.final[good]       # the other replica: bit for bit
    for x, y in zip(jax.tree.leaves(plain.state.params), jax.tree.leaves(stopped.state.params)):
        np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(y)[0])
    # stopped after round 1: its global model did not move in round 2
    assert stopped.per_round["num_selected"][1, 1] == 0


def test_the_global_models_errors_are_nan_once_its_loss_is_not_finite(tiny_synthetic):
    # a server step of 3e38 x the mean update: the global model's logits overflow the loss.
    # A client's error counted from such a model would look like an ordinary number (an
    # overflowed logit still argmaxes to a class); it is NaN, and so are its summaries
    result = run_experiment(tiny_config(thetas=(1.0,), server_lr=(3e38,), eval_every=1,
                                        num_rounds=2), tiny_synthetic)
    loss = result.per_client["test_loss"]
    assert not np.isfinite(loss).any()
    assert np.isnan(result.per_client["test_error"]).all()
    (final,) = result.final.values()
    assert np.isnan(final["test_error_mean"]) and np.isnan(final["test_error_p90"])


def test_a_huge_but_finite_model_at_l2_zero_has_a_finite_train_loss(tiny_synthetic):
    # ||w||^2 of a model near 1e30 overflows float32; at l2 = 0 the L2 term is 0, not 0 x inf.
    # A server step of 1e30 x the mean update makes it (the round program of the test above,
    # whose server learning rate is an argument of the round)
    result = run_experiment(tiny_config(thetas=(1.0,), server_lr=(1e30,), eval_every=1,
                                        num_rounds=1), tiny_synthetic)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.state.params))
    sqnorm = sum(float(np.sum(np.asarray(x, np.float64) ** 2))
                 for x in jax.tree.leaves(result.state.params))
    assert sqnorm > float(np.finfo(np.float32).max)      # the float32 norm overflows
    assert np.isfinite(result.per_client["train_loss"]).all()


@pytest.mark.parametrize("optimizer, momentum, warned", [
    ("sgd", 0.9, (4.0, 6.0)),            # eta lambda >= 2 with eta = 0.5
    ("momentum", 0.5, (6.0,)),           # heavy ball: eta lambda >= 2 (1 + beta) = 3
    ("adam", 0.9, ())])                  # no such bound
def test_the_warning_is_given_past_the_proximal_steps_bound_and_not_below(
        tiny_synthetic, optimizer, momentum, warned):
    for name in ("ditto", "deltafl+ditto"):
        config = tiny_config(algorithm=name, ditto_lambda=(3.5, 3.99, 4.0, 6.0),
                             learning_rate=0.5, seeds=(1, 2), client_optimizer=optimizer,
                             client_momentum=momentum)
        spec = registry.get(name)
        lines = spec.warnings(config, grid_for(spec, config).build())
        assert len(lines) == len(warned), lines
        for lam, line in zip(warned, lines):
            assert line.startswith(f"ditto: λ = {lam:g} with learning rate η = 0.5: ")
    fedavg = tiny_config(algorithm="fedavg", thetas=(), learning_rate=100.0)
    spec = registry.get("fedavg")
    assert spec.warnings(fedavg, grid_for(spec, fedavg).build()) == ()


def test_the_finetune_rate_is_checked_when_the_unseen_devices_adapt_with_it():
    config = tiny_config(algorithm="ditto", ditto_lambda=(3.0,), learning_rate=0.1,
                         client_holdout=0.2, finetune_steps=(0, 5), finetune_lr=1.0)
    spec = registry.get("ditto")
    (line,) = spec.warnings(config, grid_for(spec, config).build())
    assert line.startswith("ditto: λ = 3 with --finetune_lr η = 1: η (λ + l2) = 3 >= 2")


@pytest.mark.slow
def test_the_command_warns_up_front_and_reports_the_non_finite_models(tmp_path):
    out = str(tmp_path / "run")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run",
         f"--flagfile={os.path.join(repo, 'tests', 'tiny.flags')}", "--algorithm=ditto",
         "--ditto_lambda=1,1e30", "--seeds=1", "--learning_rate=0.1", "--num_rounds=2",
         "--eval_every=2", "--client_holdout=0.2", f"--output_dir={out}"],
        cwd=repo, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    caution = [i for i, s in enumerate(lines) if s.startswith("warning: ditto: λ = 1e+30")]
    first_round = [i for i, s in enumerate(lines) if s.startswith("[round")]
    assert len(caution) == 1 and caution[0] < first_round[0]
    assert not any(s.startswith("warning: ditto: λ = 1 ") for s in lines)
    assert any(s.startswith("warning: round ") and "ditto_lambda=1e+30_seed=1" in s
               and "(client_state.personal)" in s for s in lines)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert list(summary["nonfinite"]) == ["ditto_lambda=1e+30_seed=1"]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    for rec in records:
        assert np.isnan(rec["seen_error_mean"]) == (rec["param_value"] == 1e30)
