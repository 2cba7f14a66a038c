"""The Llama model and Hugging Face checkpoints against the real reference, transformers.

tests/fixtures/llama/ holds tiny random models that transformers 5 wrote itself (record.py,
run in a separate environment with torch, transformers and peft) with the float32 logits it
computed for fixed ids: grouped- and multi-query attention, tied and untied heads, head_dim !=
hidden/heads, linear, dynamic, llama3 and YaRN rope, Llama's biases, Qwen2's q/k/v biases in a
bfloat16 file, a sharded index, Mistral's sliding window, and two peft adapters with nonzero A and B. The Flax model's
logits must equal them within 1e-4 relative (Touvron et al. 2023; Hu et al. 2021). The slow tests
also hand what we write back to transformers and peft (live_logits.py) where they are installed.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltafl_jax.errors import DeltaFLError, HFCheckpointError
from deltafl_jax.models.hf_checkpoint import (read_checkpoint, read_peft_adapter, read_tokenizer,
                                              resolve_base_model, write_checkpoint,
                                              write_peft_adapter)
from deltafl_jax.models.llama import Llama, LlamaConfig, LoraConfig, merge_params

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "llama")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["llama_gqa", "llama_tied_linear", "llama_dynamic_bias", "llama3_untied", "llama_yarn",
           "qwen2_bias_bf16", "mistral_window"]
ADAPTERS = [("llama_gqa", "adapter_qv"), ("qwen2_bias_bf16", "adapter_all")]
RTOL = 1e-4


def logits(config, params, ids, lora=None):
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)
    apply = jax.jit(Llama(config, lora=lora).apply)   # one compile: faster than op by op
    return np.asarray(apply({"params": params}, jnp.asarray(ids, jnp.int32)))


def assert_logits_equal(ours, reference):
    """Within 1e-4 relative, element by element, the scale being the largest reference logit."""
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, rtol=RTOL, atol=RTOL * np.abs(reference).max())


def reference(*parts):
    ref = np.load(os.path.join(FIXTURES, *parts, "reference.npz"))
    return ref["ids"], ref["logits"]


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_equal_transformers(name):
    config, params = read_checkpoint(os.path.join(FIXTURES, name))
    ids, expected = reference(name)
    assert_logits_equal(logits(config, params, ids), expected)
    if config.rope_scaling or config.sliding_window:   # the ids exercise them: without, a miss
        plain = dataclasses.replace(config, rope_scaling=None, sliding_window=None)
        assert np.abs(logits(plain, params, ids) - expected).max() > 1e-2 * np.abs(expected).max()


def test_the_fixtures_cover_what_they_claim():
    configs = {n: read_checkpoint(os.path.join(FIXTURES, n))[0] for n in CONFIGS}
    assert configs["llama_gqa"].num_key_value_heads < configs["llama_gqa"].num_attention_heads
    assert configs["llama_tied_linear"].tie_word_embeddings
    assert configs["llama_dynamic_bias"].o_bias and configs["llama_dynamic_bias"].mlp_bias
    assert reference("llama_dynamic_bias")[0].shape[1] > configs[
        "llama_dynamic_bias"].max_position_embeddings   # the dynamic rope is recomputed
    assert configs["llama3_untied"].head_dim * 2 != configs["llama3_untied"].hidden_size
    assert configs["qwen2_bias_bf16"].qkv_bias and not configs["qwen2_bias_bf16"].o_bias
    assert os.path.isfile(os.path.join(FIXTURES, "llama3_untied", "model.safetensors.index.json"))
    _, qwen = read_checkpoint(os.path.join(FIXTURES, "qwen2_bias_bf16"))
    assert qwen["embed_tokens"]["embedding"].dtype.name == "bfloat16"
    assert reference("mistral_window")[0].shape[1] > configs["mistral_window"].sliding_window
    assert {c.rope["rope_type"] for c in configs.values()} == {"default", "linear", "dynamic",
                                                               "llama3", "yarn"}


@pytest.mark.parametrize("base,adapter", ADAPTERS)
def test_peft_adapter_logits_and_round_trip(base, adapter, tmp_path):
    config, params = read_checkpoint(os.path.join(FIXTURES, base))
    lora, adapters = read_peft_adapter(os.path.join(FIXTURES, base, adapter), config)
    ids, expected = reference(base, adapter)
    assert_logits_equal(logits(config, merge_params(adapters, params), ids, lora), expected)
    write_peft_adapter(str(tmp_path), lora, adapters, base_model_name_or_path=base)
    lora2, adapters2 = read_peft_adapter(str(tmp_path), config)
    assert lora2 == lora
    jax.tree_util.tree_map(np.testing.assert_array_equal, adapters2, adapters)
    with open(tmp_path / "adapter_config.json") as f:
        written = json.load(f)
    assert (written["r"], written["lora_alpha"], written["peft_type"]) == (lora.rank, lora.alpha,
                                                                           "LORA")


@pytest.mark.parametrize("name,shard", [("llama3_untied", None), ("qwen2_bias_bf16", 2000)])
def test_checkpoint_round_trip(name, shard, tmp_path):
    config, params = read_checkpoint(os.path.join(FIXTURES, name))
    write_checkpoint(str(tmp_path), config, params, max_shard_bytes=shard)
    assert os.path.isfile(tmp_path / ("model.safetensors" if shard is None
                                      else "model.safetensors.index.json"))
    config2, params2 = read_checkpoint(str(tmp_path))
    assert config2 == config
    jax.tree_util.tree_map(lambda a, b: (np.testing.assert_array_equal(a, b),
                                         assert_same_dtype(a, b)), params2, params)


def assert_same_dtype(a, b):
    assert a.dtype == b.dtype


def test_config_reads_transformers_4_keys():
    """Checkpoints written by transformers 4 keep rope_theta and rope_scaling ("type" in the
    oldest) at the top; transformers 5 nests them in rope_parameters: same configuration."""
    v5 = read_checkpoint(os.path.join(FIXTURES, "llama_tied_linear"))[0].to_hf()
    v4 = dict(v5, rope_theta=500.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert LlamaConfig.from_hf(v4) == LlamaConfig.from_hf(v5)
    assert LlamaConfig.from_hf(v4).rope == {"rope_type": "linear", "factor": 2.0}
    assert LlamaConfig.from_hf(v4).rope_theta == 500.0


def model_with_tokenizer(tmp_path):
    """llama_gqa written by us with a word-level tokenizer.json made by `tokenizers`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, "to": 1, "be": 2, "or": 3, "not": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    config, params = read_checkpoint(os.path.join(FIXTURES, "llama_gqa"))
    write_checkpoint(str(tmp_path / "model"), config, params, str(tmp_path / "tok.json"))
    return tmp_path / "model"


