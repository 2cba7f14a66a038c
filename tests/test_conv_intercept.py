"""A model's own ``nn.Conv`` and ``nn.max_pool`` layers on the fast path
(deltafl_jax.models.conv_intercept): the values and gradients of Flax's layers under plain
autodiff (the reference: XLA's convolution, reduce_window and their autodiff) in vmapped
lanes, and a model registered from a file, as ``--model_module`` imports it, trained by the
engine without XLA's weight-gradient convolutions unless ``--conv_impl=xla``."""

import importlib.util
import os
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltafl_jax import ClientData, DataConfig, ExperimentConfig, FederatedDataset
from deltafl_jax.models import MODELS, LanePreferences, Model, build_model, register_model
from deltafl_jax.models.conv_intercept import max_pool_disjoint, rewritten
from deltafl_jax.run.experiment import build_experiment

LANES = 2

# nn.Conv settings: padding, strides, kernel dilation, feature groups, bias; 1-D and 2-D.
CASES = {
    "same": dict(padding="SAME"),
    "valid": dict(padding="VALID"),
    "explicit": dict(padding=((2, 1), (0, 3))),
    "crop": dict(padding=((-1, 2), (1, -1))),
    "stride2_pad1": dict(padding=1, strides=2),
    "valid_stride_2x3": dict(padding="VALID", strides=(2, 3)),
    "same_stride2_even_kernel": dict(padding="SAME", strides=2, kernel_size=(4, 4)),
    "dilation2": dict(padding="SAME", kernel_dilation=2),
    "dilation_stride": dict(padding="VALID", kernel_dilation=(2, 1), strides=2),
    "groups2": dict(padding="SAME", feature_group_count=2),
    "groups4_stride2": dict(padding="VALID", feature_group_count=4, strides=2),
    "no_bias": dict(padding="SAME", use_bias=False),
    "circular": dict(padding="CIRCULAR"),
    "1d_same_stride2": dict(padding="SAME", strides=2, kernel_size=(3,)),
    "1d_valid_dilation": dict(padding="VALID", kernel_dilation=2, kernel_size=(5,)),
}


class ConvPool(nn.Module):
    """nn.Conv (one case), ReLU, 2x2 max-pool on 2-D inputs."""

    settings: dict

    @nn.compact
    def __call__(self, x):
        s = dict(self.settings)
        kernel = s.pop("kernel_size", (3, 3))
        y = nn.relu(nn.Conv(8, kernel, **s)(x))
        return nn.max_pool(y, (2, 2), strides=(2, 2)) if len(kernel) == 2 else y


def lane_grads(module, params, x, impl):
    """Per lane: the value and the gradients (params, inputs) of sum(sin(module(x)))."""
    def loss(p, xb):
        return jnp.sum(jnp.sin(rewritten(module.apply, impl)(p, xb)))

    return jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


