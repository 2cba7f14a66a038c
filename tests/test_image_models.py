"""The image models (fedavg_cnn, pfl_cnn, resnet18_gn) and --augment=crop_flip.

References: the published parameter counts, and counts by hand; forward passes and
directional derivatives of an independent NumPy (float64) implementation with the same weights;
Delta-FL at theta = 1 against FedAvg; the augmented minibatch and one engine round against a
NumPy restatement with the same random draws."""

import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_rounds_history, tiny_config
from numpy_reference import local_sgd
from deltafl_jax import ClientData, FederatedDataset
from deltafl_jax.datasets import DataConfig
from deltafl_jax.models import ModelOptions, build_model, register_model
from deltafl_jax.models.augment import crop_flip, crop_flip_draws
from deltafl_jax.models.image import FedAvgCNN, PflCNN, ResNetGN, IMAGE_LANES
from deltafl_jax.models.model import Model
from deltafl_jax.run.config import ExperimentConfig
from deltafl_jax.run.experiment import build_experiment
from deltafl_jax.sampling.plan import client_permutations, sample_clients

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def image_split(num_clients, per_client, shape, classes, seed):
    rng = np.random.default_rng(seed)
    n = num_clients * per_client
    return ClientData(x=rng.integers(0, 256, size=(n,) + shape, dtype=np.uint8),
                      y=rng.integers(0, classes, size=n).astype(np.int32),
                      offsets=np.arange(num_clients + 1) * per_client,
                      client_ids=np.arange(num_clients))


def image_data(shape=(8, 8, 3), classes=10, num_clients=6, per_client=6):
    return FederatedDataset("img", image_split(num_clients, per_client, shape, classes, 0),
                            image_split(3, per_client, shape, classes, 1),
                            num_classes=classes, x_scale=1 / 255)


def count(model):
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))


# ----------------------------------------------------------------------------- counts


def test_parameter_counts_are_the_published_ones():
    cifar = image_data((32, 32, 3))
    # pfl-research's CIFAR-10 benchmark CNN (its benchmarks' test_num_parameters)
    assert count(build_model("pfl_cnn", cifar)) == 1_626_442
    # McMahan et al.'s CNN on the paper's 24 x 24 crops ("about 10^6"): conv 5x5x3x64, conv
    # 5x5x64x64, two poolings to 6 x 6 x 64, dense 384, dense 192, dense 10
    expected = (5 * 5 * 3 * 64 + 64) + (5 * 5 * 64 * 64 + 64) + (6 * 6 * 64 * 384 + 384) \
        + (384 * 192 + 192) + (192 * 10 + 10)
    assert expected == 1_068_298
    assert count(build_model("fedavg_cnn", image_data((24, 24, 3)))) == expected
    # ResNet-18 (CIFAR stem) with GroupNorm: convolutions without bias, GN scale + offset
    # per channel, 1x1 projection + GN on the three downsampling shortcuts, dense to 10
    total, cin = 3 * 3 * 3 * 64 + 2 * 64, 64
    for stage, width in enumerate((64, 128, 256, 512)):
        for block in range(2):
            total += 3 * 3 * cin * width + 2 * width + 3 * 3 * width * width + 2 * width
            if stage > 0 and block == 0:
                total += cin * width + 2 * width
            cin = width
    total += 512 * 10 + 10
    assert total == 11_173_962   # torchvision-style CIFAR ResNet-18's learnable parameters
    assert count(build_model("resnet18_gn", cifar)) == total


# ----------------------------------------------------------------------------- NumPy forward


def np_conv(x, w, stride=1, pad=(0, 0)):
    """out[b, i, j, o] = sum_{di, dj, c} xpad[b, s i + di, s j + dj, c] w[di, dj, c, o]."""
    k0, k1 = w.shape[:2]
    xp = np.pad(x, ((0, 0), (pad[0], pad[1]), (pad[0], pad[1]), (0, 0)))
    oh = (xp.shape[1] - k0) // stride + 1
    ow = (xp.shape[2] - k1) // stride + 1
    out = np.zeros((x.shape[0], oh, ow, w.shape[3]))
    for di in range(k0):
        for dj in range(k1):
            patch = xp[:, di:di + stride * (oh - 1) + 1:stride, dj:dj + stride * (ow - 1) + 1:stride]
            out += patch @ w[di, dj]
    return out


