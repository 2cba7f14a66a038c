"""A decoder-only transformer with Hugging Face's Llama architecture, and LoRA adapters on it.

The architecture is LLaMA's (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language
Models", Sec. 2.2) as Hugging Face transformers implements it (``LlamaForCausalLM``,
``Qwen2ForCausalLM``), so the checkpoints of the Llama, TinyLlama, SmolLM and Qwen2 families load
(and Mistral's, whose only difference is an optional sliding window) load by renaming their
tensors (:mod:`deltafl_jax.models.hf_checkpoint`):

- pre-normalisation with RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``,
  the statistic taken in float32;
- rotary position embeddings (Su et al. 2021, RoFormer) on the queries and keys, in the
  "rotate half" layout of transformers, with ``rope_theta`` and the ``rope_scaling`` kinds that
  checkpoints use: ``linear`` (position interpolation, Chen et al. 2023), ``dynamic`` (NTK
  scaling recomputed when a sequence is longer than ``max_position_embeddings``, as transformers
  does for the length of the call), ``llama3`` (Llama 3.1's banded frequencies) and ``yarn``
  (Peng et al. 2023, with its attention factor on cos and sin);
- grouped-query attention (Ainslie et al. 2023): query head h reads key/value head
  ``h // (num_attention_heads / num_key_value_heads)``, causal, softmax in float32, scaled by
  ``head_dim ** -0.5``; with Mistral's ``sliding_window`` w, position i reads j > i - w only;
- the SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``;
- output head tied to the embedding or separate; q/k/v biases (Qwen2, or ``attention_bias``
  for Llama, which also puts one on o_proj).

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", Eq. 3) adds to a
targeted projection ``W x`` the update ``(alpha / r) * B A x`` with A in R^{r x in}, B in
R^{out x r}. As in peft: A starts as ``torch.nn.Linear``'s weight does (Kaiming-uniform with
a = sqrt(5), i.e. uniform on [-1/sqrt(in), 1/sqrt(in)]), B = 0 (so the first forward is the
base's), the default targets are q_proj and v_proj, and the parameters are called lora_A and
lora_B. :func:`split_params` separates what ``--finetune=lora|full|head`` trains from the frozen
base and :func:`merge_params` puts them back together.

The parameter tree mirrors transformers' names: ``embed_tokens/embedding`` [V, H];
``layers_N/{input_layernorm,post_attention_layernorm}/weight`` [H];
``layers_N/self_attn/{q,k,v,o}_proj/{kernel [in, out], bias [out]?, lora_A/kernel [in, r],
lora_B/kernel [r, out]}``; ``layers_N/mlp/{gate,up,down}_proj/...``; ``norm/weight`` [H];
``lm_head/kernel`` [H, V] (absent when tied). Kernels are transformers' weights transposed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.errors import ConfigError, HFCheckpointError

# model_type -> the transformers class that reads it (config.json's "architectures").
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM"}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
LORA_LEAVES = ("lora_A", "lora_B")
FINETUNE_KINDS = ("lora", "full", "head")
INIT_STD = 0.02   # transformers' initializer_range: N(0, 0.02) for linear and embedding weights
# The keys each rope_scaling type needs (transformers' modeling_rope_utils).
ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                            "original_max_position_embeddings"),
                 "yarn": ()}

Params = Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The architecture: the fields of transformers' LlamaConfig/Qwen2Config that matter.

    ``head_dim`` None means hidden_size // num_attention_heads and ``num_key_value_heads`` None
    means num_attention_heads (both filled in). ``rope_scaling`` is None or a sorted tuple of
    (key, value) items with a "rope_type" among ROPE_TYPES (hashable, so a module can hold it).
    """
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Tuple[Tuple[str, Any], ...]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None          # an int, or a tuple of ints as some checkpoints have
    pad_token_id: Optional[int] = None
    sliding_window: Optional[int] = None   # Mistral's: position i attends to j > i - window

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.model_type not in ARCHITECTURES:
            raise HFCheckpointError(f"model_type {self.model_type!r} is not supported "
                                    f"(supported: {', '.join(ARCHITECTURES)})")
        if self.model_type != "llama" and (self.attention_bias or self.mlp_bias):
            raise HFCheckpointError(f"attention_bias/mlp_bias are Llama's; {self.model_type} "
                                    f"fixes its biases")
        if self.sliding_window is not None and self.model_type != "mistral":
            raise HFCheckpointError(f"sliding_window is Mistral's, not {self.model_type}'s")
        if self.num_attention_heads % self.num_key_value_heads:
            raise HFCheckpointError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        _check_rope(self.rope)

    @property
    def rope(self) -> Dict[str, Any]:
        """rope_scaling as a dict with its "rope_type" ("default" when there is none)."""
        return dict(self.rope_scaling) if self.rope_scaling else {"rope_type": "default"}

    @property
    def qkv_bias(self) -> bool:
        """Whether q_proj, k_proj and v_proj have a bias (always for Qwen2)."""
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_bias(self) -> bool:
        """Whether o_proj has a bias (Llama's attention_bias; never for Qwen2 or Mistral)."""
        return self.attention_bias

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "LlamaConfig":
        """From a config.json's dict (transformers 4's rope_theta/rope_scaling or 5's
        rope_parameters); HFCheckpointError naming what is not supported."""
        model_type = str(hf.get("model_type"))
        archs = list(hf.get("architectures") or [ARCHITECTURES.get(model_type, "")])
        known = set(ARCHITECTURES.values())
        if model_type not in ARCHITECTURES or not set(archs) <= known:
            raise HFCheckpointError(
                f"architecture {'/'.join(archs) or '?'} (model_type {model_type!r}) is not "
                f"supported; supported: {', '.join(sorted(known))}")
        _check_hf_variant(hf)
        llama = model_type == "llama"   # the biases are settings of Llama's only
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
        if rope.get("partial_rotary_factor") == 1.0:
            del rope["partial_rotary_factor"]
        if rope["rope_type"] in ("llama3", "yarn"):   # as transformers 5 standardises it
            rope.setdefault("original_max_position_embeddings",
                            hf.get("max_position_embeddings", 2048))
        return cls(
            vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=int(hf["num_attention_heads"]),
            num_key_value_heads=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=None if rope["rope_type"] == "default" else tuple(sorted(rope.items())),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=llama and bool(hf.get("attention_bias", False)),
            mlp_bias=llama and bool(hf.get("mlp_bias", False)), model_type=model_type,
            sliding_window=hf.get("sliding_window") if model_type == "mistral" else None,
            bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"))

    def to_hf(self) -> Dict[str, Any]:
        """A config.json dict that transformers loads (rope_theta and rope_scaling as in
        transformers 4: 5 reads them too; 4.43+ for a rope_scaling other than None)."""
        out = {"architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
               "hidden_act": "silu", "initializer_range": INIT_STD, "attention_dropout": 0.0,
               "use_cache": True, "torch_dtype": "float32"}
        for field in dataclasses.fields(self):
            if field.name not in ("model_type", "rope_scaling"):
                value = getattr(self, field.name)
                out[field.name] = list(value) if isinstance(value, tuple) else value
        out["rope_scaling"] = self.rope if self.rope_scaling else None
        if self.model_type != "llama":
            for key in ("attention_bias", "mlp_bias"):
                del out[key]
        if self.model_type != "mistral":
            del out["sliding_window"]
        if self.model_type == "qwen2":
            out["use_sliding_window"] = False
        return out


def _check_hf_variant(hf: Mapping[str, Any]) -> None:
    """The config.json settings this model does not implement, refused by name."""
    if hf.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    if hf.get("use_sliding_window"):
        raise HFCheckpointError("use_sliding_window=true (sliding-window attention) is not "
                                "supported")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFCheckpointError("partial_rotary_factor != 1 is not supported")


def _check_rope(rope: Mapping[str, Any]) -> None:
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise HFCheckpointError(f"rope_scaling type {kind!r} is not supported "
                                f"(supported: {', '.join(ROPE_TYPES)})")
    missing = [k for k in ROPE_REQUIRED.get(kind, ()) if rope.get(k) is None]
    if missing:
        raise HFCheckpointError(f"rope_scaling type {kind!r} lacks {', '.join(missing)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFCheckpointError("partial_rotary_factor != 1 is not supported")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA's settings (Hu et al. 2021). The scale of B A x is alpha / rank. The default alpha
    is 16, twice the rank as in pfl-research's LLM benchmark and most recipes (peft's own
    default lora_alpha is 8, a scale of 1 at rank 8). ``dropout`` is kept for the peft files
    only: the forward here is deterministic (no dropout on the adapters' input). ``targets`` are
    kept in the layer's order, "all-linear" expanded (see :func:`lora_targets_matching`)."""
    rank: int = 8
    alpha: float = 16.0
    targets: Tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "targets", lora_targets_matching(None, self.targets))
        if self.rank < 1:
            raise ConfigError(f"the LoRA rank must be at least 1, not {self.rank}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_targets_matching(config: Optional[LlamaConfig], targets) -> Tuple[str, ...]:
    """The projections of every layer that `targets` names, in the layer's order.

    "all-linear" (peft's shorthand) names all seven; a name matching no projection raises
    HFCheckpointError naming it. `config` (may be None) is there for the day layers differ."""
    del config   # every layer of this architecture has the same seven projections
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    if "all-linear" in names:
        return PROJECTIONS
    unknown = [t for t in names if t not in PROJECTIONS]
    if unknown or not names:
        raise HFCheckpointError(
            f"LoRA target {unknown[0] if unknown else '(none)'!r} matches no layer "
            f"(the projections are {', '.join(PROJECTIONS)})")
    return tuple(p for p in PROJECTIONS if p in names)


# --------------------------------------------------------------------------- rotary embedding

def rope_inverse_frequencies(config: LlamaConfig, length: int) -> Tuple[np.ndarray, float]:
    """(inv_freq float32 [head_dim / 2], attention factor) of the rotary embedding for a call on
    `length` positions, as transformers' ROPE_INIT_FUNCTIONS compute them."""
    rope, dim, base = config.rope, cast(int, config.head_dim), config.rope_theta
    kind = rope["rope_type"]
    if kind == "dynamic" and length > config.max_position_embeddings:
        factor = rope["factor"]   # NTK-aware base, recomputed for the longer call
        base = base * ((factor * length / config.max_position_embeddings)
                       - (factor - 1)) ** (dim / (dim - 2))
    exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / np.float32(base) ** exponents).astype(np.float32)
    if kind == "linear":
        return (inv_freq / np.float32(rope["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn_frequencies(config, rope)
    return inv_freq, 1.0


def _llama3_frequencies(inv_freq: np.ndarray, rope: Mapping[str, Any]) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor, old = rope["factor"], rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_frequencies(config: LlamaConfig, rope: Mapping[str, Any]) -> Tuple[np.ndarray, float]:
    """YaRN (Peng et al. 2023): interpolated frequencies below the band [beta_slow, beta_fast]
    rotations, extrapolated above, a linear ramp in it; cos and sin scaled by the attention
    factor 0.1 ln(factor) + 1 (or mscale / mscale_all_dim's ratio, or as given)."""
    dim, base = cast(int, config.head_dim), config.rope_theta   # filled in by __post_init__
    original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = rope.get("factor") or config.max_position_embeddings / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(rope.get("beta_fast") or 32)
    high = correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.astype(np.float32)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention)


def rotary_tables(config: LlamaConfig, length: int) -> Tuple[jax.Array, jax.Array]:
    """(cos, sin) float32 [length, head_dim] for positions 0..length-1, attention factor in."""
    inv_freq, attention = rope_inverse_frequencies(config, length)
    freqs = jnp.arange(length, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)                       # [T, D]
    return jnp.cos(emb) * attention, jnp.sin(emb) * attention


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, D] rotated: x cos + rotate_half(x) sin, rotate_half = (-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


# --------------------------------------------------------------------------- modules

def lora_a_init(key, shape, dtype=jnp.float32):
    """A [in, r] as torch.nn.Linear(in, r)'s weight: Kaiming-uniform with a = sqrt(5), i.e.
    U(-1/sqrt(in), 1/sqrt(in)) (gain sqrt(2 / (1 + a^2)) = sqrt(1/3), bound sqrt(3) gain /
    sqrt(in))."""
    bound = 1.0 / math.sqrt(shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class Linear(nn.Module):
    """y = x W (+ b) (+ (alpha / r) x A B): a projection with its optional LoRA adapter.

    ``kernel`` [in, out] and ``bias`` [out] are the base's (any stored dtype); ``lora_A/kernel``
    [in, r] and ``lora_B/kernel`` [r, out] the adapter's. Computed in ``dtype``.
    """
    features: int
    use_bias: bool = False
    lora: Optional[LoraConfig] = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):                                        # x [..., in]
        kernel = self.param("kernel", nn.initializers.normal(INIT_STD),
                            (x.shape[-1], self.features), self.param_dtype)
        x = x.astype(self.dtype)
        y = jnp.dot(x, kernel.astype(self.dtype))                 # [..., out]
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,),
                               self.param_dtype).astype(self.dtype)
        if self.lora is not None:
            a = nn.Dense(self.lora.rank, use_bias=False, kernel_init=lora_a_init,
                         dtype=self.dtype, name="lora_A")(x)      # [..., r]
            b = nn.Dense(self.features, use_bias=False, kernel_init=nn.initializers.zeros,
                         dtype=self.dtype, name="lora_B")(a)      # [..., out]
            y = y + b * jnp.asarray(self.lora.scaling, self.dtype)
        return y


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, the statistic in float32 (Zhang & Sennrich 2019)."""
    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):                                        # x [B, T, H]
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return weight.astype(self.dtype) * normed.astype(self.dtype)


class _Projections(nn.Module):
    """Shared fields of the blocks that hold projections."""
    config: LlamaConfig
    lora: Optional[LoraConfig] = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def linear(self, name: str, features: int, use_bias: bool) -> Linear:
        targeted = self.lora is not None and name in self.lora.targets
        return Linear(features, use_bias, self.lora if targeted else None, self.dtype,
                      self.param_dtype, name=name)


class Attention(_Projections):
    """Causal grouped-query self-attention with rotary positions (HF LlamaAttention)."""

    @nn.compact
    def __call__(self, x, cos, sin):                              # x [B, T, H]; cos [T, D]
        c = self.config
        heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        batch, length = x.shape[:2]
        q = self.linear("q_proj", heads * d, c.qkv_bias)(x).reshape(batch, length, heads, d)
        k = self.linear("k_proj", kv * d, c.qkv_bias)(x).reshape(batch, length, kv, d)
        v = self.linear("v_proj", kv * d, c.qkv_bias)(x).reshape(batch, length, kv, d)
        q = apply_rotary(q, cos.astype(self.dtype), sin.astype(self.dtype))
        k = apply_rotary(k, cos.astype(self.dtype), sin.astype(self.dtype))
        q = q.reshape(batch, length, kv, heads // kv, d)          # query head h = k*G + g
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k,
                            preferred_element_type=jnp.float32) * (d ** -0.5)
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))      # [T, S]: j <= i
        if c.sliding_window is not None:                                 # and j > i - w
            causal = causal & jnp.triu(jnp.ones((length, length), dtype=bool),
                                       1 - c.sliding_window)
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)  # [B, KV, G, T, S]
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(batch, length, heads * d)
        return self.linear("o_proj", c.hidden_size, c.o_bias)(out)


class MLP(_Projections):
    """SwiGLU: down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

    @nn.compact
    def __call__(self, x):                                        # x [B, T, H]
        c = self.config
        gate = self.linear("gate_proj", c.intermediate_size, c.mlp_bias)(x)
        up = self.linear("up_proj", c.intermediate_size, c.mlp_bias)(x)
        return self.linear("down_proj", c.hidden_size, c.mlp_bias)(nn.silu(gate) * up)


class DecoderLayer(_Projections):
    """x + attn(norm(x)), then + mlp(norm(.)) (pre-normalisation, Touvron et al. 2023)."""

    @nn.compact
    def __call__(self, x, cos, sin):                              # x [B, T, H]
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        fields = dict(config=c, lora=self.lora, **kw)
        h = RMSNorm(c.rms_norm_eps, name="input_layernorm", **kw)(x)
        x = x + Attention(**fields, name="self_attn")(h, cos, sin)
        h = RMSNorm(c.rms_norm_eps, name="post_attention_layernorm", **kw)(x)
        return x + MLP(**fields, name="mlp")(h)


class Llama(nn.Module):
    """The causal LM: ids int32 [B, T] -> logits float32 [B, T, V] at positions 0..T-1.

    ``lora`` adds adapters to its targets, ``dtype`` is the compute dtype (bfloat16 matmuls on
    float32 or bfloat16 parameters), ``remat`` recomputes each layer's activations in the
    backward pass (nn.remat per layer), ``param_dtype`` is the dtype `init` gives the base.
    Right padding needs no mask: a causal position never reads a later one.
    """
    config: LlamaConfig
    lora: Optional[LoraConfig] = None
    dtype: Any = jnp.float32
    remat: bool = False
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, ids):                                      # ids int32 [B, T]
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        embed = nn.Embed(c.vocab_size, c.hidden_size, embedding_init=nn.initializers.normal(
            INIT_STD), name="embed_tokens", **kw)
        x = embed(ids)                                            # [B, T, H]
        cos, sin = rotary_tables(c, ids.shape[1])                 # [T, D] each
        layer = nn.remat(DecoderLayer) if self.remat else DecoderLayer
        for i in range(c.num_hidden_layers):
            x = layer(config=c, lora=self.lora, name=f"layers_{i}", **kw)(x, cos, sin)
        x = RMSNorm(c.rms_norm_eps, name="norm", **kw)(x)
        if c.tie_word_embeddings:
            logits = embed.attend(x)                              # x @ embedding.T
        else:
            logits = Linear(c.vocab_size, name="lm_head", **kw)(x)
        return logits.astype(jnp.float32)                         # [B, T, V]


