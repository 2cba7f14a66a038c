"""Run by tests/test_devices.py in a subprocess with 8 fake CPU devices (the XLA flag must be
set before JAX starts): trains the same configuration on D = 1, 2, 4, 8 devices and prints one
JSON line per D with its metrics and final parameters, and the compiled HLO of D = 4 (with
its jobs per round, model size and per-client state size)."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's
from conftest import tiny_config  # noqa: E402
from deltafl_jax import DataConfig, build_experiment, load_dataset  # noqa: E402


def run(cfg, data, rounds):
    exp = build_experiment(cfg, data)
    state, keys = exp.initial_state(), exp.keys()
    mets = []
    for t in range(rounds):
        state, met = exp.round_fn(state, exp.round_data(t, state), keys)
        mets.append(jax.tree.map(lambda a: np.asarray(a).tolist(), met))
    per_client = exp.evaluate(exp.served_params(state))
    per_client.update(exp.evaluate_personal(state, rounds))
    return exp, state, {
        "metrics": mets,
        "params": [np.asarray(x).ravel().tolist() for x in jax.tree.leaves(
            (state.params, state.algo_state, state.server_opt_state, state.client_state))],
        "summary": {k: v.tolist() for k, v in exp.summarize(per_client).items()}}


def main(which):
    if which in ("synthetic", "scaffold", "ditto"):
        data = load_dataset(DataConfig("synthetic", synthetic_num_clients=40,
                                       synthetic_max_examples=200, synthetic_alpha=1.0,
                                       synthetic_beta=0.5, synthetic_shared=0.98))
        cfg = dict(thetas=(1.0, 0.8, 0.5, 0.1), seeds=(1, 2), num_rounds=6,
                   clients_per_round=8, batch_size=10, learning_rate=0.1)
        if which == "scaffold":   # per-client state and a server optimizer across devices
            cfg.update(algorithm="scaffold", thetas=(), server_optimizer="adam",
                       server_lr=(0.05,))
        if which == "ditto":     # personal models as per-client state, over Delta-FL's filter,
            cfg.update(algorithm="deltafl+ditto", thetas=(1.0, 0.5),  # and the personalised
                       ditto_lambda=(0.5,), client_holdout=0.2,  # evaluation
                       finetune_steps=(0, 3), learning_rate=0.05)
        rounds = 6
    else:  # the ConvNet on small FEMNIST-shaped data; "cnn_chunks": its big leaves' blocks
        if which == "cnn_chunks":   # cross the devices in 64 KB chunks (a loop of permutes)
            from deltafl_jax.engine import lanes
            lanes.EXCHANGE_CHUNK_BYTES = 1 << 16
        rng = np.random.default_rng(0)
        from deltafl_jax import ClientData, FederatedDataset
        sizes = rng.integers(8, 30, size=12)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        x = rng.random((offsets[-1], 784)).astype(np.float32)
        y = rng.integers(0, 10, offsets[-1]).astype(np.int32)
        split = ClientData(x=x, y=y, offsets=offsets, client_ids=np.arange(12))
        data = FederatedDataset("images", split, split, num_classes=10)
        cfg = dict(model="cnn", thetas=(1.0, 0.5), seeds=(1,), clients_per_round=6,
                   batch_size=8, learning_rate=0.05, eval_chunk=32)
        rounds = 2
    for D in (1, 2, 4, 8):
        exp, state, out = run(tiny_config(devices=D, **cfg), data, rounds)
        out["devices"] = D
        if D == 4:
            data0 = exp.round_data(0, state)
            out["hlo"] = exp.round_fn.lower(state, data0, exp.keys()).compile().as_text()
            R = jax.tree.leaves(state.params)[0].shape[0]
            out["jobs"] = R * exp.config.clients_per_round
            out["model_size"] = sum(x.size for x in jax.tree.leaves(state.params)) // R
            out["client_state_size"] = sum(x.size // (x.shape[0] * x.shape[1])
                                           for x in jax.tree.leaves(state.client_state))
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
