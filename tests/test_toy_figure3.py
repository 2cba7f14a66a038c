"""The paper's Figure 3: mean estimation on three Gaussians with an obtuse triangle of means.

Closed form (Section 3): FedAvg (theta = 1) minimises the average of F_k(w) = ||mu_k - w||^2 +
const, i.e. the centroid; at theta = 2/3 (alpha = 1/3 each) the objective is the average of the
two largest F_k, minimised at the midpoint of the longest side when the angle opposite it is
obtuse. With full-batch local steps the rounds converge geometrically to these points of the
clients' empirical means.
"""

import numpy as np

from conftest import tiny_config
from deltafl_jax import DataConfig, load_dataset, run_experiment

MEANS = ((0.0, 0.0), (1.5, 1.0), (4.0, 0.0))  # angle at (1.5, 1) is obtuse


def test_theta_two_thirds_goes_to_the_longest_side_midpoint_and_fedavg_to_the_centroid():
    a, b, c = (np.array(m) for m in MEANS)
    assert np.dot(a - b, c - b) < 0  # obtuse at b, so the longest side is a-c
    data_cfg = DataConfig("gaussian_toy", toy_means=MEANS, toy_examples_per_client=400,
                          data_seed=7)
    data = load_dataset(data_cfg)
    mu_hat = np.stack([data.train.client(k)[0].mean(0) for k in range(3)])
    cfg = tiny_config(data=data_cfg, model="mean", thetas=(1.0, 2 / 3), seeds=(1,),
                      num_rounds=120, clients_per_round=3, batch_size=400,
                      learning_rate=0.1, eval_every=120, clients_per_step=1)
    out = run_experiment(cfg, data)
    w = np.asarray(out.state.params["w"])
    labels = [lab["theta"] for lab in out.summary["replicas"]]
    w_fedavg = w[labels.index(1.0)]
    w_delta = w[labels.index(2 / 3)]
    np.testing.assert_allclose(w_fedavg, mu_hat.mean(0), atol=1e-4)
    np.testing.assert_allclose(w_delta, (mu_hat[0] + mu_hat[2]) / 2, atol=1e-4)
    # And the worst-case loss over mixtures of conformity >= 2/3 is lower for w_{2/3}.
    def worst(wv):
        F = np.sort(((mu_hat - wv) ** 2).sum(1))[::-1]
        return F[:2].mean()
    assert worst(w_delta) < worst(w_fedavg)
