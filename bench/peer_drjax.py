r"""FedAvg written with DrJAX (Flax and optax) on an exported dataset, driven round by round.

Run by ``bench/peers.py`` with the python of the pinned DrJAX virtual environment (drjax
0.2.1 on the engine's own jax, jaxlib, flax and optax releases): it imports neither
deltafl_jax nor the rest of bench/.

    <peer venv>/bin/python bench/peer_drjax.py --data=DATA.npz --model=cnn --batch_size=16

The npz holds ``x`` (float32 [N, 28, 28, 1], pixels in [0, 1]), ``y`` (int32 [N]),
``offsets`` ([K + 1], client k owns rows offsets[k]:offsets[k+1]), ``clients`` ([T, m], the
clients sampled in round t) and ``order`` ([T, L], for round t the sampled clients' example
orders laid end to end in the order of ``clients[t]``, each a permutation of range(n_k),
-1 after the last): the clients, examples and minibatches the engine trains in round t.

The round is the FedAvg of DrJAX's documentation: one ``drjax.program`` with the placement
``clients`` of size m; ``drjax.broadcast`` puts the server model at the clients,
``drjax.map_fn`` runs every client's local SGD (one epoch, minibatches of B, optax SGD) and
returns its update, and ``drjax.reduce_weighted_mean`` averages the updates with weights n_k,
which the server adds to its model (server learning rate 1). ``map_fn`` maps one function
over the clients, so every client runs the same number of steps: each is padded to the
largest sampled client's ceil(n_k / B) batches, and a padded example is masked out of its
batch's mean loss (an all-padding step has a zero gradient, so SGD leaves the model as it
is). With ``--devices=D`` (D > 1 host devices on a CPU, as the engine's ``--devices``) a
mesh with the axis ``clients`` is installed, the round's index arrays are split over it, and
DrJAX's sharding annotations spread the clients over the devices. The round is jitted once (m, the padded shape and the model are fixed for a run: the
padded shape is that of the largest m clients of the population). The training split lives
on the device for the whole run, as in the engine; a round receives only the example indices
of its clients ([m, steps, B]) and their masks, and gathers each minibatch on the device.

Protocol (that of ``bench/peer_fedjax.py``): the script prints ``READY <json>`` (versions),
then for each line ``round T`` on stdin it runs round T from its own server model and prints
``DONE <json>`` with the seconds the jitted round took (until the new model is ready), the
seconds spent building the round's index arrays on the host and putting them on the device
(not in ``seconds``, as the engine's host-side plan is not in its figure) and the padded and real example counts.
``check T LR IN.npz OUT.npz`` runs the same jitted round T at the client learning rate LR
from the model in IN.npz (keys like ``Conv_0/kernel``) and writes the new model to OUT.npz, leaving the server model alone;
``quit`` ends it.
"""

from __future__ import annotations

import json
import os
import time

from peer_common import arguments, serve

# The packages whose versions go to bench/peers.py.
PACKAGES = ("drjax", "jax", "jaxlib", "flax", "optax", "numpy")


