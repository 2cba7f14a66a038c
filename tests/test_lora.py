"""LoRA on the Llama model (Hu et al. 2021) with peft's conventions, and the trainable/frozen
split of --finetune=lora|full|head, against closed forms: the update (alpha / r) B A x, A drawn
as torch.nn.Linear's weight (Kaiming-uniform, a = sqrt(5)), B = 0 so the first forward is the
base's and dL/dA = 0 there."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from deltafl_jax.errors import ConfigError, HFCheckpointError
from deltafl_jax.models.hf_checkpoint import read_checkpoint
from deltafl_jax.models.llama import (PROJECTIONS, Linear, Llama, LlamaConfig, LoraConfig,
                                      flatten, init_adapters, lora_a_init, lora_targets_matching,
                                      merge_params, split_params)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "llama")
TINY = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)
IDS = jnp.asarray(np.arange(12).reshape(2, 6) * 5 % 32, jnp.int32)


def paths(tree):
    return {path: np.shape(leaf) for path, leaf in flatten(tree)}


def test_b_zero_forward_equals_the_base():
    """A base read from transformers' file, adapters on all seven projections: bit for bit."""
    config, base = read_checkpoint(os.path.join(FIXTURES, "llama_gqa"))
    lora = LoraConfig(rank=4, alpha=16, targets=("all-linear",))
    adapters = init_adapters(jax.random.PRNGKey(1), config, lora)
    assert len(paths(adapters)) == 2 * 7 * config.num_hidden_layers
    plain = jax.jit(Llama(config).apply)({"params": base}, IDS)
    adapted = jax.jit(Llama(config, lora=lora).apply)({"params": merge_params(adapters, base)}, IDS)
    np.testing.assert_array_equal(np.asarray(adapted), np.asarray(plain))


def test_init_adapters_is_the_module_tree():
    lora = LoraConfig(rank=3, targets=("v_proj", "q_proj", "down_proj"))
    params = jax.jit(Llama(TINY, lora=lora).init)(jax.random.PRNGKey(0), IDS)["params"]
    from_module, _ = split_params(params, "lora")
    fresh = init_adapters(jax.random.PRNGKey(0), TINY, lora)
    assert paths(fresh) == paths(from_module)
    assert {p[-3] for p in paths(fresh)} == {"q_proj", "v_proj", "down_proj"}
    for tree in (fresh, from_module):
        for path, leaf in flatten(tree):
            if "lora_B" in path:
                assert not np.any(np.asarray(leaf))
            else:
                assert np.any(np.asarray(leaf)) and np.abs(leaf).max() <= 1 / math.sqrt(path_in(path))


def path_in(path):
    return {"down_proj": TINY.intermediate_size}.get(path[-3], TINY.hidden_size)


def test_lora_a_is_drawn_as_torch_linear_weight():
    """torch.nn.init.kaiming_uniform_(w, a=sqrt(5)) on w [r, in]: gain sqrt(2 / (1 + a^2)),
    std gain / sqrt(in), uniform on +-sqrt(3) std."""
    fan_in, rank = 96, 64
    gain = math.sqrt(2.0 / (1 + 5.0))
    bound = math.sqrt(3.0) * gain / math.sqrt(fan_in)
    a = np.asarray(lora_a_init(jax.random.PRNGKey(3), (fan_in, rank))).ravel()
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.99 * bound
    assert stats.kstest(a, stats.uniform(-bound, 2 * bound).cdf).pvalue > 1e-3


def test_linear_is_base_plus_scaled_low_rank_update():
    lora = LoraConfig(rank=3, alpha=12.0)
    layer = Linear(5, use_bias=True, lora=lora)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 7))
    params = layer.init(jax.random.PRNGKey(1), x)["params"]
    params["lora_B"]["kernel"] = jax.random.normal(jax.random.PRNGKey(2), (3, 5))
    params["bias"] = jax.random.normal(jax.random.PRNGKey(4), (5,))
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    xs = np.asarray(x, np.float64)
    expected = (xs @ p["kernel"] + p["bias"]
                + 12.0 / 3 * (xs @ p["lora_A"]["kernel"]) @ p["lora_B"]["kernel"])
    np.testing.assert_allclose(np.asarray(layer.apply({"params": params}, x)), expected,
                               rtol=1e-5, atol=1e-6)


def test_gradient_at_b_zero_reaches_b_only():
    """y = W x + s B A x: dL/dA = s B^T (dL/dy) x^T = 0 while B = 0; dL/dB = s (dL/dy)(A x)^T != 0."""
    lora = LoraConfig(rank=2)
    params = Llama(TINY, lora=lora).init(jax.random.PRNGKey(0), IDS)["params"]
    trainable, frozen = split_params(params, "lora")

    def loss(t):
        out = Llama(TINY, lora=lora).apply({"params": merge_params(t, frozen)}, IDS)
        return jnp.mean(jax.nn.log_softmax(out)[..., 0])

    grads = jax.jit(jax.grad(loss))(trainable)
    for path, g in flatten(grads):
        assert np.any(np.asarray(g)) == ("lora_B" in path), path


def test_split_and_merge():
    lora = LoraConfig(rank=2)
    params = Llama(TINY, lora=lora).init(jax.random.PRNGKey(0), IDS)["params"]
    everything = paths(params)
    for finetune, wanted in [("lora", lambda p: p[-2] in ("lora_A", "lora_B")),
                             ("head", lambda p: p[0] == "lm_head"), ("full", lambda p: True)]:
        trainable, frozen = split_params(params, finetune)
        assert set(paths(trainable)) == {p for p in everything if wanted(p)}, finetune
        assert set(paths(frozen)) == {p for p in everything if not wanted(p)}, finetune
        merged = merge_params(trainable, frozen)
        assert paths(merged) == everything
        for (p1, a), (p2, b) in zip(sorted(flatten(merged)), sorted(flatten(params))):
            assert p1 == p2 and a is b
    with pytest.raises(ConfigError, match="is both trainable and frozen"):
        merge_params(params, params)


def test_split_refuses_what_cannot_be_trained():
    tied = LlamaConfig(**{**TINY.__dict__, "tie_word_embeddings": True})
    params = Llama(tied).init(jax.random.PRNGKey(0), IDS)["params"]
    assert "lm_head" not in params
    with pytest.raises(ConfigError, match="--finetune=head needs a separate lm_head"):
        split_params(params, "head")
    with pytest.raises(ConfigError, match="without LoRA adapters"):
        split_params(params, "lora")
    with pytest.raises(ConfigError, match="--finetune=adapters is not one of"):
        split_params(params, "adapters")


def test_lora_targets_matching():
    assert lora_targets_matching(TINY, ["v_proj", "q_proj"]) == ("q_proj", "v_proj")
    assert lora_targets_matching(TINY, ["all-linear"]) == PROJECTIONS
    with pytest.raises(HFCheckpointError, match="LoRA target 'qkv_proj' matches no layer"):
        lora_targets_matching(TINY, ["q_proj", "qkv_proj"])
    assert LoraConfig().targets == ("q_proj", "v_proj") and LoraConfig().scaling == 2.0
    assert LoraConfig(targets=["all-linear"]).targets == PROJECTIONS
    assert LoraConfig(targets=("v_proj", "q_proj")) == LoraConfig()
    with pytest.raises(HFCheckpointError, match="LoRA target 'c_attn' matches no layer"):
        LoraConfig(targets=("c_attn",))