def np_group_norm(x, p, groups, eps=1e-5):
    b, h, w, c = x.shape
    g = x.reshape(b, h, w, groups, c // groups)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = g.var(axis=(1, 2, 4), keepdims=True)
    return ((g - mean) / np.sqrt(var + eps)).reshape(x.shape) * p["scale"] + p["bias"]


def relu(x):
    return np.maximum(x, 0.0)


def np_resnet(p, x, groups, blocks):
    x = relu(np_group_norm(np_conv(x, p["stem"], pad=(1, 1)), p["stem_gn"], groups))
    for s, count_ in enumerate(blocks):
        for b in range(count_):
            q = p[f"stage{s + 1}_block{b + 1}"]
            stride = 2 if s > 0 and b == 0 else 1
            y = relu(np_group_norm(np_conv(x, q["conv1"], stride, (1, 1)), q["gn1"], groups))
            y = np_group_norm(np_conv(y, q["conv2"], pad=(1, 1)), q["gn2"], groups)
            if "shortcut" in q:
                x = np_group_norm(np_conv(x, q["shortcut"], stride), q["shortcut_gn"], groups)
            x = relu(y + x)
    return x.mean(axis=(1, 2)) @ p["dense"]["kernel"] + p["dense"]["bias"]


def np_pfl_cnn(p, x):
    x = relu(np_conv(x, p["conv1_kernel"]) + p["conv1_bias"])
    x = relu(np_conv(x, p["conv2_kernel"]) + p["conv2_bias"])
    b, h, w, c = x.shape
    x = x[:, :h // 2 * 2, :w // 2 * 2].reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))
    x = relu(x.reshape(b, -1) @ p["dense1"]["kernel"] + p["dense1"]["bias"])
    return x @ p["dense2"]["kernel"] + p["dense2"]["bias"]


def np_pool_3x3_2_same(x):
    """TensorFlow's max_pool(ksize 3, strides 2, 'SAME'): the window of output i starts at
    2 i - pad_before, pad_before = floor(total / 2), padding never wins."""
    b, h, w, c = x.shape
    oh, ow = -(-h // 2), -(-w // 2)
    th, tw = max((oh - 1) * 2 + 3 - h, 0), max((ow - 1) * 2 + 3 - w, 0)
    out = np.empty((b, oh, ow, c))
    for i in range(oh):
        for j in range(ow):
            r0, c0 = 2 * i - th // 2, 2 * j - tw // 2
            win = x[:, max(r0, 0):r0 + 3, max(c0, 0):c0 + 3]
            out[:, i, j] = win.max(axis=(1, 2))
    return out


def np_lrn(x, radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75):
    c = x.shape[-1]
    s = np.stack([np.sum(x[..., max(0, k - radius):k + radius + 1] ** 2, axis=-1)
                  for k in range(c)], axis=-1)
    return x / (bias + alpha * s) ** beta


def np_fedavg_cnn(p, x):
    x = relu(np_conv(x, p["conv1_kernel"], pad=(2, 2)) + p["conv1_bias"])
    x = np_lrn(np_pool_3x3_2_same(x))
    x = relu(np_conv(x, p["conv2_kernel"], pad=(2, 2)) + p["conv2_bias"])
    x = np_pool_3x3_2_same(np_lrn(x))
    x = relu(x.reshape(x.shape[0], -1) @ p["local3"]["kernel"] + p["local3"]["bias"])
    x = relu(x @ p["local4"]["kernel"] + p["local4"]["bias"])
    return x @ p["logits"]["kernel"] + p["logits"]["bias"]


def np_loss(forward, p, x, y):
    z = forward(p, x)
    z = z - z.max(axis=1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]))


TINY = dict(widths=(4, 8, 8, 6), blocks=(1, 1, 1, 1), groups=2)


def instances():
    """(name, flax module, NumPy forward, input shape) of small instances of the three."""
    return [("resnet", lambda impl: ResNetGN(5, conv_impl=impl, **TINY),
             lambda p, x: np_resnet(p, x, TINY["groups"], TINY["blocks"]), (8, 8, 3)),
            ("pfl_cnn", lambda impl: PflCNN(5, conv_impl=impl), np_pfl_cnn, (9, 8, 3)),
            ("fedavg_cnn", lambda impl: FedAvgCNN(5, conv_impl=impl), np_fedavg_cnn,
             (7, 8, 2))]


def perturbed(params, seed):
    """The initial parameters with every leaf moved off its initial constant (GN's 1 and 0,
    zero biases), in float64 for NumPy."""
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    out = [np.asarray(l, np.float64) + 0.3 * rng.normal(size=l.shape) for l in leaves]
    return jax.tree.unflatten(tree, out)


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("impl", ["im2col_wgrad", "xla"])
def test_forward_equals_numpy(which, impl):
    name, make, forward, shape = instances()[which]
    module = make(impl)
    x = np.random.default_rng(3).normal(size=(2,) + shape)
    zeros = np.zeros((1,) + shape, np.float32)
    p64 = perturbed(jax.jit(module.init)(jax.random.key(1), zeros)["params"], 4)
    p32 = jax.tree.map(lambda a: np.asarray(a, np.float32), p64)   # cast on the host
    out = jax.jit(module.apply)({"params": p32}, np.asarray(x, np.float32))
    np.testing.assert_allclose(np.asarray(out), forward(p64, x), rtol=2e-4, atol=2e-4,
                               err_msg=name)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_gradient_equals_numpy_finite_differences(which):
    """For every parameter leaf, <grad, v> of the mean cross-entropy (the fast CPU path's
    custom weight gradient) against the central difference of the NumPy loss along v."""
    name, make, forward, shape = instances()[which]
    module = make("im2col_wgrad")
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2,) + shape)
    y = np.array([1, 3])
    zeros = np.zeros((1,) + shape, np.float32)
    p64 = perturbed(jax.jit(module.init)(jax.random.key(2), zeros)["params"], 6)
    p32 = jax.tree.map(lambda a: np.asarray(a, np.float32), p64)   # cast on the host

    def loss(p):
        z = module.apply({"params": p}, jnp.asarray(x, jnp.float32))
        return jnp.mean(jax.nn.logsumexp(z, axis=1) - z[jnp.arange(2), y])

    grads = jax.jit(jax.grad(loss))(p32)
    paths = jax.tree_util.tree_leaves_with_path(p64)
    gleaves = jax.tree.leaves(grads)
    eps = 1e-6
    for (path, leaf), g in zip(paths, gleaves):
        v = rng.normal(size=leaf.shape)

        def moved(step):
            return jax.tree_util.tree_map_with_path(
                lambda q, a: a + step * v if q == path else a, p64)

        fd = (np_loss(forward, moved(eps), x, y) - np_loss(forward, moved(-eps), x, y)) / (2 * eps)
        got = float(np.sum(np.asarray(g, np.float64) * v))
        assert abs(got - fd) <= 1e-3 * max(1.0, abs(fd)), (name, jax.tree_util.keystr(path),
                                                           got, fd)