def build_module(name: str, num_classes: int):
    import flax.linen as nn

    class SoftmaxRegression(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(num_classes)(x.reshape((x.shape[0], -1)))

    class ConvNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            for feats in (32, 64):
                x = nn.Conv(feats, (5, 5), padding="SAME")(x)
                x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
            return nn.Dense(num_classes)(x.reshape((x.shape[0], -1)))

    return ConvNet() if name == "cnn" else SoftmaxRegression()


def build_round(module, m: int):
    """The jitted FedAvg round (server_params, idx [m, S, B], mask [m, S, B], n [m], x, y,
    learning_rate): the client learning rate is an argument (a float32 scalar), so the
    ``check`` at another rate reuses the compiled round."""
    import drjax
    import jax
    import jax.numpy as jnp
    import optax

    def batch_loss(params, xb, yb, mb):
        logits = module.apply({"params": params}, xb)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
        return jnp.sum(jnp.where(mb, losses, 0.0)) / jnp.maximum(jnp.sum(mb), 1)

    def local_update(params, idx, mask, x, y, learning_rate):
        """One epoch of SGD over the client's (padded) batches; returns w_k - w."""
        client_opt = optax.sgd(learning_rate)

        def step(carry, batch):
            p, opt_state = carry
            i, mb = batch
            grads = jax.grad(batch_loss)(p, x[i], y[i], mb)
            updates, opt_state = client_opt.update(grads, opt_state, p)
            return (optax.apply_updates(p, updates), opt_state), None

        (trained, _), _ = jax.lax.scan(step, (params, client_opt.init(params)), (idx, mask))
        return jax.tree.map(jnp.subtract, trained, params)

    @drjax.program(placements={"clients": m})
    def fedavg_round(server_params, idx, mask, n, x, y, learning_rate):
        at_clients = drjax.broadcast(server_params)
        updates = drjax.map_fn(lambda p, i, mb: local_update(p, i, mb, x, y, learning_rate),
                               (at_clients, idx, mask))
        weights = jax.tree.map(lambda _: n, updates)   # one weight per client, every leaf
        mean_update = drjax.reduce_weighted_mean(updates, weights)
        return jax.tree.map(jnp.add, server_params, mean_update)

    return jax.jit(fedavg_round)


def round_arrays(t, clients, order, offsets, steps: int, batch: int):
    """Global example indices [m, steps, B] of round t's minibatches, their mask, n_k."""
    import numpy as np

    m = clients.shape[1]
    idx = np.zeros((m, steps * batch), np.int32)
    mask = np.zeros((m, steps * batch), bool)
    n = (offsets[clients[t] + 1] - offsets[clients[t]]).astype(np.int64)
    pos = 0
    for i, (k, nk) in enumerate(zip(clients[t], n)):
        perm = order[t, pos:pos + nk]
        pos += nk
        idx[i, :nk] = offsets[k] + perm
        mask[i, :nk] = True
    return (idx.reshape(m, steps, batch), mask.reshape(m, steps, batch),
            n.astype(np.float32))


def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, name + "/"))
        else:
            out[name] = value
    return out


def nested(flat_params):
    out = {}
    for name, value in flat_params.items():
        *path, leaf = name.split("/")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def params_devices(params):
    import jax
    return set().union(*(leaf.devices() for leaf in jax.tree.leaves(params)))


def main():
    ap = arguments()
    ap.add_argument("--devices", type=int, default=1,
                    help="D > 1: D host devices and a mesh with the axis 'clients'")
    args = ap.parse_args()
    if args.devices > 1:   # before JAX starts its backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")

    import jax
    import jax.numpy as jnp
    import numpy as np

    d = np.load(args.data)
    offsets, sampled, order = d["offsets"], d["clients"], d["order"]
    m, B = sampled.shape[1], args.batch_size
    sizes = np.diff(offsets)
    steps = int(-(-sizes.max() // B))   # the batches of the population's largest client
    if m % args.devices:
        raise SystemExit(f"--devices={args.devices} does not divide m = {m}")
    placed = None
    if args.devices > 1:
        mesh = jax.make_mesh((args.devices,), ("clients",),
                             axis_types=(jax.sharding.AxisType.Auto,))
        jax.sharding.set_mesh(mesh)
        placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("clients"))
    x, y = jax.device_put(d["x"]), jax.device_put(d["y"])
    module = build_module(args.model, args.num_classes)
    params = module.init(jax.random.key(0), jnp.zeros((1,) + x.shape[1:], x.dtype))["params"]
    round_fn = build_round(module, m)
    timed_lr = jnp.float32(args.learning_rate)

    for verb, t, rest in serve(PACKAGES):
        t0 = time.perf_counter()
        idx, mask, n = round_arrays(t, sampled, order, offsets, steps, B)
        # On the device before the clock starts, as the engine's plan; with a mesh each
        # device holds its clients' indices.
        idx, mask, n = jax.block_until_ready(jax.device_put((idx, mask, n), placed))
        host_s = time.perf_counter() - t0
        if verb == "check":   # check LEARNING_RATE START.npz OUT.npz
            rate, start_file, out_file = rest
            start = nested({k: jnp.asarray(v) for k, v in np.load(start_file).items()})
            new = jax.device_get(round_fn(start, idx, mask, n, x, y, jnp.float32(rate)))
            np.savez(out_file, **flat(new))
            print("DONE " + json.dumps({"round": t, "check": out_file}), flush=True)
            continue
        t0 = time.perf_counter()
        params = round_fn(params, idx, mask, n, x, y, timed_lr)
        jax.block_until_ready(params)
        dt = time.perf_counter() - t0
        print("DONE " + json.dumps({"round": t, "seconds": dt, "host_s": host_s,
                                    "padded_examples": int(mask.size),
                                    "real_examples": int(jnp.sum(mask)),
                                    "devices": len(params_devices(params))}), flush=True)


if __name__ == "__main__":
    main()