def test_tokenizer_is_copied_and_read(tmp_path):
    folder = model_with_tokenizer(tmp_path)
    assert read_tokenizer(str(folder)).encode("to be or not to be").ids == [1, 2, 3, 4, 1, 2]


@pytest.mark.slow
def test_transformers_loads_the_tokenizer_we_write(tmp_path):
    folder = model_with_tokenizer(tmp_path)
    text = "to be or not to be, that"
    live = run_reference(tmp_path, "--tokens", folder, text)
    assert live.tolist() == read_tokenizer(str(folder)).encode(text).ids == [1, 2, 3, 4, 1, 2, 0, 0]


# --------------------------------------------------------------------------- bad input

def one_line_error(fn, *args, match, **kwargs):
    with pytest.raises(HFCheckpointError, match=match) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, DeltaFLError) and "\n" not in str(info.value)


def copy_fixture(name, tmp_path):
    dest = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dest, ignore=shutil.ignore_patterns("adapter_*"))
    return dest


def test_bad_folders_fail_with_one_line(tmp_path):
    one_line_error(read_checkpoint, str(tmp_path), match="has no config.json")
    folder = copy_fixture("llama_gqa", tmp_path)
    one_line_error(read_tokenizer, str(folder), match="has no tokenizer.json")
    with open(folder / "config.json") as f:
        hf = json.load(f)
    for arch, model_type in [("Gemma2ForCausalLM", "gemma2"), ("GPT2LMHeadModel", "gpt2")]:
        with open(folder / "config.json", "w") as f:
            json.dump(dict(hf, architectures=[arch], model_type=model_type), f)
        one_line_error(read_checkpoint, str(folder), match=f"architecture {arch} .* not supported")
    with open(folder / "config.json", "w") as f:
        json.dump(dict(hf, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                       use_sliding_window=True), f)
    one_line_error(read_checkpoint, str(folder), match="use_sliding_window=true .* not supported")
    with open(folder / "config.json", "w") as f:
        json.dump(dict(hf, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), f)
    one_line_error(read_checkpoint, str(folder), match="rope_scaling type 'longrope'")
    with open(folder / "config.json", "w") as f:
        json.dump(dict(hf, num_hidden_layers=3), f)
    one_line_error(read_checkpoint, str(folder), match="model.layers.2.* is missing")
    with open(folder / "config.json", "w") as f:
        json.dump(dict(hf, intermediate_size=30), f)
    one_line_error(read_checkpoint, str(folder), match=r"down_proj.weight has shape \(16, 32\), config.json "
                                                       r"implies \(16, 30\)")