# ----------------------------------------------------------------------------- in the engine


def tiny_resnet(data, options):
    return Model("tiny_resnet_gn", ResNetGN(data.num_classes, conv_impl=options.conv_impl or
                                            "im2col_wgrad", **TINY),
                 "softmax", data.feature_shape, data.train.x_dtype, data.x_scale,
                 lanes=IMAGE_LANES)


register_model("tiny_resnet_gn", tiny_resnet, replace=True)


def image_config(**kw):
    base = dict(num_rounds=2, clients_per_round=4, batch_size=4, learning_rate=0.05)
    base.update(kw)
    return tiny_config(**base)


@pytest.mark.slow   # compiles six rounds of convolutional networks: CI's second step
@pytest.mark.parametrize("model", ["pfl_cnn", "fedavg_cnn", "tiny_resnet_gn"])
def test_fedavg_equals_deltafl_at_theta_one(model):
    """Unrolled lanes (2 per step on CPU), two seeds, crop_flip on: FedAvg's models are
    Delta-FL's at theta = 1 bit for bit."""
    data = image_data()
    avg = build_experiment(image_config(algorithm="fedavg", thetas=(), seeds=(1, 2),
                                        model=model, augment="crop_flip"), data)
    dfl = build_experiment(image_config(algorithm="deltafl", thetas=(1.0,), seeds=(1, 2),
                                        model=model, augment="crop_flip"), data)
    sa, ha = run_rounds_history(avg, 2)
    sd, hd = run_rounds_history(dfl, 2)
    assert avg.placement.lane_mode == "unroll" and avg.placement.lanes == 2
    for a, b in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sd.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.isfinite(np.asarray(ha[-1]["train_real_examples"])))


@pytest.mark.slow   # compiles two rounds of a convolutional network: CI's second step
@pytest.mark.parametrize("algorithm,extra", [("scaffold", {"thetas": (1.0,)}),
                                             ("deltafl", {"thetas": (0.5,)})])