# A few cases in the fast suite, the rest with CI's slow step (a compile each).
FAST = {"valid", "crop", "stride2_pad1", "dilation_stride", "groups4_stride2", "no_bias",
        "1d_same_stride2"}


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(CASES)])
def test_values_and_gradients_equal_flax_under_vmapped_lanes(case):
    settings = CASES[case]
    one_d = len(settings.get("kernel_size", (3, 3))) == 1
    rng = np.random.default_rng(len(case))
    shape = (LANES, 3, 11, 4) if one_d else (LANES, 3, 9, 11, 4)
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    module = ConvPool(settings)

    @jax.jit   # the initialisation and both lanes' gradients in one program
    def both(x):
        p = module.init(jax.random.key(0), x[0])
        lanes = jax.tree.map(lambda a: jnp.stack([a, -0.7 * a]), p)   # each lane its own model
        return lane_grads(module, lanes, x, "xla"), lane_grads(module, lanes, x, "im2col_wgrad")

    ref, got = (jax.tree.leaves(t) for t in both(x))
    for r, g in zip(ref, got):
        scale = float(np.max(np.abs(r)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6 * scale)


def test_pooling_gradient_goes_to_the_first_maximum_of_each_window():
    """Ties and a cropped border: the same values and gradients as nn.max_pool under
    autodiff (XLA's select-and-scatter), and the hand-computed gradient."""
    x = jnp.asarray([[1., 3., 3., 0., 5.],
                     [2., 3., 1., 1., 5.],
                     [0., 0., 4., 4., 5.],
                     [0., 0., 4., 4., 5.],
                     [9., 9., 9., 9., 9.]])[None, :, :, None]
    ref_pool = lambda v: nn.max_pool(v, (2, 2), strides=(2, 2))

    @jax.jit   # one program, not one compile per operation run eagerly
    def pools_and_gradients(x):
        ours = jax.grad(lambda v: jnp.sum(max_pool_disjoint(v, (1, 2, 2, 1))
                                          * jnp.arange(1., 5.).reshape(1, 2, 2, 1)))(x)
        ref = jax.grad(lambda v: jnp.sum(ref_pool(v)
                                         * jnp.arange(1., 5.).reshape(1, 2, 2, 1)))(x)
        return max_pool_disjoint(x, (1, 2, 2, 1)), ref_pool(x), ours, ref

    pooled, ref_pooled, ours, ref = pools_and_gradients(x)
    np.testing.assert_array_equal(pooled, ref_pooled)
    np.testing.assert_array_equal(ours, ref)
    expected = np.zeros((5, 5))
    expected[0, 1], expected[0, 2], expected[2, 0], expected[2, 2] = 1., 2., 3., 4.
    np.testing.assert_array_equal(np.asarray(ours)[0, :, :, 0], expected)


# ------------------------------------------------------------------- a registered user model

USER_MODULE = '''
import flax.linen as nn
import deltafl_jax


class UserCNN(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), padding="VALID")(x))
        x = nn.relu(nn.Conv(6, (3, 3), strides=2, padding=1)(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(self.classes)(x.reshape(x.shape[0], -1))


def user_cnn(data, options):
    return deltafl_jax.Model(name="user_cnn", module=UserCNN(data.num_classes),
                             loss_kind="softmax", example_shape=data.feature_shape,
                             input_dtype=data.train.x_dtype, input_scale=data.x_scale)


deltafl_jax.register_model("user_cnn", user_cnn, replace=True)
'''


def image_data(num_clients=4, per_client=6, classes=5):
    rng = np.random.default_rng(0)

    def split(n, seed):
        r = np.random.default_rng(seed)
        return ClientData(x=r.integers(0, 256, (n * per_client, 12, 12, 3), dtype=np.uint8),
                          y=r.integers(0, classes, n * per_client).astype(np.int32),
                          offsets=np.arange(n + 1) * per_client, client_ids=np.arange(n))

    del rng
    return FederatedDataset("img", split(num_clients, 0), split(2, 1), num_classes=classes,
                            x_scale=1 / 255)


@pytest.fixture
def user_model(tmp_path):
    """The module above written to a file and imported as --model_module imports one."""
    path = tmp_path / "user_cnn.py"
    path.write_text(USER_MODULE)
    spec = importlib.util.spec_from_file_location("test_user_cnn_module", str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield "user_cnn"
    MODELS.pop("user_cnn", None)
    sys.modules.pop(spec.name, None)


def conv_kernel_sizes(jaxpr):
    """The spatial sizes of the right-hand operand of every convolution in `jaxpr` (nested
    jaxprs included): a kernel's for a forward or input-gradient convolution, an activation's
    for autodiff's weight-gradient convolution."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
            spec = eqn.params["dimension_numbers"].rhs_spec
            shape = eqn.invars[1].aval.shape
            out.append(tuple(shape[d] for d in spec[2:]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out.extend(conv_kernel_sizes(inner))
    return out


def round_conv_kernel_sizes(model, **overrides):
    cfg = ExperimentConfig(data=DataConfig("img"), model=model, thetas=(1.0, 0.5), seeds=(1,),
                           num_rounds=1, clients_per_round=3, batch_size=4, learning_rate=0.05,
                           output_dir=None, save_models=False, verbose=False, **overrides)
    exp = build_experiment(cfg, image_data())
    jaxpr = jax.make_jaxpr(exp.round_fn)(exp.initial_state(), exp.round_data(0), exp.keys())
    return exp, set(conv_kernel_sizes(jaxpr.jaxpr))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.slow)])
def test_a_registered_model_trains_without_xlas_weight_gradient_convolution(user_model, backend):
    """The engine's round (unrolled lanes on CPU; the accelerator's vmapped lanes with
    --placement_backend=gpu) runs only convolutions with a 3x3 kernel operand: every weight
    gradient is a matrix product. --conv_impl=xla runs Flax's own: activation-sized ones."""
    exp, fast = round_conv_kernel_sizes(user_model, placement_backend=backend)
    assert exp.placement.lane_mode == ("unroll" if backend == "cpu" else "vmap")
    assert fast == {(3, 3)}
    exp, plain = round_conv_kernel_sizes(user_model, placement_backend=backend, conv_impl="xla")
    assert exp.model.conv_impl == "xla"
    assert plain - {(3, 3)}, plain


@pytest.mark.slow   # traces a round: CI's second step
def test_tpu_placement_keeps_xlas_convolutions(user_model):
    """--placement_backend=tpu defaults to --conv_impl=xla: the module as it is."""
    _, plain = round_conv_kernel_sizes(user_model, placement_backend="tpu")
    assert plain - {(3, 3)}, plain


def test_convolutional_lanes_fill_only_what_the_model_leaves_unset():
    """A registered model with a convolution gets unrolled lanes and chunks of 128 on CPU
    unless it chose; one without keeps vmapped lanes and chunks of 2048; a built-in keeps
    its own."""
    data = image_data()

    class Conv(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(5)(nn.Conv(2, (3, 3))(x).reshape(x.shape[0], -1))

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(5)(x.reshape(x.shape[0], -1))

    def factory(module, lanes):
        return lambda d, o: Model("m", module, "softmax", d.feature_shape, d.train.x_dtype,
                                  d.x_scale, lanes=lanes)

    chosen = LanePreferences(cpu_lane_mode="vmap")
    names = ("t_conv", "t_conv_vmap", "t_conv_im2col", "t_dense")
    try:
        for name, module, lanes, want in (
                ("t_conv", Conv(), LanePreferences(), ("unroll", 128, "winograd")),
                ("t_conv_vmap", Conv(), chosen, ("vmap", 128, "winograd")),
                ("t_conv_im2col", Conv(), LanePreferences(cpu_conv_impl="im2col_wgrad"),
                 ("unroll", 128, "im2col_wgrad")),
                ("t_dense", Dense(), LanePreferences(), ("vmap", 2048, None))):
            register_model(name, factory(module, lanes), replace=True)
            got = build_model(name, data).lanes
            assert (got.lane_mode("cpu"), got.eval_chunk("cpu"), got.cpu_conv_impl) == want, name
    finally:
        for name in names:
            MODELS.pop(name, None)
    assert build_model("mlp", data).lanes.lane_mode("cpu") == "vmap"


class GuideCNN(nn.Module):
    """docs/guides/own-model.md's CIFAR CNN (pfl-research's), small: two 3x3 VALID nn.Conv,
    a 2x2 nn.max_pool, two nn.Dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), padding="VALID")(x))
        x = nn.relu(nn.Conv(6, (3, 3), padding="VALID")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(7)(x.reshape(x.shape[0], -1)))
        return nn.Dense(5)(x)


@pytest.mark.slow   # four compiled programs: CI's second step
def test_a_models_own_cnn_under_winograd_takes_the_built_in_networks_cpu_paths():
    """Under --conv_impl=winograd (a registered convolutional model's CPU default) the
    guide's CNN written with Flax's layers gets pfl_cnn's CPU paths: the first layer, on the
    data, one im2col product whose patches its weight gradient keeps; the second by Winograd;
    each dense kernel's weight gradient a sum of outer products fused into the SGD update. So
    an SGD step's program has no convolution and no [N, M] product for a dense kernel; on
    im2col_wgrad both are there (the checks can fail). The loss and every gradient equal
    Flax's layers under plain autodiff."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(3, 10, 10, 3)), jnp.float32)
    y = jnp.asarray([1, 4, 0])
    module = GuideCNN()
    params = module.init(jax.random.key(2), x)

    def loss_of(impl):
        def loss(p):
            z = rewritten(module.apply, impl)(p, x)
            return jnp.mean(jax.nn.logsumexp(z, axis=1) - z[jnp.arange(3), y])
        return loss

    def step_hlo(impl):
        step = lambda p: jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss_of(impl))(p))
        return jax.jit(step).lower(params).compile().as_text()

    def dense_weight_products(hlo):
        return re.findall(r"= f32\[(?:54,7|7,5)\]\{[\d,]*\} dot\(", hlo)

    fast, plain = step_hlo("winograd"), step_hlo("im2col_wgrad")
    assert " convolution(" not in fast and " convolution(" in plain
    assert dense_weight_products(fast) == [] and dense_weight_products(plain)
    # Winograd runs the second layer only: its 36 tile products, none of the first's [36, 3, 4]
    assert re.search(r"= f32\[36,4,6\]", fast) and not re.search(r"= f32\[36,3,4\]", fast)
    ref, got = jax.jit(lambda p: (jax.value_and_grad(loss_of("xla"))(p),     # one program
                                  jax.value_and_grad(loss_of("winograd"))(p)))(params)
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5,
                                   atol=1e-5 * float(np.max(np.abs(np.asarray(r)))))