# --------------------------------------------------------------------------- trees

def flatten(tree: Mapping[str, Any], prefix: Tuple[str, ...] = ()):
    """(path, leaf) of a nested dict, depth first."""
    for name, value in tree.items():
        if isinstance(value, Mapping):
            yield from flatten(value, prefix + (name,))
        else:
            yield prefix + (name,), value


def unflatten(items) -> Params:
    """The nested dict of (path, leaf) pairs."""
    out: Params = {}
    for path, value in items:
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def param_shapes(config: LlamaConfig, lora: Optional[LoraConfig] = None
                 ) -> Dict[Tuple[str, ...], Tuple[int, ...]]:
    """path -> shape of every parameter of Llama(config, lora), from an abstract init (no
    array is allocated, so this is cheap for a billion parameters)."""
    model = Llama(config, lora=lora)
    tree = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
    return {path: tuple(leaf.shape) for path, leaf in flatten(tree["params"])}


def init_adapters(key: jax.Array, config: LlamaConfig, lora: LoraConfig) -> Params:
    """Fresh adapters for a base read from a checkpoint, without initialising the base: the
    lora_A/lora_B leaves of Llama(config, lora)'s tree, A ~ U(-1/sqrt(in), 1/sqrt(in)) (one key
    folded in per projection), B = 0. Merge with the base by merge_params."""
    items = []
    lora_paths = [(p, s) for p, s in param_shapes(config, lora).items() if _is_lora_path(p)]
    for i, (path, shape) in enumerate(lora_paths):
        leaf = (lora_a_init(jax.random.fold_in(key, i), shape) if "lora_A" in path
                else jnp.zeros(shape, jnp.float32))
        items.append((path, leaf))
    return unflatten(items)