def test_other_algorithms_train_the_cnn(algorithm, extra):
    """SCAFFOLD (a corrected client step and per-client state) and Delta-FL at theta = 0.5
    train pfl_cnn: finite models that moved from w_0."""
    exp = build_experiment(image_config(algorithm=algorithm, model="pfl_cnn", **extra),
                           image_data())
    w0 = jax.tree.leaves(exp.initial_state().params)
    state, _ = run_rounds_history(exp, 2)
    moved = [np.asarray(a) - np.asarray(b) for a, b in zip(jax.tree.leaves(state.params), w0)]
    assert all(np.all(np.isfinite(d)) for d in moved)
    assert max(float(np.abs(d).max()) for d in moved) > 0


# ----------------------------------------------------------------------------- crop_flip


def np_crop_flip(x, dy, dx, flip, pad=4):
    h, w = x.shape[1:3]
    xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad)) + ((0, 0),) * (x.ndim - 3))
    out = np.stack([xp[i, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(len(x))])
    return np.where(np.asarray(flip).reshape((-1,) + (1,) * (x.ndim - 1)), out[:, :, ::-1], out)


@pytest.mark.parametrize("shape", [(6, 5, 3), (7, 7)])
def test_crop_flip_is_the_padded_crop_and_mirror_of_its_draws(shape):
    x = np.random.default_rng(0).integers(1, 256, size=(64,) + shape, dtype=np.uint8)
    key = jax.random.key(7)
    draws, got = jax.jit(lambda x, key: (crop_flip_draws(key, 64), crop_flip(x, key)))(x, key)
    dy, dx, flip = (np.asarray(a) for a in draws)
    got = np.asarray(got)
    np.testing.assert_array_equal(got, np_crop_flip(x, dy, dx, flip))
    assert got.dtype == np.uint8
    # the draws cover the 9 x 9 offsets and both flips; some pixels come from the zero border
    assert set(dy) | set(dx) <= set(range(9)) and len(set(dy)) > 4 and 0 < flip.sum() < 64
    assert (got == 0).any()


def test_one_round_with_crop_flip_equals_numpy():
    """FedAvg, softmax regression, one local step on a whole client: each sampled client k's
    batch (its examples in the plan's order) is cropped and flipped with the draws of
    fold_in(fold_in(fold_in(seed key, round), k), step 0), then one SGD step, then the
    average; against NumPy."""
    data = image_data(shape=(5, 5, 3), classes=4, num_clients=6, per_client=6)
    cfg = tiny_config(algorithm="fedavg", thetas=(), seeds=(3,), model="linear",
                      augment="crop_flip", clients_per_round=3, batch_size=6, num_rounds=1,
                      learning_rate=0.5)
    exp = build_experiment(cfg, data)
    state, _ = run_rounds_history(exp, 1)
    root = exp.keys()[0]
    W, b = np.zeros((75, 4)), np.zeros(4)
    dW, db = np.zeros_like(W), np.zeros_like(b)
    chosen = sample_clients(3, 0, 6, 3)
    draws = jax.jit(lambda k: crop_flip_draws(   # one program, not one per operation
        jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(root, 0), k), 0), 6))
    for k in chosen:
        xk, yk = data.train.client(int(k))
        order = client_permutations(3, 0, int(k), 6, 1)
        dy, dx, flip = (np.asarray(a) for a in draws(int(k)))
        xa = np_crop_flip(xk[order], dy, dx, flip).reshape(6, -1)
        xa = (xa.astype(np.float32) * np.float32(1 / 255)).astype(np.float64)
        Wk, bk = local_sgd(W, b, xa, yk[order], np.arange(6), 0.5, 0.0, 6, epochs=1)
        dW, db = dW + (Wk - W) / 3, db + (bk - b) / 3
    p = jax.device_get(state.params)["Dense_0"]
    np.testing.assert_allclose(p["kernel"][0], W + dW, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p["bias"][0], b + db, rtol=1e-5, atol=1e-6)


def test_augment_none_is_the_default_and_names_its_choices():
    cfg = ExperimentConfig(DataConfig("synthetic"), output_dir=None, save_models=False)
    assert cfg.augment == "none"
    with pytest.raises(Exception, match="--augment must be one of none, crop_flip"):
        ExperimentConfig(DataConfig("synthetic"), output_dir=None, save_models=False,
                         augment="mixup")


