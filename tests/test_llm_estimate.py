"""--estimate with a frozen base (issue 52): a LoRA run's pretrained base is held once per device,
whatever its replicas and lanes, and the estimate counts it once.

The reference is independent of the library: the base's bytes are read from the checkpoint's
``model.safetensors`` with the ``safetensors`` package (in the run's --base_dtype), and what
the compiled round holds of it is read off the round's own lowered program: the arrays that
XLA gets as constants of the program (JAX 0.10 embeds a closed-over array as a literal) or as
constant arguments (``jax.const``, where JAX hoists them). A base copied per lane or per
replica would appear that many times there.
"""

import collections
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import llm_fixtures as F  # noqa: E402

LARGE = 512   # bytes: the base's matrices (the norms' vectors and the rope tables are smaller)
ITEMSIZE = {"bf16": 2, "f32": 4, "f16": 2}


def tensor_type(text):
    """'16x120xbf16' -> ((16, 120), 'bf16')."""
    *dims, dtype = text.split("x")
    return tuple(int(d) for d in dims), dtype


def program_constants(module_text):
    """Counter of (shape, dtype) of the program's constant arrays of at least LARGE bytes:
    dense literals and arguments marked jax.const."""
    found = [tensor_type(t) for t in re.findall(
        r'stablehlo\.constant dense<"0x[0-9A-Fa-f]+"> : tensor<([0-9x]+x[a-z0-9]+)>',
        module_text)]
    found += [tensor_type(t) for t in re.findall(
        r"%arg\d+: tensor<([0-9x]+x[a-z0-9]+)> \{[^}]*jax\.const = true", module_text)]
    return collections.Counter(
        (shape, dtype) for shape, dtype in found
        if int(np.prod(shape)) * ITEMSIZE.get(dtype, 4) >= LARGE)


def base_arrays(folder):
    """The checkpoint's tensors (name -> array), read with safetensors alone."""
    from safetensors.numpy import load_file
    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.slow
def test_frozen_base_counted_once_as_the_round_holds_it(tmp_path):
    from deltafl_jax import ExperimentConfig, build_experiment
    from deltafl_jax.datasets import DataConfig, load_dataset
    from deltafl_jax.run.estimate import round_memory

    base = str(tmp_path / "base")
    F.tiny_base(base)
    rows = F.write_jsonl(str(tmp_path / "users.jsonl"), F.user_rows(users=8, per_user=4))
    data_cfg = DataConfig(f"text:{rows}", data_dir=str(tmp_path / "data"), base_model=base,
                          client_column="user", max_length=16)
    # 4 replicas (2 thetas x 2 seeds), 2 lanes: 8 readers of one base
    cfg = ExperimentConfig(data_cfg, model="llama", algorithm="deltafl", thetas=(0.5, 0.8),
                           seeds=(1, 2), clients_per_round=2, batch_size=2, num_rounds=2,
                           output_dir=None, save_models=False, verbose=False,
                           base_dtype="bfloat16", clients_per_step=2, devices=1)
    exp = build_experiment(cfg, load_dataset(cfg.data))
    assert exp.replicas.size == 4 and exp.placement.lanes == 2

    tensors = base_arrays(base)
    expected = sum(a.size * 2 for a in tensors.values())          # bfloat16: 2 bytes each
    assert exp.program.footprint.frozen == expected
    assert f"frozen base {expected / 2 ** 20:.1f} MB (once" in exp.program.placement_line(exp.run)

    state, keys = exp.initial_state(), exp.keys()
    plan = exp.round_data(0, state)
    lowered = exp.round_fn.lower(state, plan, keys)
    held = round_memory(lowered.compile(), exp, state, plan, keys)
    assert held.frozen == expected
    assert held.total == (held.data + held.state + held.plan + held.keys + held.tables
                          + expected + held.outputs - held.aliased + held.temporaries)

    # what the round's program holds of the base: each large matrix once (hf layout [out, in]
    # in the file, [in, out] in the model: the shapes are compared as sets of dimensions)
    want = collections.Counter((tuple(sorted(a.shape)), "bf16") for a in tensors.values()
                               if a.size * 2 >= LARGE)
    got = collections.Counter()
    for (shape, dtype), n in program_constants(lowered.as_text()).items():
        if dtype == "bf16":
            got[(tuple(sorted(shape)), dtype)] += n
    assert got == want, (got, want)
    assert sum(want.values()) >= 4          # the test has matrices to count



SETTING_SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp
import llm_fixtures as F
from deltafl_jax.data import ClientData, FederatedDataset
from deltafl_jax.models import build_model, hf_checkpoint
print("setting", jax.config.jax_use_simplified_jaxpr_constants)
F.tiny_base({base!r})
config, _ = hf_checkpoint.read_checkpoint({base!r})
split = ClientData(x=jnp.zeros((2, 8), jnp.int32), y=None, offsets=[0, 2], client_ids=[0])
data = FederatedDataset("text:rows", split, split, config.vocab_size, metadata={{
    "task": "causal_lm", "base_model": {base!r}, "input_vocab_size": config.vocab_size}})
model = build_model("llama", data)
params = model.init(jax.random.key(0))
print(jax.jit(model.apply).lower(params, jnp.zeros((2, 8), jnp.int32)).as_text())
"""


def _lowered_apply(tmp_path, name, simplified):
    """The lowered forward pass of --model=llama on a tiny base, in a process started with
    or without JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS=1 (read by JAX at its import only)."""
    import subprocess
    base = str(tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k != "JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS"}
    if simplified:
        env["JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS"] = "1"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", SETTING_SCRIPT.format(tests=os.path.dirname(__file__), base=base)],
        cwd=repo, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"setting {simplified}" in proc.stdout
    return proc.stdout


@pytest.mark.slow
def test_simplified_constants_pass_the_base_as_arguments_not_literals(tmp_path):
    """docs/guides/llm.md's recipe for a large base: with JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS=1
    a program gets the frozen base as arguments (``jax.const``), never as literals embedded
    in it; without it (JAX 0.10's default) the same program embeds them (the control)."""
    def literals(text):
        found = re.findall(r'stablehlo\.constant dense<"0x[0-9A-Fa-f]+"> : '
                           r'tensor<([0-9x]+x[a-z0-9]+)>', text)
        return [t for t in found if int(np.prod(tensor_type(t)[0])) * 4 >= LARGE]
    on = _lowered_apply(tmp_path, "on", True)
    assert not literals(on), literals(on)
    assert sum(program_constants(on).values()) >= 4   # the base's matrices, as arguments
    off = _lowered_apply(tmp_path, "off", False)
    assert len(literals(off)) >= 4
