"""Generated federated datasets: Synthetic(alpha, beta) and the Figure 3 Gaussians.

**Synthetic(alpha, beta)** is the benchmark of the FedProx and q-FFL papers. None of the Delta-FL
papers uses it (CISS 2021 Table I is EMNIST and Sent140; the long paper and the 2022 paper add
the linear models and Shakespeare); here it is a fast stand-in for their comparisons. Client k has a model shift u_k ~ N(0, alpha^2) and a feature shift
B_k ~ N(0, beta^2); its labelling model W_k in R^{60x10}, b_k in R^10 has entries ~ N(u_k, 1);
its inputs are x ~ N(v_k, Sigma) with v_k[j] ~ N(B_k, 1) and Sigma = diag(j^{-1.2}); its labels
are y = argmax softmax(x W_k + b_k). Client sizes follow the power law lognormal(4, 2) + 50,
capped at ``synthetic_max_examples``. (As in the original benchmark code, alpha and beta are the
standard deviations of the shifts.) Half the clients train and half test.

**On demand** (``synthetic_on_demand``; by default above ``ON_DEMAND_CLIENTS`` = 10^5 clients):
the same distribution, generated client by client. At the default sizes a million clients
would be over 60 GB, so only the population's draws (sizes n_k, shifts u_k and B_k, W_0, b_0:
a few numbers per client) are drawn at load, from the stream ``[data_seed, 0]``, and client
k's own draws (v_k, W_k, b_k, its inputs) from the stream ``[data_seed, 1, k]`` whenever a round
or an evaluation reads it (:class:`deltafl_jax.data.GeneratedClientData`), in float32 (its
noise, its inputs and the logits that label them: a round's generation then costs less than
its training). These are other
random streams than the sequential generator's, so the same seed gives another (equally
distributed) population: below the threshold the sequential generator stays the default, and
every flagfile and recorded output keeps its data.

Held-out clients of that benchmark share nothing learnable with the training clients (each
draws its own W_k), so a model trained on one half cannot beat chance on the other half.
``synthetic_shared = rho`` in [0, 1) generalises it: W_k = u_k + rho W_0 + sqrt(1 - rho^2) Z_k
(and likewise b_k) with one W_0 ~ N(0, 1) common to all clients and Z_k ~ N(0, 1) the client's
own part. Each entry still has variance 1 around u_k; rho = 0 is the original benchmark.

**gaussian_toy** is the illustration of the paper's Figure 3: N = 3 clients with equal weight,
client k holding samples of N(mu_k, I_2); with the mean-estimation model and the squared loss,
FedAvg (theta = 1) converges to the centroid and Delta-FL at theta = 2/3 to the midpoint of the
longest side when the triangle of means is obtuse. The test split holds fresh samples of the
same three Gaussians.
"""

from __future__ import annotations

import numpy as np

from deltafl_jax.data import (ClientData, DataError, FederatedDataset, GeneratedClientData,
                              split_clients)

SYNTHETIC_DIM = 60
SYNTHETIC_CLASSES = 10
ON_DEMAND_CLIENTS = 100_000   # populations above this are generated on demand by default


def _check(alpha, beta, num_clients, max_examples, shared):
    if not 0.0 <= shared < 1.0:
        raise DataError(f"--synthetic_shared must lie in [0, 1), got {shared}")
    if alpha < 0 or beta < 0:
        raise DataError(f"synthetic alpha and beta must be >= 0, got {alpha}, {beta}")
    if num_clients < 2:
        raise DataError(f"synthetic needs at least 2 clients, got {num_clients}")
    if max_examples < 50:
        raise DataError(f"--synthetic_max_examples must be at least 50, got {max_examples}")


def _feature_std():
    return np.power(np.arange(1, SYNTHETIC_DIM + 1, dtype=np.float64), -1.2 / 2)


def synthetic_clients(alpha: float, beta: float, num_clients: int, seed: int,
                      max_examples: int = 1000, shared: float = 0.0) -> ClientData:
    _check(alpha, beta, num_clients, max_examples, shared)
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.lognormal(4, 2, num_clients).astype(np.int64) + 50, max_examples)
    u = rng.normal(0.0, alpha, num_clients)
    shift = rng.normal(0.0, beta, num_clients)
    std = _feature_std()
    # Drawn even when shared = 0, so that rho changes the labels and not the other draws.
    W0 = rng.standard_normal((SYNTHETIC_DIM, SYNTHETIC_CLASSES))
    b0 = rng.standard_normal(SYNTHETIC_CLASSES)
    own = np.sqrt(1.0 - shared ** 2)
    xs, ys = [], []
    for k in range(num_clients):
        v = rng.normal(shift[k], 1.0, SYNTHETIC_DIM)
        W = u[k] + shared * W0 + own * rng.standard_normal((SYNTHETIC_DIM, SYNTHETIC_CLASSES))
        b = u[k] + shared * b0 + own * rng.standard_normal(SYNTHETIC_CLASSES)
        x = v + rng.standard_normal((sizes[k], SYNTHETIC_DIM)) * std
        ys.append(np.argmax(x @ W + b, axis=1).astype(np.int32))  # argmax softmax = argmax
        xs.append(x.astype(np.float32))
    return ClientData.from_clients(xs, ys)