def test_lora_target_matching_no_layer(tmp_path):
    config, _ = read_checkpoint(os.path.join(FIXTURES, "llama_gqa"))
    adapter = tmp_path / "adapter"
    shutil.copytree(os.path.join(FIXTURES, "llama_gqa", "adapter_qv"), adapter)
    with open(adapter / "adapter_config.json") as f:
        cfg = json.load(f)
    with open(adapter / "adapter_config.json", "w") as f:
        json.dump(dict(cfg, target_modules=["q_proj", "c_attn"]), f)
    one_line_error(read_peft_adapter, str(adapter), config, match="target 'c_attn' matches no layer")
    with open(adapter / "adapter_config.json", "w") as f:
        json.dump(dict(cfg, target_modules=["q_proj"]), f)   # v_proj's tensors now match none
    one_line_error(read_peft_adapter, str(adapter), config, match="v_proj.lora_A.weight matches no")
    with open(adapter / "adapter_config.json", "w") as f:
        json.dump(dict(cfg, use_dora=True), f)
    one_line_error(read_peft_adapter, str(adapter), config, match="use_dora=True is not supported")


def test_bad_write_writes_nothing(tmp_path):
    config, params = read_checkpoint(os.path.join(FIXTURES, "llama_gqa"))
    del params["lm_head"]
    one_line_error(write_checkpoint, str(tmp_path / "out"), config, params,
                   match="lm_head/kernel is missing")
    assert not os.path.exists(tmp_path / "out")


def test_resolve_base_model(tmp_path, monkeypatch):
    assert resolve_base_model(str(tmp_path), download=False) == str(tmp_path)
    one_line_error(resolve_base_model, "TinyLlama/TinyLlama-1.1B-Chat-v1.0", download=False,
                   match="no such folder; to fetch the hub model .*, pass --download")
    one_line_error(resolve_base_model, str(tmp_path / "nowhere"), download=True,
                   match="neither a folder nor a hub id")
    from huggingface_hub import constants   # read at its import: set both, whenever that was
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)   # offline: the hub is never reached
    one_line_error(resolve_base_model, "someone/no-such-model", download=True,
                   match="cannot be downloaded")


# --------------------------------------------------------------------------- live reference

def reference_python():
    """A Python with torch, transformers and peft: this one (pip install .[llm-ref]) or the
    reference environment .venv-ref of record.py; None when neither has them."""
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
        return sys.executable
    except ImportError:
        candidate = os.path.join(ROOT, ".venv-ref", "bin", "python")
        return candidate if os.path.isfile(candidate) else None


def run_reference(tmp_path, *args):
    """What live_logits.py ARGS... saves in OUT.npy, run by the reference Python."""
    python = reference_python()
    if python is None:
        pytest.skip("transformers and peft are not installed here (pip install .[llm-ref]) and "
                    "there is no .venv-ref (tests/fixtures/llama/record.py)")
    subprocess.run([python, os.path.join(FIXTURES, "live_logits.py"), *map(str, args),
                    str(tmp_path / "out.npy")], check=True, timeout=600)
    return np.load(tmp_path / "out.npy")


