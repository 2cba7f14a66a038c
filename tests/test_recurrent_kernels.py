"""The recurrent layers' implementations (deltafl_jax/models/recurrent.py, ``--rnn_impl``).

References: the GRU and LSTM equations of Flax's cells written out in NumPy here (forward), and
JAX's own differentiation of the scan (gradients), against which the Pallas kernels' hand-written
backward pass is checked (interpreted on the CPU: within 1e-5 in float32, issue 53). The text
models with ``rnn_impl="pallas_interpret"`` keep the parameter tree and initial values of
``nn.RNN`` over Flax's cells and give the same loss and gradient. What runs on a GPU is
checked as far as a CPU can: the kernels lower to Triton calls for CUDA (jax.export); nothing
here compiles or times them on a GPU.
"""

import os
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltafl_jax.models import ModelOptions, build_model
from deltafl_jax.models import recurrent
from deltafl_jax.models.text import CharGRU, FrozenTable, GloveLSTM, WordLSTM

sys.path.insert(0, os.path.dirname(__file__))
from test_text_models import shakespeare_like  # noqa: E402

TOL = 1e-5


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def numpy_gru(xp, w, b_hn, h0):
    """Flax's GRUCell over the steps, the input projection given: xp [B, T, 3H]."""
    hidden, h, out = h0.shape[1], h0.copy(), []
    for t in range(xp.shape[1]):
        xr, xz, xn = np.split(xp[:, t], 3, axis=1)
        hr, hz, hn = np.split(h @ w, 3, axis=1)
        r, z = sigmoid(xr + hr), sigmoid(xz + hz)
        n = np.tanh(xn + r * (hn + b_hn))
        h = (1 - z) * n + z * h
        out.append(h)
    assert h.shape[1] == hidden
    return np.stack(out, axis=1)


def numpy_lstm(xp, w, c0, h0):
    """Flax's OptimizedLSTMCell over the steps (gates i, f, g, o), xp [B, T, 4H]."""
    c, h, out = c0.copy(), h0.copy(), []
    for t in range(xp.shape[1]):
        a_i, a_f, a_g, a_o = np.split(xp[:, t] + h @ w, 4, axis=1)
        c = sigmoid(a_f) * c + sigmoid(a_i) * np.tanh(a_g)
        h = sigmoid(a_o) * np.tanh(c)
        out.append(h)
    return np.stack(out, axis=1)


def operands(kind, batch, steps, hidden, lanes=None, seed=0):
    """(xp, w_h, extra, h0) with extra b_hn (GRU) or c0 (LSTM); `lanes`: a leading lane axis
    on xp and w_h (per-lane weights, as the engine vmaps them)."""
    gates = 3 if kind == "gru" else 4
    keys = jax.random.split(jax.random.key(seed), 4)
    lead = () if lanes is None else (lanes,)
    xp = jax.random.normal(keys[0], lead + (batch, steps, gates * hidden))
    w = jax.random.normal(keys[1], lead + (hidden, gates * hidden)) / np.sqrt(hidden)
    extra = jax.random.normal(keys[2], (hidden,) if kind == "gru" else (batch, hidden))
    return xp, w, extra, jax.random.normal(keys[3], (batch, hidden))


def sequence(kind, impl):
    fn = recurrent.gru_sequence if kind == "gru" else recurrent.lstm_sequence
    return lambda xp, w, extra, h0: fn(xp, w, extra, h0, impl)


def weighted_loss(kind, impl, steps, hidden):
    """sum of the states times fixed weights (every state's cotangent differs)."""
    weights = jnp.cos(jnp.arange(steps * hidden, dtype=jnp.float32)).reshape(steps, hidden)
    return lambda *args: jnp.sum(sequence(kind, impl)(*args) * weights)


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_scan_and_kernels_follow_flax_cell_equations(kind):
    """Forward of both implementations against NumPy, hidden 5 (padded to 16), 3 steps."""
    args = operands(kind, 2, 3, 5)
    numpy_ref = numpy_gru if kind == "gru" else numpy_lstm
    want = numpy_ref(*[np.asarray(a, np.float64) for a in args])
    for impl in ("scan", "pallas_interpret"):
        got = sequence(kind, impl)(*args)
        assert got.shape == (2, 3, 5) and got.dtype == jnp.float32
        assert max_diff(got, want) < TOL, impl


