"""The worked example of the protocol (deltafl_jax/algorithms/minimal.py, plain averaging): its
hooks on hand-made inputs against NumPy, a round of it in the engine against FedAvg with
uniform weights, and the guide "Add an algorithm" shows its code as it is."""

import os
import re

import jax
import numpy as np

from conftest import tiny_config
from deltafl_jax import build_experiment, engine, rounds
from deltafl_jax.algorithms import minimal
from deltafl_jax.algorithms.fedavg import FedAvgOptions, fedavg
from deltafl_jax.algorithms.protocol import ClientFeedback, RoundContext

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_client_with_examples_weighs_one_and_the_update_is_their_mean():
    alg = minimal.plain_average()
    sizes = np.array([30, 0, 12, 7], np.int32)
    ctx = RoundContext((), np.full(4, np.nan, np.float32), sizes, None, None, np.arange(4))
    a = np.asarray(alg.client_weights(ctx))
    np.testing.assert_array_equal(a, [1.0, 0.0, 1.0, 1.0])
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 2)).astype(np.float32)}
    updates = rng.normal(size=(4, 3, 2)).astype(np.float32)
    finite = np.array([True, False, True, False])      # client 3's update was not finite
    kept = a * finite
    feedback = ClientFeedback(
        losses=ctx.losses, sizes=sizes, weights=a,
        delta_sum={"w": np.tensordot(kept, updates, axes=1)}, weight_sum=np.float32(kept.sum()),
        job_sqnorm=np.zeros(4, np.float32), job_finite=finite, job_trained=a > 0,
        learning_rate=np.float32(0.1))
    delta, state, metrics = alg.server_update((), params, feedback, None)
    np.testing.assert_allclose(np.asarray(delta["w"]), (updates[0] + updates[2]) / 2, rtol=1e-6)
    assert state == () and metrics == {}


def test_a_round_of_it_is_fedavg_with_uniform_weights(tiny_synthetic):
    exp = build_experiment(tiny_config(algorithm="fedavg", thetas=()), tiny_synthetic)
    local = engine.LocalSGDConfig(batch_size=exp.config.batch_size, lanes=exp.lanes)
    state = exp.initial_state()
    out = {}
    for name, alg in (("plain", minimal.plain_average()),
                      ("fedavg", fedavg(FedAvgOptions(weighting="unweighted")))):
        round_fn = jax.jit(rounds.build_round_fn(exp.model, alg, exp.replicas, local,
                                                 exp.eval_chunk, 1, exp.num_sampled,
                                                 exp.program.server_tx))
        out[name] = jax.device_get(round_fn(state, exp.round_data(0), exp.keys())[0].params)
    for a, b, w in zip(jax.tree.leaves(out["plain"]), jax.tree.leaves(out["fedavg"]),
                       jax.tree.leaves(jax.device_get(state.params))):
        assert not np.array_equal(a, w)                      # the round moved the model
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_guide_shows_the_module_as_it_is():
    with open(os.path.join(REPO, "docs", "guides", "add-algorithm.md")) as f:
        guide = f.read()
    shown = re.search(r"```python\n(.*?)```", guide, re.S).group(1)
    with open(minimal.__file__) as f:
        source = f.read()
    code = source[source.index("from __future__"):]
    assert shown.strip() == code.strip()