def live_logits(tmp_path, model_folder, ids, adapter_folder=None):
    np.save(tmp_path / "ids.npy", ids)
    return run_reference(tmp_path, model_folder, tmp_path / "ids.npy",
                         *([adapter_folder] if adapter_folder else []))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3_untied", "qwen2_bias_bf16", "llama_tied_linear",
                                  "mistral_window", "llama_dynamic_bias"])
def test_transformers_loads_what_we_write(name, tmp_path):
    config, params = read_checkpoint(os.path.join(FIXTURES, name))
    write_checkpoint(str(tmp_path / "model"), config, params, max_shard_bytes=4000)
    ids, expected = reference(name)
    assert_logits_equal(live_logits(tmp_path, tmp_path / "model", ids), expected)


@pytest.mark.slow
@pytest.mark.parametrize("base,adapter", ADAPTERS)
def test_peft_loads_the_adapters_we_write(base, adapter, tmp_path):
    config, params = read_checkpoint(os.path.join(FIXTURES, base))
    lora, adapters = read_peft_adapter(os.path.join(FIXTURES, base, adapter), config)
    adapters = jax.tree_util.tree_map(lambda a: a * 1.5, adapters)   # not the recorded values
    write_peft_adapter(str(tmp_path / "adapter"), lora, adapters, base_model_name_or_path=base)
    ids, _ = reference(base, adapter)
    ours = logits(config, merge_params(adapters, params), ids, lora)
    live = live_logits(tmp_path, os.path.join(FIXTURES, base), ids, tmp_path / "adapter")
    assert_logits_equal(ours, live)


def dot_operand_dtypes(jaxpr):
    """(lhs dtype, rhs dtype) of every dot_general in a jaxpr, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield tuple(v.aval.dtype.name for v in eqn.invars)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from dot_operand_dtypes(inner)


@pytest.mark.slow   # three compiles (two gradients, one bfloat16 forward)
def test_remat_and_bfloat16_compute():
    """nn.remat per layer changes memory, not the function: the same gradients (to float32
    reassociation, 1e-5). bfloat16 compute on a
    bfloat16 base: every matmul in bfloat16, logits float32 and near the float32 model's."""
    config, params = read_checkpoint(os.path.join(FIXTURES, "llama_gqa"))
    ids, expected = reference("llama_gqa")
    ids = jnp.asarray(ids, jnp.int32)

    def grad_of(model):
        return jax.jit(jax.grad(lambda p: model.apply({"params": p}, ids)[..., 0].sum()))(params)

    plain, remat = grad_of(Llama(config)), grad_of(Llama(config, remat=True))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                           remat, plain)
    half = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.bfloat16), params)
    apply = Llama(config, dtype=jnp.bfloat16).apply
    dots = list(dot_operand_dtypes(jax.make_jaxpr(apply)({"params": half}, ids).jaxpr))
    assert len(dots) > 10 and set(dots) == {("bfloat16", "bfloat16")}
    out = np.asarray(jax.jit(apply)({"params": half}, ids))
    assert out.dtype == np.float32
    assert np.abs(out - expected).max() < 0.05 * np.abs(expected).max()


@pytest.mark.parametrize("hf,published", [
    # TinyLlama-1.1B (the base of pfl-research's LLM benchmark): untied, 32 heads on 4 kv heads
    (dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
          num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4), 1_100_048_384),
    # Qwen2-0.5B: tied, q/k/v biases, 14 heads on 2
    (dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
          num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
          tie_word_embeddings=True), 494_032_768)])
def test_real_shapes_count_their_published_parameters(hf, published):
    """The tree of a real checkpoint's configuration (an abstract init: nothing allocated)
    holds as many parameters as its model card says."""
    from deltafl_jax.models.llama import param_shapes
    shapes = param_shapes(LlamaConfig.from_hf(hf))
    assert sum(int(np.prod(s)) for s in shapes.values()) == published
