"""The accelerator path checked on CPU.

On a GPU or TPU the engine places client work differently from the CPU: m vmapped lanes per
device, evaluation chunks of 1024 with one evaluation lane per replica, and XLA's own
convolutions; no test machine has an accelerator, so ``--placement_backend=gpu`` (with
``--branchless``, the loop body that an accelerator may want) runs that program on the CPU. Here a
small ConvNet run on FEMNIST-shaped data and a small GRU run on Shakespeare-shaped data train
FedAvg (theta = 1) and Delta-FL (theta = 0.5) as replicas of one program, once with the CPU's
defaults and once with the accelerator's, and must sample the same clients, train the same
examples and end with the same models to 1e-5 (absolute and relative).
"""

import jax
import numpy as np
import pytest

from conftest import run_runner, tiny_config
from deltafl_jax import ClientData, FederatedDataset, build_experiment

ROUNDS = 3
ACCELERATOR = dict(placement_backend="gpu", branchless=True)


def femnist_shaped(num_clients=8, seed=0):
    """28x28 uint8 images scaled by 1/255 (as FEMNIST is stored), 62 classes, 8-20 each."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(8, 21, size=num_clients)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    x = rng.integers(0, 256, (offsets[-1], 28, 28), dtype=np.uint8)
    y = rng.integers(0, 62, offsets[-1]).astype(np.int32)
    split = ClientData(x=x, y=y, offsets=offsets, client_ids=np.arange(num_clients))
    return FederatedDataset("femnist_like", split, split, num_classes=62, x_scale=1 / 255)


def shakespeare_shaped(num_clients=8, seed=0):
    """Windows of 20 uint8 character ids and the next one, 53 characters, 8-20 each."""
    rng = np.random.default_rng(seed)
    xs = [rng.integers(0, 53, (int(n), 20)).astype(np.uint8)
          for n in rng.integers(8, 21, size=num_clients)]
    ys = [rng.integers(0, 53, len(x)).astype(np.int32) for x in xs]
    split = ClientData.from_clients(xs, ys)
    return FederatedDataset("shakespeare", split, split, 53, None, {"input_vocab_size": 53})


# The CPU's defaults for each (bench/README.md): the ConvNet runs 2 unrolled lanes of plain
# convolutions with an im2col weight gradient and evaluation chunks of 128; the GRU 4 vmapped
# lanes and chunks of 2048. m = 6 for the GRU so that its 4 CPU lanes are fewer than m.
# Learning rates: 0.05 (the ConvNet) and 0.5 (the GRU) are stable here, the CPU/accelerator
# difference staying at float32 rounding after ROUNDS rounds rather than growing round by round.
CASES = {
    "cnn": (femnist_shaped, dict(model="cnn", clients_per_round=3, learning_rate=0.05),
            dict(lanes=2, lane_mode="unroll", eval_chunk=128, conv="im2col_wgrad")),
    "gru": (shakespeare_shaped, dict(model="gru", clients_per_round=6, learning_rate=0.5),
            dict(lanes=4, lane_mode="vmap", eval_chunk=2048, conv=None)),
}


def config(case, **extra):
    _, settings, _ = CASES[case]
    return tiny_config(thetas=(1.0, 0.5), seeds=(1,), batch_size=8, num_rounds=ROUNDS,
                       **settings, **extra)


def conv_impl(exp):
    return getattr(exp.model.module, "conv_impl", None)


def train(exp):
    state, keys = exp.initial_state(), exp.keys()
    plans, metrics = [], []
    for t in range(ROUNDS):
        plans.append(exp.round_plan(t))
        state, met = exp.round_fn(state, exp.round_data(t), keys)
        metrics.append(jax.device_get(met))
    return plans, metrics, [np.asarray(a) for a in jax.tree.leaves(state.params)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_placement_backend_forces_the_accelerator_defaults_and_leaves_the_cpu_ones(case):
    data = CASES[case][0]()
    cpu = build_experiment(config(case), data)
    want = CASES[case][2]
    assert (cpu.placement.lanes, cpu.placement.lane_mode, cpu.placement.eval_chunk,
            cpu.placement.eval_lanes, cpu.placement.branchless, conv_impl(cpu)) == \
        (want["lanes"], want["lane_mode"], want["eval_chunk"], 1, False, want["conv"])
    acc = build_experiment(config(case, **ACCELERATOR), data)
    m, replicas = cpu.num_sampled, 2
    assert (acc.placement.lanes, acc.placement.lane_mode, acc.placement.eval_chunk,
            acc.placement.eval_lanes, acc.placement.branchless, conv_impl(acc)) == \
        (m * replicas, "vmap", 1024, replicas, True,
         "im2col_wgrad" if case == "cnn" else None)   # every job of the round in a lane
    assert "lane(s) (vmap, as on gpu)" in acc.view().facts.placement_line
    assert "as on" not in cpu.view().facts.placement_line
    # Each default can also be set alone; the loop body without --branchless is the cond one.
    alone = build_experiment(config(case, placement_backend="gpu"), data).placement
    assert not alone.branchless and alone.lanes == m * replicas


def test_a_bad_placement_backend_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "o"
    code, err, _ = run_runner(["--dataset=synthetic", "--placement_backend=cuda",
                               f"--output_dir={out}"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--placement_backend" in err and "'cuda'" in err
    assert not out.exists()


@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request):
    data = CASES[request.param][0]()
    cpu = train(build_experiment(config(request.param), data))
    acc = train(build_experiment(config(request.param, **ACCELERATOR), data))
    return request.param, cpu, acc


@pytest.mark.slow
def test_same_clients_and_examples_as_the_cpu_defaults(runs):
    _, (cpu_plans, cpu_met, _), (acc_plans, acc_met, _) = runs
    for t in range(ROUNDS):
        for field in ("clients", "sizes", "steps", "train_idx", "train_start", "eval_len"):
            np.testing.assert_array_equal(getattr(acc_plans[t], field),
                                          getattr(cpu_plans[t], field), err_msg=field)
        # The evaluation streams differ only in their padding to a whole chunk.
        for g, n in enumerate(cpu_plans[t].eval_len):
            for field in ("eval_idx", "eval_seg"):
                np.testing.assert_array_equal(getattr(acc_plans[t], field)[g, :n],
                                              getattr(cpu_plans[t], field)[g, :n])
        for key in ("num_selected", "num_rejected", "kept_examples", "train_real_examples",
                    "eval_real_examples"):
            np.testing.assert_array_equal(acc_met[t][key], cpu_met[t][key], err_msg=key)
    # FedAvg kept every sampled client; Delta-FL's filter dropped some, so its path ran.
    m = len(cpu_plans[0].clients[0])
    assert all(met["num_selected"][0] == m for met in cpu_met)
    assert any(met["num_selected"][1] < m for met in cpu_met)


@pytest.mark.slow
def test_same_models_as_the_cpu_defaults_within_1e5(runs):
    _, (_, cpu_met, cpu_params), (_, acc_met, acc_params) = runs
    for t in range(ROUNDS):
        np.testing.assert_allclose(acc_met[t]["sampled_loss_mean"],
                                   cpu_met[t]["sampled_loss_mean"], rtol=1e-5, atol=1e-5)
    for a, c in zip(acc_params, cpu_params):
        assert np.max(np.abs(a - c)) <= 1e-5
        assert np.linalg.norm(a - c) <= 1e-5 * np.linalg.norm(c)