@pytest.mark.parametrize("kind,steps,hidden", [("gru", 1, 5), ("gru", 4, 50),
                                               ("lstm", 1, 50), ("lstm", 4, 5)])
def test_kernel_gradients_equal_the_scans_under_vmap_and_jit(kind, steps, hidden):
    """d/d(xp, w_h, b_hn or c0, h0) of the kernels' custom VJP against JAX's gradient of the
    scan, vmapped over two lanes of per-lane inputs and weights (b_hn / c0 and h0 shared)."""
    args = operands(kind, 3, steps, hidden, lanes=2, seed=steps)
    grads = {impl: jax.jit(jax.vmap(jax.value_and_grad(weighted_loss(kind, impl, steps, hidden),
                                                       argnums=(0, 1, 2, 3)),
                                    in_axes=(0, 0, None, None)))(*args)
             for impl in ("scan", "pallas_interpret")}
    scan, kernel = grads["scan"], grads["pallas_interpret"]
    assert max_diff(scan[0], kernel[0]) < TOL
    for name, a, b in zip(("xp", "w_h", "extra", "h0"), scan[1], kernel[1]):
        assert a.shape == b.shape and float(jnp.max(jnp.abs(a))) > 1e-3, name
        assert max_diff(a, b) < TOL, name


def test_bfloat16_operands_with_float32_state():
    """bf16 projections and weights (--compute_dtype=bfloat16): bf16 states and gradients,
    within bf16's rounding of the float32 results."""
    xp, w, b_hn, h0 = operands("gru", 2, 3, 50)
    loss = weighted_loss("gru", "pallas_interpret", 3, 50)
    bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
    out = recurrent.gru_sequence(bf(xp), bf(w), b_hn, h0, "pallas_interpret")
    assert out.dtype == jnp.bfloat16
    value, grads = jax.value_and_grad(loss, argnums=(0, 1))(bf(xp), bf(w), b_hn, h0)
    ref_value, ref_grads = jax.value_and_grad(weighted_loss("gru", "scan", 3, 50),
                                              argnums=(0, 1))(xp, w, b_hn, h0)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]
    assert abs(float(value) - float(ref_value)) < 2e-2 * max(1.0, abs(float(ref_value)))
    for g, r in zip(grads, ref_grads):
        assert max_diff(g, r) < 2e-2 * float(jnp.max(jnp.abs(r)))


@pytest.mark.slow   # Shakespeare's GRU at full width, 20 interpreted steps: 15 s
def test_gru_model_in_bfloat16_with_the_kernels():
    """--compute_dtype=bfloat16 with --rnn_impl=pallas_interpret: the loss and the float32
    gradient of the float32 scan model, within bfloat16's rounding."""
    data = shakespeare_like(n=4)
    x, y = jnp.asarray(data.train.x[:3]), jnp.asarray(data.train.y[:3])
    results = []
    for impl, dtype in (("scan", "float32"), ("pallas_interpret", "bfloat16")):
        model = build_model("gru", data, ModelOptions(rnn_impl=impl, compute_dtype=dtype))
        params = model.init(jax.random.key(0))
        results.append(jax.value_and_grad(lambda p: jnp.mean(model.losses(p, x, y)))(params))
    (ref_loss, ref_grad), (loss, grad) = results
    assert abs(float(loss) - float(ref_loss)) < 1e-2 * abs(float(ref_loss))
    for g, r in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad)):
        assert g.dtype == jnp.float32 and max_diff(g, r) < 2e-2 * float(jnp.max(jnp.abs(r)))


def text_models():
    table = FrozenTable(np.random.default_rng(0).normal(size=(9, 3)))
    return {"gru": lambda impl: CharGRU(num_classes=5, vocab_size=7, hidden=6, rnn_impl=impl),
            "lstm": lambda impl: GloveLSTM(table=table, hidden=5, max_tokens=4, rnn_impl=impl),
            "lstm_nwp": lambda impl: WordLSTM(vocab_size=7, embed_dim=4, hidden=5,
                                              rnn_impl=impl)}