# --------------------------------------------------------------------------- trainable/frozen

def _is_lora_path(path: Tuple[str, ...]) -> bool:
    return any(part in LORA_LEAVES for part in path)


def _is_head_path(path: Tuple[str, ...]) -> bool:
    return path[0] == "lm_head"


def _partition(tree: Mapping[str, Any], keep: Callable[[Tuple[str, ...]], bool],
               prefix: Tuple[str, ...] = ()) -> Tuple[Params, Params]:
    """(the leaves whose path `keep` accepts, the others), both nested dicts, empty branches
    dropped."""
    kept, rest = {}, {}
    for name, value in tree.items():
        path = prefix + (name,)
        if isinstance(value, Mapping):
            a, b = _partition(value, keep, path)
            if a:
                kept[name] = a
            if b:
                rest[name] = b
        elif keep(path):
            kept[name] = value
        else:
            rest[name] = value
    return kept, rest


def split_params(params: Mapping[str, Any], finetune: str) -> Tuple[Params, Params]:
    """(trainable, frozen) for ``--finetune``: "lora" trains the lora_A/lora_B leaves only,
    "head" the untied lm_head only, "full" everything (frozen = {}). Same paths as `params`.

    "head" on a model whose head is tied to embed_tokens is refused (training it would train
    the input embedding too); so is "lora" on parameters without adapters."""
    if finetune not in FINETUNE_KINDS:
        raise ConfigError(f"--finetune={finetune} is not one of {', '.join(FINETUNE_KINDS)}")
    if finetune == "full":
        return _partition(params, lambda path: True)[0], {}
    if finetune == "head" and "lm_head" not in params:
        raise ConfigError("--finetune=head needs a separate lm_head, and this model ties its "
                          "head to embed_tokens (tie_word_embeddings); use lora or full")
    trainable, frozen = _partition(params, _is_lora_path if finetune == "lora" else _is_head_path)
    if not trainable:
        raise ConfigError("--finetune=lora on parameters without LoRA adapters (no lora_A/lora_B)")
    return trainable, frozen


def merge_params(trainable: Mapping[str, Any], frozen: Mapping[str, Any]) -> Params:
    """The inverse of split_params: one nested dict with the leaves of both."""
    out = {name: (dict(value) if isinstance(value, Mapping) else value)
           for name, value in frozen.items()}
    for name, value in trainable.items():
        if isinstance(value, Mapping) and isinstance(out.get(name), Mapping):
            out[name] = merge_params(value, out[name])
        elif name in out:
            raise ConfigError(f"merge_params: {name!r} is both trainable and frozen")
        else:
            out[name] = value
    return out