def write_npz(path, shape=(8, 8, 3), classes=4):
    tr = image_split(8, 12, shape, classes, 0)
    te = image_split(3, 12, shape, classes, 1)
    np.savez(path, train_x=tr.x, train_y=tr.y, train_client=np.repeat(np.arange(8), 12),
             test_x=te.x, test_y=te.y, test_client=np.repeat(np.arange(3), 12),
             x_scale=np.float32(1 / 255))


def cli(out, *flags, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "experiments.run", *flags,
                           f"--output_dir={out}"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_crop_flip_on_features_that_are_not_images_exits_2(tmp_path):
    out = tmp_path / "run"
    proc = cli(out, f"--flagfile={os.path.join(REPO, 'tests', 'tiny.flags')}",
               "--augment=crop_flip", "--num_rounds=1")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--augment=crop_flip needs image inputs" in lines[0], lines
    assert not out.exists()


IMAGE_FLAGS = ["--dataset=npz", "--model=pfl_cnn", "--augment=crop_flip", "--thetas=1.0,0.5",
               "--seeds=1", "--clients_per_round=4", "--batch_size=4", "--learning_rate=0.05",
               "--eval_every=2", "--tensorboard=no"]


@pytest.mark.slow   # subprocess runs: CI's second step
def test_crop_flip_on_one_and_two_devices_agree(tmp_path):
    npz = tmp_path / "img.npz"
    write_npz(npz)
    runs = {}
    for d in (1, 2):
        out = tmp_path / f"d{d}"
        proc = cli(out, *IMAGE_FLAGS, f"--data_path={npz}", "--num_rounds=4", f"--devices={d}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[d] = np.load(out / "rounds.npz"), np.load(out / "clients.npz")
    for k in runs[1][1].files:
        a, b = runs[1][1][k], runs[2][1][k]
        if a.dtype.kind == "f":
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=k)
        else:
            np.testing.assert_array_equal(b, a, err_msg=k)


@pytest.mark.slow   # subprocess runs: CI's second step
def test_crop_flip_run_killed_and_resumed_is_bit_identical(tmp_path):
    from test_resume import assert_same_outputs, saved_rounds
    npz = tmp_path / "img.npz"
    write_npz(npz)
    flags = [*IMAGE_FLAGS, f"--data_path={npz}", "--num_rounds=10", "--checkpoint_every=2",
             "--checkpoint_every_s=0"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert cli(whole, *flags).returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, "-m", "experiments.run", *flags,
                             f"--output_dir={cut}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import time
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if saved_rounds(str(cut)) and max(saved_rounds(str(cut))) >= 4:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not (cut / "summary.json").exists()
    resumed = cli(cut, *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("resuming") == 1, resumed.stdout
    assert_same_outputs(str(cut), str(whole))


def test_the_guides_cnn_block_is_pfl_researchs_cnn_on_unrolled_lanes():
    """docs/guides/own-model.md's `# my_cifar_cnn.py` block, as written: it registers
    cifar_cnn, whose forward is NumPy's VALID convolutions, 2x2 max-pool and dense layers, with
    pfl-research's 1,626,442 parameters on 32x32x3 images, and which gets unrolled lanes and
    the convolutional evaluation chunk on CPU without asking for them."""
    from deltafl_jax.models import MODELS
    text = open(os.path.join(REPO, "docs", "guides", "own-model.md")).read()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (block,) = [b for b in blocks if b.startswith("# my_cifar_cnn.py")]
    MODELS.pop("cifar_cnn", None)
    exec(compile(block, "my_cifar_cnn.py", "exec"), {})
    try:
        assert count(build_model("cifar_cnn", image_data(shape=(32, 32, 3)))) == 1_626_442
        data = image_data()
        model = build_model("cifar_cnn", data)
        assert (model.lanes.lane_mode("cpu"), model.lanes.eval_chunk("cpu")) == ("unroll", 128)
        params = jax.jit(model.init)(jax.random.key(0))
        x = data.train.x[:3]
        p = jax.tree.map(lambda a: np.asarray(a, np.float64), jax.device_get(params))
        h = np.asarray(x, np.float32) * np.float32(1 / 255)
        for name in ("Conv_0", "Conv_1"):
            h = relu(np_conv(h.astype(np.float64), p[name]["kernel"]) + p[name]["bias"])
        h = h.reshape(3, 2, 2, 2, 2, 64).max(axis=(2, 4)).reshape(3, -1)
        h = relu(h @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
        ref = h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]
        np.testing.assert_allclose(np.asarray(jax.jit(model.apply)(params, x)), ref, rtol=1e-4,
                                   atol=1e-4)
    finally:
        MODELS.pop("cifar_cnn", None)


def test_a_checkpoint_saved_before_augment_existed_resumes_without_it():
    """A fingerprint saved before --augment existed lacks it: it matches --augment=none (the
    training it recorded), not crop_flip."""
    from deltafl_jax.run import resume
    base = dict(output_dir="x", num_rounds=3)
    saved = resume.settings(ExperimentConfig(DataConfig("synthetic"), **base))
    del saved["augment"]
    plain = resume.settings(ExperimentConfig(DataConfig("synthetic"), **base))
    cropped = resume.settings(ExperimentConfig(DataConfig("synthetic"), augment="crop_flip",
                                               **base))
    assert resume.fingerprint_diff(saved, plain) == []
    assert resume.fingerprint_diff(saved, cropped) == ["augment"]


@pytest.mark.slow   # compiles four rounds of convolutional networks: CI's second step
@pytest.mark.parametrize("model", ["pfl_cnn", "tiny_resnet_gn"])
def test_vmapped_lanes_equal_unrolled_lanes(model):
    """The accelerator's program (--placement_backend=gpu on this CPU: every sampled client a
    vmapped lane, XLA's own convolutions) trains the same models as the CPU's unrolled lanes
    on the fast path, to float rounding; crop_flip on."""
    data = image_data()
    runs = {}
    # 4 vmapped lanes, one replica's sampled clients, as the accelerator's default was before
    # it became every job of the round (2 x 4 here): 8 lanes batch the convolutions otherwise,
    # and Delta-FL's filter may then order near-tied losses otherwise (measured: 4.3e-5 here).
    lanes = {"cpu": None, "gpu": 4}
    for backend in ("cpu", "gpu"):
        exp = build_experiment(image_config(algorithm="deltafl", thetas=(1.0, 0.5), model=model,
                                            augment="crop_flip", placement_backend=backend,
                                            clients_per_step=lanes[backend]), data)
        runs[backend] = exp, run_rounds_history(exp, 2)[0]
    assert runs["gpu"][0].placement.lane_mode == "vmap"
    assert runs["gpu"][0].placement.lanes == 4
    for a, b in zip(jax.tree.leaves(runs["cpu"][1].params), jax.tree.leaves(runs["gpu"][1].params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


def test_gpu_xla_flags_hand_cases():
    """A built-in model's GPU flags are added once, after the user's; a flag the user set
    keeps the user's value; other models get none."""
    from deltafl_jax.models.registry import gpu_xla_flags
    off = "--xla_gpu_enable_triton_gemm=false"
    assert gpu_xla_flags("", "resnet18_gn") == off
    assert gpu_xla_flags("--xla_cpu_foo=1", "resnet18_gn") == "--xla_cpu_foo=1 " + off
    assert gpu_xla_flags(gpu_xla_flags("", "resnet18_gn"), "resnet18_gn") == off
    assert gpu_xla_flags("--xla_gpu_enable_triton_gemm=true", "resnet18_gn") == \
        "--xla_gpu_enable_triton_gemm=true"
    assert gpu_xla_flags("--xla_cpu_foo=1", "pfl_cnn") == "--xla_cpu_foo=1"


def test_the_convolutions_left_unset_are_the_models_and_the_backends():
    """--conv_impl unset: on CPU pfl-research's CNN and ResNet-18-GN run Winograd's
    convolutions (their measured choice, LanePreferences.cpu_conv_impl), the other networks the
    im2col weight gradient; the flag, or another backend's program (--placement_backend),
    decides over the model."""
    cifar = image_data((32, 32, 3))
    impl = lambda name, opts=ModelOptions(): build_model(name, cifar, opts).module.conv_impl  # noqa: E731
    assert jax.default_backend() == "cpu"
    assert impl("pfl_cnn") == "winograd"
    assert impl("resnet18_gn") == "winograd"
    assert impl("fedavg_cnn") == "im2col_wgrad"
    assert impl("resnet18_gn", ModelOptions(conv_backend="gpu")) == "im2col_wgrad"
    assert impl("pfl_cnn", ModelOptions(conv_impl="im2col_wgrad")) == "im2col_wgrad"
    assert impl("pfl_cnn", ModelOptions(conv_backend="gpu")) == "im2col_wgrad"
    assert impl("pfl_cnn", ModelOptions(conv_backend="tpu")) == "xla"
    assert impl("pfl_cnn", ModelOptions(conv_backend="cpu")) == "winograd"
