r"""FedJAX's own FedAvg on an exported dataset, driven round by round over stdin/stdout.

Run by ``bench/peers.py`` with the python of the pinned FedJAX virtual environment (FedJAX
0.0.17, jax 0.4.30, dm-haiku): it imports neither deltafl_jax nor the rest of bench/.

    <peer venv>/bin/python bench/peer_fedjax.py --data=DATA.npz --model=cnn --batch_size=16

The npz holds ``x`` (float32 [N, 28, 28, 1], pixels in [0, 1]), ``y`` (int32 [N]),
``offsets`` ([K + 1], client k owns rows offsets[k]:offsets[k+1]) and ``clients``
([T, m], the clients sampled in round t: the same ones the engine trains).

The model is the paper's ConvNet (conv5x5-32, ReLU, maxpool 2, conv5x5-64, ReLU, maxpool 2,
dense to 62 classes) or softmax regression, written in Haiku as a FedJAX user would, and the
algorithm is ``fedjax.algorithms.fed_avg.federated_averaging`` with client SGD (lr 0.05),
server SGD with learning rate 1 (plain weighted averaging), one local epoch of shuffled batches,
and FedJAX's default ``jit`` backend of ``for_each_client``.

Protocol: the script prints ``READY <json>`` (versions), then for each line ``round T`` on
stdin it runs round T and prints ``DONE <json>`` with the seconds the round took (measured
here, until the new server parameters are ready) and the examples the round computed against
the real ones (FedJAX fills a client's last short batch with more of its examples, so a client
computes ceil(n_k / B) B); ``quit`` ends it.
"""

from __future__ import annotations

import json
import time

from peer_common import arguments, serve

# The packages whose versions go to bench/peers.py.
PACKAGES = ("fedjax", "jax", "jaxlib", "dm-haiku", "optax", "numpy")


def build_model(name: str, num_classes: int):
    import fedjax
    import haiku as hk
    import jax
    import jax.numpy as jnp

    def forward(batch):
        x = batch["x"]
        if name == "cnn":
            x = jax.nn.relu(hk.Conv2D(32, 5, padding="SAME")(x))
            x = hk.max_pool(x, 2, 2, "VALID")
            x = jax.nn.relu(hk.Conv2D(64, 5, padding="SAME")(x))
            x = hk.max_pool(x, 2, 2, "VALID")
        return hk.Linear(num_classes)(hk.Flatten()(x))

    def train_loss(batch, preds):
        return fedjax.metrics.unreduced_cross_entropy_loss(batch["y"], preds)

    sample = {"x": jnp.zeros((1, 28, 28, 1), jnp.float32), "y": jnp.zeros((1,), jnp.int32)}
    return fedjax.create_model_from_haiku(
        transformed_forward_pass=hk.transform(forward), sample_batch=sample,
        train_loss=train_loss,
        eval_metrics={"loss": fedjax.metrics.CrossEntropyLoss()})


def main():
    ap = arguments()
    args = ap.parse_args()

    import fedjax
    import jax
    import numpy as np
    from fedjax.algorithms import fed_avg

    fedjax.set_for_each_client_backend("jit")
    d = np.load(args.data)
    x, y, offsets, sampled = d["x"], d["y"], d["offsets"], d["clients"]
    model = build_model(args.model, args.num_classes)
    algorithm = fed_avg.federated_averaging(
        grad_fn=fedjax.model_grad(model),
        client_optimizer=fedjax.optimizers.sgd(args.learning_rate),
        server_optimizer=fedjax.optimizers.sgd(1.0),
        client_batch_hparams=fedjax.ShuffleRepeatBatchHParams(
            batch_size=args.batch_size, num_epochs=1))
    state = algorithm.init(model.init(jax.random.PRNGKey(0)))
    rng = jax.random.PRNGKey(1)

    def client(k):
        a, b = int(offsets[k]), int(offsets[k + 1])
        return fedjax.ClientDataset({"x": x[a:b], "y": y[a:b]})

    for _, t, _ in serve(PACKAGES):
        rng, *keys = jax.random.split(rng, sampled.shape[1] + 1)
        clients = [(int(k), client(int(k)), key) for k, key in zip(sampled[t], keys)]
        t0 = time.perf_counter()
        state, _ = algorithm.apply(state, clients)
        jax.block_until_ready(state.params)
        dt = time.perf_counter() - t0
        n = [len(c[1]) for c in clients]   # a last short batch is filled with more examples
        print("DONE " + json.dumps({"round": t, "seconds": dt, "real_examples": sum(n),
                                    "padded_examples": sum(-(-k // args.batch_size)
                                                           * args.batch_size for k in n)}),
              flush=True)


if __name__ == "__main__":
    main()
