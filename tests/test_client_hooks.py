"""The engine's client update on its own: an algorithm whose ``final`` alone differs from local
SGD's (no client state) gets each trained job's own result back, for every lane layout; the
clients that did not train report zeros."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from deltafl_jax import build_experiment, engine, rounds


def job_outputs(exp, lanes):
    """One round of FedAvg whose client update's final outputs (||w_k - w_t||, steps); the
    server update passes the outputs through its metrics."""
    base = exp.algorithm

    def client_final(step, client_state, params, hyper, job):
        assert client_state == ()
        _, delta, _ = engine.LOCAL_SGD.final(step, client_state, params, hyper, job)
        return (), delta, (jnp.sqrt(engine.tree_sqnorm(delta)), job.steps)

    def server_update(state, params, feedback, hyper):
        delta, state, metrics = base.server_update(state, params, feedback, hyper)
        norm, steps = feedback.client_outputs
        return delta, state, {**metrics, "out_norm": norm, "out_steps": steps,
                              "job_sqnorm": feedback.job_sqnorm}

    alg = base._replace(client_update=base.client_update._replace(final=client_final),
                        server_update=server_update)
    local = engine.LocalSGDConfig(batch_size=exp.config.batch_size, lanes=lanes)
    round_fn = jax.jit(rounds.build_round_fn(exp.model, alg, exp.replicas, local,
                                             exp.eval_chunk, 1, exp.num_sampled))
    state, _ = exp.round_fn(exp.initial_state(), exp.round_data(0), exp.keys())
    data = exp.round_data(1)   # after round 0 the losses differ: the filter drops clients
    _, metrics = round_fn(state, data, exp.keys())
    return jax.device_get(metrics), jax.device_get(data.plan)


@pytest.mark.parametrize("lanes", [3])   # one lane: tests/test_scaffold.py
def test_client_final_alone_returns_each_jobs_result(tiny_synthetic, lanes):
    exp = build_experiment(tiny_config(thetas=(1.0, 0.5), seeds=(1, 2), l2_reg=1e-3),
                           tiny_synthetic)
    metrics, plan = job_outputs(exp, lanes)
    trained = metrics["out_steps"] > 0
    assert trained.sum() == metrics["num_selected"].sum() and not trained.all()
    # Each trained job's own update norm is the engine's per-job norm; its steps the plan's.
    np.testing.assert_allclose(metrics["out_norm"] ** 2, metrics["job_sqnorm"], rtol=1e-5)
    group = exp.replicas.group
    np.testing.assert_array_equal(metrics["out_steps"][trained],
                                  np.asarray(plan.steps)[group][trained])
    assert np.all(metrics["out_norm"][~trained] == 0) and np.all(metrics["out_norm"][trained] > 0)
