"""Mixed precision (``--compute_dtype``, :mod:`deltafl_jax.models.precision`).

bfloat16: every matrix product and convolution of the forward and backward passes of each
built-in model kind (linear, mlp, cnn, gru, lstm; read from the jaxpr of the per-example
loss's gradient) has bfloat16 operands, the gradients reach the float32 parameters as
float32, and the outputs stay within bfloat16's rounding of the float32 forward pass (the
reference). float32 (the default): nothing is cast, Model.apply's program is the module's own.
End to end: bf16 runs of a built-in model and of a registered model of one's own train, with
float32 parameters in the saved models and the checkpoints (read from the files); a bf16 run
resumes after SIGKILL bit for bit and agrees across 1 and 2 devices (slow)."""

import dataclasses
import json
import os
import subprocess
import sys

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltafl_jax
from conftest import run_runner
from deltafl_jax import ClientData, FederatedDataset, load_model
from deltafl_jax.models import MODELS, Model, ModelOptions, build_model
from deltafl_jax.models.conv_intercept import equations
from test_text_models import sent140_like, shakespeare_like

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCTS = ("dot_general", "conv_general_dilated")
# bfloat16 keeps 8 significant bits: one rounding is within 2^-8 relative; a product of K
# rounded terms (float32 accumulation) within about 2^-8 of the sum of |terms|.
BF16_EPS = 2.0 ** -8


def features(n=8, d=10, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int32)
    split = ClientData(x=x, y=y, offsets=np.array([0, n]), client_ids=np.array([0]))
    return FederatedDataset("t", split, split, num_classes=classes)


def images(n=4, side=12, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, side, side)).astype(np.uint8)
    y = rng.integers(0, classes, n).astype(np.int32)
    split = ClientData(x=x, y=y, offsets=np.array([0, n]), client_ids=np.array([0]))
    return FederatedDataset("img", split, split, num_classes=classes, x_scale=1 / 255)


DATA = {"linear": features, "mlp": features, "cnn": images, "gru": shakespeare_like,
        "lstm": sent140_like}


def gradient_program(model, data):
    """The jaxpr of the gradient of the mean per-example loss on 4 examples (traced only)."""
    params = jax.eval_shape(model.init, jax.random.key(0))
    x, y = data.train.x[:4], data.train.y[:4]
    return jax.make_jaxpr(jax.grad(lambda p: jnp.mean(model.losses(p, x, y))))(params)


def product_operand_dtypes(jaxpr):
    return {str(v.aval.dtype) for e in equations(jaxpr.jaxpr) if e.primitive.name in PRODUCTS
            for v in e.invars}


@pytest.mark.parametrize("name", sorted(DATA))
def test_every_product_in_bf16_and_the_gradients_float32(name):
    data = DATA[name]()
    bf16 = build_model(name, data, ModelOptions(compute_dtype="bfloat16"))
    f32 = build_model(name, data, ModelOptions())
    assert (bf16.compute_dtype, f32.compute_dtype) == ("bfloat16", None)
    program = gradient_program(bf16, data)
    assert product_operand_dtypes(program) == {"bfloat16"}
    assert {str(a.dtype) for a in jax.tree.leaves(program.out_avals)} == {"float32"}
    plain = gradient_program(f32, data)
    assert product_operand_dtypes(plain) == {"float32"}
    assert "bf16" not in str(plain)


@pytest.mark.parametrize("impl", ["winograd", "im2col_wgrad", "im2col"])
def test_fast_convolution_paths_keep_bf16(impl):
    """The CNN's convolutions on each CPU path (their custom gradients, Winograd's transforms,
    the im2col products) and a model of one's own (nn.Conv, rewritten) stay in bfloat16."""
    data = images()
    model = build_model("cnn", data, ModelOptions(compute_dtype="bfloat16", conv_impl=impl))
    assert product_operand_dtypes(gradient_program(model, data)) == {"bfloat16"}
    own = Model("own_conv", OwnConv(), "softmax", data.feature_shape, np.uint8, 1 / 255,
                conv_impl=impl, compute_dtype="bfloat16")
    assert product_operand_dtypes(gradient_program(own, data)) == {"bfloat16"}


class OwnConv(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3))(x[..., None]))
        x = nn.GroupNorm(2)(nn.max_pool(x, (2, 2), (2, 2)))
        return nn.Dense(5)(nn.relu(nn.Dense(8)(x.reshape(x.shape[0], -1))))