class _OnDemand:
    """Client k of Synthetic(alpha, beta) from its own stream (module docstring, "On demand")."""

    def __init__(self, alpha, beta, num_clients, seed, max_examples, shared):
        _check(alpha, beta, num_clients, max_examples, shared)
        rng = np.random.default_rng([seed, 0])
        self.sizes = np.minimum(rng.lognormal(4, 2, num_clients).astype(np.int64) + 50,
                                max_examples)
        self.u = rng.normal(0.0, alpha, num_clients)
        self.shift = rng.normal(0.0, beta, num_clients)
        self.W0 = rng.standard_normal((SYNTHETIC_DIM, SYNTHETIC_CLASSES))
        self.b0 = rng.standard_normal(SYNTHETIC_CLASSES)
        self.seed, self.shared, self.std = int(seed), float(shared), _feature_std()

    def __call__(self, k: int):
        rng = np.random.default_rng([self.seed, 1, int(k)])
        own = np.sqrt(1.0 - self.shared ** 2)
        v = rng.normal(self.shift[k], 1.0, SYNTHETIC_DIM)
        W = self.u[k] + self.shared * self.W0 + own * rng.standard_normal(self.W0.shape)
        b = self.u[k] + self.shared * self.b0 + own * rng.standard_normal(SYNTHETIC_CLASSES)
        z = rng.standard_normal((int(self.sizes[k]), SYNTHETIC_DIM), dtype=np.float32)
        x = (v + z * self.std).astype(np.float32)
        logits = x @ W.astype(np.float32) + b.astype(np.float32)
        return x, np.argmax(logits, axis=1).astype(np.int32)


def synthetic_on_demand(alpha: float, beta: float, num_clients: int, seed: int,
                        max_examples: int = 1000, shared: float = 0.0) -> GeneratedClientData:
    """Every client of Synthetic(alpha, beta), generated when read."""
    gen = _OnDemand(alpha, beta, num_clients, seed, max_examples, shared)
    recipe = (f"synthetic_on_demand(alpha={alpha!r}, beta={beta!r}, n={num_clients}, "
              f"seed={seed}, max={max_examples}, shared={shared!r})")
    return GeneratedClientData(
        offsets=np.concatenate([[0], np.cumsum(gen.sizes)]),
        client_ids=np.arange(num_clients, dtype=np.int64), generate=gen,
        feature_shape=(SYNTHETIC_DIM,), x_dtype=np.dtype(np.float32), has_labels=True,
        recipe=recipe, max_size=int(max_examples))


def on_demand(config) -> bool:
    """Whether `config` generates Synthetic's clients on demand (module docstring)."""
    flag = config.synthetic.on_demand
    return config.synthetic.num_clients > ON_DEMAND_CLIENTS if flag is None else bool(flag)


def load_synthetic(config) -> FederatedDataset:
    make = synthetic_on_demand if on_demand(config) else synthetic_clients
    gen = config.synthetic
    clients = make(gen.alpha, gen.beta, gen.num_clients, config.data_seed, gen.max_examples,
                   gen.shared)
    train, test = split_clients(clients, seed=config.data_seed)
    return FederatedDataset(
        name="synthetic", train=train, test=test, num_classes=SYNTHETIC_CLASSES,
        metadata={"alpha": gen.alpha, "beta": gen.beta, "shared": gen.shared})


def gaussian_clients(means, n: int, rng) -> ClientData:
    xs = [np.asarray(mu, np.float32) + rng.standard_normal((n, 2)).astype(np.float32)
          for mu in means]
    return ClientData.from_clients(xs, None)


def load_gaussian_toy(config) -> FederatedDataset:
    means = np.asarray(config.toy.means, dtype=np.float64)
    if means.ndim != 2 or means.shape[1] != 2 or means.shape[0] < 2:
        raise DataError(f"--toy_means must list at least two 2-D points, got {config.toy.means}")
    n = int(config.toy.examples_per_client)
    if n < 1:
        raise DataError(f"--toy_examples_per_client must be positive, got {n}")
    rng = np.random.default_rng(config.data_seed)
    train = gaussian_clients(means, n, rng)
    test = gaussian_clients(means, n, rng)
    return FederatedDataset(name="gaussian_toy", train=train, test=test, num_classes=0,
                            metadata={"means": means.tolist()})