@pytest.mark.parametrize("name", ["gru", "lstm", "lstm_nwp"])
def test_text_models_same_parameters_loss_and_gradient(name):
    """The kernels' layer declares nn.RNN's parameters (same tree, same initial values) and
    gives the same loss and gradient."""
    make = text_models()[name]
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 7, (2, 4)))
    params = make("scan").init(jax.random.key(3), ids)["params"]
    mine = make("pallas_interpret").init(jax.random.key(3), ids)["params"]
    assert jax.tree.structure(params) == jax.tree.structure(mine)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                      jax.tree.leaves(mine)))

    def loss(impl):
        return lambda p: jnp.sum(jnp.sin(make(impl).apply({"params": p}, ids)))

    scan = jax.value_and_grad(loss("scan"))(params)
    kernel = jax.value_and_grad(loss("pallas_interpret"))(params)
    assert max_diff(scan, kernel) < TOL


def test_default_is_scan_and_pallas_is_refused_off_a_gpu():
    for backend in ("cpu", "gpu", "tpu", None):
        assert recurrent.default_rnn_impl(backend) == "scan"
    data = shakespeare_like(n=4)
    assert build_model("gru", data, ModelOptions()).module.rnn_impl == "scan"
    model = build_model("gru", data, ModelOptions(rnn_impl="pallas_interpret"))
    assert model.module.rnn_impl == "pallas_interpret"
    with pytest.raises(ValueError, match="rnn_impl=pallas .*need a GPU"):
        build_model("gru", data, ModelOptions(rnn_impl="pallas", conv_backend="cpu"))
    recurrent.check_rnn_impl("pallas", "gpu")
    with pytest.raises(ValueError, match="must be one of"):
        recurrent.check_rnn_impl("loop", "cpu")


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_kernels_lower_to_triton_for_cuda(kind):
    """The vmapped gradient exports for CUDA without a GPU: exactly two Triton calls (the
    forward kernel and the backward one; the two lanes a grid axis of 2) on tiles padded to
    powers of two (batch 3 -> 16, hidden 50 -> 64), and no while loop left to XLA.
    Lowering only: Triton's compilation to PTX happens on a GPU and is untested here."""
    from jax import export
    args = operands(kind, 3, 4, 50, lanes=2)
    grad = jax.vmap(jax.grad(weighted_loss(kind, "pallas", 4, 50), argnums=(0, 1, 3)),
                    in_axes=(0, 0, None, None))
    exported = export.export(jax.jit(grad), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exported.mlir_module()
    calls = [line for line in text.splitlines()
             if "stablehlo.custom_call @__gpu$xla.gpu.triton" in line]
    assert len(calls) == 2 and "stablehlo.while" not in text
    # vmap's batching rule: one program per lane, each over its padded [16, 64] tiles
    assert all("grid_x = 2 : i32, grid_y = 1 : i32, grid_z = 1" in line for line in calls)
    assert all("x16x64xf32>" in line and "x50xf32>" not in line for line in calls)


def run_metrics(tmp_path, impl, run_runner, capsys):
    out = tmp_path / impl
    code, err, _ = run_runner([
        "--dataset=shakespeare", f"--data_dir={tmp_path / 'cache'}", "--max_train_clients=3",
        "--max_test_clients=2", "--max_examples_per_client=24", "--model=gru",
        "--thetas=1.0", "--seeds=1", "--num_rounds=3", "--clients_per_round=2",
        "--batch_size=8", "--learning_rate=0.5", "--eval_every=1", f"--rnn_impl={impl}",
        f"--output_dir={out}"], capsys)
    assert code in (0, None), err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k.startswith(("train_", "test_"))} for row in rows]


@pytest.mark.slow
def test_command_with_interpreted_kernels_matches_scan(tmp_path, capsys):
    """A tiny Shakespeare GRU run through the command: --rnn_impl=pallas_interpret gives the
    metrics of --rnn_impl=scan within 1e-5 after 3 rounds; --rnn_impl=pallas on a CPU is
    refused in one line, exit 2, nothing written."""
    from conftest import run_runner
    scan = run_metrics(tmp_path, "scan", run_runner, capsys)
    kernel = run_metrics(tmp_path, "pallas_interpret", run_runner, capsys)
    assert len(scan) == len(kernel) >= 3
    for a, b in zip(scan, kernel):
        assert a.keys() == b.keys() and a
        for key in a:
            assert abs(a[key] - b[key]) <= TOL * max(1.0, abs(a[key])), key
    code, err, _ = run_runner(["--dataset=shakespeare", f"--data_dir={tmp_path / 'cache'}",
                               "--model=gru", "--rnn_impl=pallas",
                               f"--output_dir={tmp_path / 'refused'}"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "need a GPU" in lines[0], err
    assert not (tmp_path / "refused").exists()