def test_bf16_outputs_and_gradients_within_bf16_rounding_of_float32():
    """The same float32 parameters: the bf16 forward pass and gradient against the float32
    ones (the reference), within a few bfloat16 roundings of the sums of |terms|; and not
    equal to them (the products did run in bf16)."""
    data = features(n=16, d=40, classes=5)
    options = dict(mlp_hidden=(32,))
    bf16 = build_model("mlp", data, ModelOptions(compute_dtype="bfloat16", **options))
    f32 = build_model("mlp", data, ModelOptions(**options))
    x, y = data.train.x, data.train.y

    @jax.jit
    def both(params):
        grads = [jax.grad(lambda p, m=m: jnp.mean(m.losses(p, x, y)))(params) for m in (bf16, f32)]
        return bf16.apply(params, x), f32.apply(params, x), grads

    params = jax.jit(f32.init)(jax.random.key(3))
    out, ref, (g, gref) = both(params)
    assert out.dtype == jnp.float32 and jax.tree.leaves(g)[0].dtype == jnp.float32
    w1, w2 = params["Dense_0"]["kernel"], params["Dense_1"]["kernel"]
    scale = np.abs(np.maximum(np.abs(x) @ np.abs(w1), 0)) @ np.abs(w2)   # sum of |terms|
    assert np.all(np.abs(np.asarray(out) - np.asarray(ref)) <= 6 * BF16_EPS * scale + 1e-6)
    assert not np.array_equal(out, ref)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=8 * BF16_EPS * float(np.abs(b).max()))


def test_float32_runs_the_module_as_it_is():
    """float32 and None: Model.apply's program is the module's own apply on the preprocessed
    inputs (no cast added), so every float32 result is what it was."""
    for dtype in (None, "float32"):
        for name, impl in (("mlp", None), ("cnn", "xla")):
            data = features() if name == "mlp" else images()
            model = dataclasses.replace(build_model(name, data, ModelOptions(conv_impl=impl)),
                                      compute_dtype=dtype)
            params = jax.eval_shape(model.init, jax.random.key(0))
            x = data.train.x[:2]
            got = jax.make_jaxpr(model.apply)(params, x)
            own = jax.make_jaxpr(lambda p, x, m=model: m.module.apply(
                {"params": p}, m.preprocess(x)))(params, x)
            assert str(got) == str(own)
            assert not any(e.primitive.name == "convert_element_type" and
                           e.params["new_dtype"] == jnp.bfloat16 for e in equations(got.jaxpr))


def test_registered_model_gets_the_flag_unless_its_factory_chose():
    data = features()
    deltafl_jax.register_model("prec_own", lambda d, o: Model(
        "prec_own", OwnDense(), "softmax", d.feature_shape), replace=True)
    deltafl_jax.register_model("prec_fixed", lambda d, o: Model(
        "prec_fixed", OwnDense(), "softmax", d.feature_shape, compute_dtype="float32"),
        replace=True)
    try:
        bf16 = ModelOptions(compute_dtype="bfloat16")
        assert build_model("prec_own", data, bf16).compute_dtype == "bfloat16"
        assert build_model("prec_own", data, ModelOptions()).compute_dtype is None
        assert build_model("prec_fixed", data, bf16).compute_dtype == "float32"
    finally:
        MODELS.pop("prec_own", None)
        MODELS.pop("prec_fixed", None)
    with pytest.raises(ValueError, match="compute_dtype must be one of float32, bfloat16"):
        Model("m", OwnDense(), "softmax", (3,), compute_dtype="float16")


class OwnDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.tanh(nn.Dense(8)(x.reshape(x.shape[0], -1))))


