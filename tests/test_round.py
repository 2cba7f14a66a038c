"""The jitted round against an independent NumPy loop over clients, and its invariances."""

import dataclasses

import chex
import jax
import numpy as np
import pytest

from conftest import client_lists, linear_rows, run_rounds_history, tiny_config
from numpy_reference import delta_fl_round
from deltafl_jax import build_experiment, rounds
from deltafl_jax.engine import LocalSGDConfig
from deltafl_jax.sampling import plan as plan_lib


@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("filter", ["exact", "reference"])
def test_round_equals_numpy_loop_over_clients(tiny_synthetic, filter, lanes):
    cfg = tiny_config(filter=filter, thetas=(1.0, 0.6, 0.3), seeds=(1, 2), l2_reg=1e-3,
                      local_epochs=2, clients_per_step=lanes, learning_rate=0.05)
    exp = build_experiment(cfg, tiny_synthetic)
    state, hist = run_rounds_history(exp, 3)
    metrics = hist[-1]
    xs, ys = client_lists(tiny_synthetic.train)
    W0 = np.zeros((60, 10))
    b0 = np.zeros(10)
    for r, lab in enumerate(exp.replicas.labels):
        W, b = W0, b0
        for t in range(3):
            W, b, F, a = delta_fl_round(W, b, xs, ys, lab.seed, t, cfg.clients_per_round,
                                        lab.theta, filter, cfg.learning_rate, cfg.l2_reg,
                                        cfg.batch_size, epochs=2)
        got_W, got_b = linear_rows(state.params, r)
        np.testing.assert_allclose(got_W, W, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(got_b, b, atol=2e-5, rtol=1e-4)
        assert int(metrics["num_selected"][r]) == int(np.sum(a > 0))
        # The last round's filter: theta=1 keeps everyone; smaller theta keeps fewer.
        if lab.theta == 1.0:
            assert int(np.sum(a > 0)) == cfg.clients_per_round
    assert int(metrics["num_rejected"].sum()) == 0


def test_local_steps_mode_equals_numpy(tiny_synthetic):
    cfg = tiny_config(thetas=(0.5,), local_steps=13, batch_size=10, clients_per_step=2)
    exp = build_experiment(cfg, tiny_synthetic)
    state, _ = run_rounds_history(exp, 2)
    xs, ys = client_lists(tiny_synthetic.train)
    W, b = np.zeros((60, 10)), np.zeros(10)
    for t in range(2):
        W, b, _, _ = delta_fl_round(W, b, xs, ys, 1, t, 6, 0.5, "exact", cfg.learning_rate,
                                    0.0, 10, steps=13)
    got_W, got_b = linear_rows(state.params, 0)
    np.testing.assert_allclose(got_W, W, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got_b, b, atol=2e-5, rtol=1e-4)


def test_dropped_clients_do_no_local_work(tiny_synthetic):
    cfg = tiny_config(thetas=(0.3,), clients_per_step=1, batch_size=8)
    exp = build_experiment(cfg, tiny_synthetic)
    state, keys = exp.initial_state(), exp.keys()
    state, met0 = exp.round_fn(state, exp.round_data(0), keys)
    # At the zero initialisation every loss is log 10: all tie at eta and all train.
    assert int(met0["num_selected"][0]) == cfg.clients_per_round
    data = exp.round_data(1)
    _, met = exp.round_fn(state, data, keys)
    sizes = data.plan.sizes[0]
    kept = int(met["kept_examples"][0])
    assert kept < int(np.sum(sizes))          # the filter dropped someone
    assert int(met["train_real_examples"]) == kept   # and only the kept trained
    # One lane, one epoch: each kept client makes ceil(n_k / B) trips, its last batch padded.
    # The kept set comes from the NumPy round, run independently from the same start.
    xs, ys = client_lists(tiny_synthetic.train)
    W, b = np.zeros((60, 10)), np.zeros(10)
    W, b, _, _ = delta_fl_round(W, b, xs, ys, 1, 0, cfg.clients_per_round, 0.3, "exact",
                                cfg.learning_rate, 0.0, cfg.batch_size)
    _, _, _, a = delta_fl_round(W, b, xs, ys, 1, 1, cfg.clients_per_round, 0.3, "exact",
                                cfg.learning_rate, 0.0, cfg.batch_size)
    chosen = plan_lib.sample_clients(1, 1, len(xs), cfg.clients_per_round)
    kept_n = [len(ys[k]) for k, w in zip(chosen, a) if w > 0]
    assert sum(kept_n) == kept
    trips = sum(-(-n // cfg.batch_size) for n in kept_n)
    assert int(met["train_trips"]) == trips
    assert int(met["train_padded_examples"]) == trips * cfg.batch_size


def test_theta_one_is_fedavg_bit_for_bit(tiny_synthetic):
    a = build_experiment(tiny_config(algorithm="fedavg", thetas=()), tiny_synthetic)
    b = build_experiment(tiny_config(algorithm="deltafl", thetas=(1.0,)), tiny_synthetic)
    assert a.replicas.labels[0].theta == 1.0
    sa, _ = run_rounds_history(a, 3)
    sb, _ = run_rounds_history(b, 3)
    for x, y in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sb.params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_replica_vmap_equals_separate_runs(tiny_synthetic):
    thetas, seeds = (1.0, 0.5, 0.2), (1, 2)
    joint = build_experiment(tiny_config(thetas=thetas, seeds=seeds, clients_per_step=1),
                             tiny_synthetic)
    sj, _ = run_rounds_history(joint, 3)
    # Two of the six replicas (another theta and another seed than the first), each against
    # its own separate run.
    for r in (1, 4):
        lab = joint.replicas.labels[r]
        single = build_experiment(
            tiny_config(thetas=(lab.theta,), seeds=(lab.seed,), clients_per_step=1),
            tiny_synthetic)
        ss, _ = run_rounds_history(single, 3)
        for x, y in zip(jax.tree.leaves(sj.params), jax.tree.leaves(ss.params)):
            np.testing.assert_allclose(np.asarray(x)[r], np.asarray(y)[0], atol=1e-6)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_padding_changes_nothing(tiny_synthetic):
    base = build_experiment(tiny_config(thetas=(1.0, 0.4), clients_per_step=1, eval_chunk=32),
                            tiny_synthetic)
    s0, h0 = run_rounds_history(base, 3)
    m0 = h0[-1]
    # 1) Much longer index streams (more padding) give bit-identical models.
    caps = base.program.caps
    padded = dataclasses.replace(base, program=dataclasses.replace(
        base.program, caps=plan_lib.Capacities(eval_len=caps.eval_len + 10 * 32,
                                               train_len=caps.train_len + 1000)))
    s1, _ = run_rounds_history(padded, 3)
    for x, y in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    # 2) Other chunkings of the evaluation and more lanes (more idle slots) agree to rounding.
    for kw in (dict(eval_chunk=7, clients_per_step=1), dict(eval_chunk=500, clients_per_step=5)):
        other = build_experiment(tiny_config(thetas=(1.0, 0.4), **kw), tiny_synthetic)
        s2, h2 = run_rounds_history(other, 3)
        m2 = h2[-1]
        assert int(m2["eval_padded_examples"]) != int(m0["eval_padded_examples"])
        for x, y in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s2.params)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_jitted_round_equals_unjitted_and_round_two_does_not_recompile(tiny_synthetic):
    cfg = tiny_config(thetas=(1.0, 0.5), seeds=(1, 2), clients_per_step=2)
    exp = build_experiment(cfg, tiny_synthetic)
    local = LocalSGDConfig(cfg.batch_size, 2)
    raw = rounds.build_round_fn(exp.model, exp.algorithm, exp.replicas, local, exp.eval_chunk,
                                2, cfg.clients_per_round)
    state, keys = exp.initial_state(), exp.keys()
    data = exp.round_data(0)
    s_plain, m_plain = raw(state, data, keys)
    traced = jax.jit(chex.assert_max_traces(raw, n=1))
    s_jit, m_jit = traced(state, data, keys)
    for x, y in zip(jax.tree.leaves(s_plain.params), jax.tree.leaves(s_jit.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
    np.testing.assert_array_equal(m_plain["num_selected"], m_jit["num_selected"])
    for t in (1, 2, 3):  # new plans, same shapes: no new trace
        s_jit, _ = traced(s_jit, exp.round_data(t), keys)
    assert int(s_jit.round) == 4


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_unrolled_lanes_equal_vmapped_lanes(tiny_synthetic):
    cfg = tiny_config(thetas=(1.0, 0.4), seeds=(1, 2), clients_per_step=3)
    exp = build_experiment(cfg, tiny_synthetic)
    outs = []
    for mode in ("vmap", "unroll"):
        local = LocalSGDConfig(cfg.batch_size, 3, lane_mode=mode)
        fn = jax.jit(rounds.build_round_fn(exp.model, exp.algorithm, exp.replicas, local,
                                           exp.eval_chunk, 1, cfg.clients_per_round))
        state, keys = exp.initial_state(), exp.keys()
        for t in range(3):
            state, met = fn(state, exp.round_data(t), keys)
        outs.append(state.params)
    for x, y in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


@pytest.mark.parametrize("lanes", [1, 3])
def test_kept_slot_tables_change_no_bit(tiny_synthetic, lanes):
    """On CPU the round keeps the lanes' slot tables from one round to the next
    (program.TableRound): whatever they hold, the rounds give the same bits. Three rounds
    from the same state, once with the tables as the rounds left them and once with every
    table overwritten by NaN before each round, against the round built without kept tables
    (rounds.build_round_fn's plain form, jitted here)."""
    import jax.numpy as jnp
    from deltafl_jax.run.program import TableRound
    cfg = tiny_config(thetas=(1.0, 0.5), seeds=(1, 2), clients_per_step=lanes, local_epochs=2)
    exp = build_experiment(cfg, tiny_synthetic)
    table_round = exp.round_fn
    assert isinstance(table_round, TableRound)
    run = exp.run
    plain = jax.jit(rounds.build_round_fn(
        run.model, run.algorithm, run.replicas, table_round_local(exp), exp.placement.eval_chunk,
        exp.placement.eval_lanes, exp.program.slots))
    keys = exp.keys()

    def three(fn, poison=False):
        state = exp.initial_state()
        for t in range(3):
            if poison and table_round.tables is not None:
                table_round.tables = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan),
                                                  table_round.tables)
            state, metrics = fn(state, exp.round_data(t, state), keys)
        return jax.device_get((state, metrics))

    want = three(plain)
    for poison in (False, True):
        got = three(table_round, poison)
        chex.assert_trees_all_equal(got, want)
    assert jax.tree.leaves(table_round.tables)   # the rounds were given tables and kept them


def table_round_local(exp):
    """The experiment's local-SGD configuration, as its program built it (one device)."""
    from deltafl_jax.run import program
    return program._local_config(exp.run, exp.placement, None)