@pytest.mark.parametrize("rnn_impl", ["scan", "pallas_interpret"])
def test_frozen_float32_table_enters_the_lstm_in_bf16(rnn_impl):
    """GloveLSTM looks its inputs up in a float32 constant (the GloVe table): the interceptor
    casts them as they enter nn.RNN (the kernels' layer: as they meet the bf16 weights), so the
    LSTM's input products are bf16 too; the scan's carry keeps one dtype across steps."""
    data = sent140_like()
    model = build_model("lstm", data, ModelOptions(compute_dtype="bfloat16", rnn_impl=rnn_impl))
    params = jax.eval_shape(model.init, jax.random.key(0))
    program = jax.make_jaxpr(model.apply)(params, data.train.x[:2])
    dots = [e for e in equations(program.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    assert program.out_avals[0].dtype == jnp.float32


# ------------------------------------------------------------------------------ end to end

TINY = ["--dataset=synthetic", "--synthetic_num_clients=16", "--synthetic_max_examples=60",
        "--synthetic_shared=0.8", "--thetas=1.0", "--seeds=1", "--num_rounds=6",
        "--clients_per_round=4", "--batch_size=16", "--learning_rate=0.1", "--eval_every=3",
        "--checkpoint_every=3", "--checkpoint_every_s=0", "--tensorboard=no",
        "--compute_dtype=bfloat16"]


def saved_leaves_dtypes(out):
    """{dtype} of every floating leaf of the saved models and of the checkpoints' states
    (the files read back by flax's msgpack and by orbax itself); asserts that every
    checkpoint holds parameters."""
    dtypes = set()
    models = os.path.join(out, "models")
    for f in os.listdir(models):
        if f.endswith(".msgpack"):
            tree = flax.serialization.msgpack_restore(open(os.path.join(models, f), "rb").read())
            dtypes |= {str(np.asarray(a).dtype) for a in jax.tree.leaves(tree)}
    import orbax.checkpoint as ocp
    ckpt = os.path.join(out, "checkpoints")
    steps = [n for n in os.listdir(ckpt) if n.isdigit()]
    assert steps, os.listdir(ckpt)
    for step in steps:
        state = ocp.PyTreeCheckpointer().restore(os.path.join(ckpt, step, "state"))
        assert jax.tree.leaves(state["params"])
        dtypes |= {str(a.dtype) for a in jax.tree.leaves(state)
                   if np.issubdtype(a.dtype, np.floating)}
    return dtypes


def losses_fall(out):
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    evals = [r["train_loss_mean"] for r in recs if "train_loss_mean" in r]
    assert len(evals) >= 2
    return evals[-1] < evals[0]


def test_bf16_run_of_a_built_in_model_trains_and_saves_float32(tmp_path, capsys):
    out = str(tmp_path / "run")
    code, err, _ = run_runner([*TINY, "--model=mlp", f"--output_dir={out}"], capsys)
    assert code == 0, err
    assert losses_fall(out)
    assert saved_leaves_dtypes(out) == {"float32"}
    loaded = load_model(out, theta=1.0, seed=1)
    assert loaded.model.compute_dtype == "bfloat16"
    x = np.random.default_rng(0).normal(size=(4, 60)).astype(np.float32)
    got = np.asarray(loaded.predict(x))
    ref = dataclasses.replace(loaded.model, compute_dtype=None).apply(loaded.params, x)
    assert got.dtype == np.float32 and not np.array_equal(got, ref)
    np.testing.assert_allclose(got, ref, rtol=0, atol=0.05 * float(np.abs(ref).max()))


OWN_MODULE = '''
import flax.linen as nn
import jax
import jax.numpy as jnp
import deltafl_jax


class Hinge(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.classes)(nn.LayerNorm()(h))


def multiclass_hinge(scores, x, y):
    wrong = 1.0 - jax.nn.one_hot(y, scores.shape[-1])
    true = jnp.take_along_axis(scores, y[:, None], axis=-1)[:, 0]
    return (jnp.max(scores + wrong, axis=-1) - true,
            (jnp.argmax(scores, axis=-1) != y).astype(jnp.float32))


deltafl_jax.register_model("prec_hinge", lambda data, options: deltafl_jax.Model(
    name="prec_hinge", module=Hinge(data.num_classes), loss_kind="custom",
    loss_fn=multiclass_hinge, example_shape=data.feature_shape,
    input_dtype=data.train.x_dtype))
'''


@pytest.mark.slow   # a second end-to-end run: CI's second step
def test_bf16_run_of_a_model_of_ones_own_trains_and_saves_float32(tmp_path, capsys):
    path = tmp_path / "prec_models.py"
    path.write_text(OWN_MODULE)
    out = str(tmp_path / "run")
    try:
        code, err, _ = run_runner([*TINY, f"--model_module={path}", "--model=prec_hinge",
                                   f"--output_dir={out}"], capsys)
        assert code == 0, err
        assert losses_fall(out)
        assert saved_leaves_dtypes(out) == {"float32"}
        loaded = load_model(out, theta=1.0, seed=1)
        assert loaded.model.compute_dtype == "bfloat16"
        program = jax.make_jaxpr(loaded.model.apply)(loaded.params, np.zeros((2, 60),
                                                                             np.float32))
        assert {str(v.aval.dtype) for e in equations(program.jaxpr)
                if e.primitive.name == "dot_general" for v in e.invars} == {"bfloat16"}
    finally:
        MODELS.pop("prec_hinge", None)
        sys.modules.pop("prec_models", None)


def test_llama_computes_in_bf16_and_keeps_its_base_and_adapters_float32(tmp_path):
    """--model=llama: --compute_dtype=bfloat16 sets the network's products to bf16 (its own
    ``dtype``); the frozen base stays in --base_dtype (float32 here) and the adapters
    float32."""
    from llm_fixtures import tiny_base
    from test_llm import _data
    from deltafl_jax.models.llm import LLMSettings
    folder = str(tmp_path / "base")
    tiny_base(folder)
    data = _data(folder)
    model = build_model("llama", data, ModelOptions(llm=LLMSettings(lora_rank=2),
                                                    compute_dtype="bfloat16"))
    assert model.module.dtype == jnp.bfloat16
    assert {str(a.dtype) for a in jax.tree.leaves(model.frozen)} == {"float32"}
    params = model.init(jax.random.key(0))
    assert {str(a.dtype) for a in jax.tree.leaves(params)} == {"float32"}
    x = jnp.asarray(data.train.x[:2])
    assert product_operand_dtypes(jax.make_jaxpr(model.apply)(params, x)) == {"bfloat16"}
    # The backward pass: the attention scores are accumulated in float32
    # (preferred_element_type), so their cotangent is float32; every product still has a
    # bf16 operand.
    program = jax.make_jaxpr(jax.grad(lambda p: jnp.mean(model.losses(p, x, None))))(params)
    products = [e for e in equations(program.jaxpr) if e.primitive.name in PRODUCTS]
    assert products and all(any(v.aval.dtype == jnp.bfloat16 for v in e.invars)
                            for e in products)
    assert {str(a.dtype) for a in jax.tree.leaves(program.out_avals)} == {"float32"}
    plain = build_model("llama", data, ModelOptions(llm=LLMSettings(lora_rank=2)))
    assert plain.module.dtype == jnp.float32


@pytest.mark.slow   # three subprocess runs: CI's second step
def test_bf16_resume_after_sigkill_is_bit_identical(tmp_path):
    """A bf16 run (an MLP, Delta-FL) SIGKILLed after its checkpoint of round 10 and run again
    ends with the outputs of the same run never stopped, bit for bit (test_resume's check)."""
    from test_resume import killed_and_rerun
    out = killed_and_rerun(tmp_path, "--compute_dtype=bfloat16", "--model=mlp")
    assert saved_leaves_dtypes(out) == {"float32"}


@pytest.mark.slow   # two subprocess runs: CI's second step
def test_one_and_two_devices_agree_in_bf16(tmp_path):
    """The same bf16 run on 1 and on 2 fake CPU devices: the same clients and examples, and
    the losses and saved parameters within bfloat16's rounding of each other."""
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                                       + " --xla_force_host_platform_device_count=2")}
    outs = {}
    for devices in (1, 2):
        outs[devices] = str(tmp_path / f"d{devices}")
        proc = subprocess.run([sys.executable, "-m", "experiments.run", *TINY, "--model=mlp",
                               "--thetas=1,0.5", f"--devices={devices}",
                               f"--output_dir={outs[devices]}"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    recs = {d: [json.loads(line) for line in open(os.path.join(o, "metrics.jsonl"))]
            for d, o in outs.items()}
    assert len(recs[1]) == len(recs[2]) >= 2
    for a, b in zip(recs[1], recs[2]):
        assert (a["round"], a["theta"], a["num_selected"]) == (
            b["round"], b["theta"], b["num_selected"])
        assert b["train_loss_mean"] == pytest.approx(a["train_loss_mean"], rel=4 * BF16_EPS)
    for theta in (1.0, 0.5):
        p1, p2 = (load_model(outs[d], theta=theta, seed=1).params for d in (1, 2))
        for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
            np.testing.assert_allclose(b, a, rtol=0, atol=4 * BF16_EPS * float(np.abs(a).max()))
