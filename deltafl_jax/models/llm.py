"""A pretrained causal language model as the engine's model: ``--model=llama``.

The network is :class:`deltafl_jax.models.llama.Llama` (Hugging Face's Llama architecture),
built from the checkpoint of ``--base_model`` (:func:`deltafl_jax.models.hf_checkpoint.
read_checkpoint`) that tokenised ``--dataset=text:PATH`` (its folder is the dataset's
``metadata["base_model"]``). ``--finetune`` chooses what is trained
(:func:`deltafl_jax.models.llama.split_params`):

- ``lora`` (default): low-rank adapters W + (alpha / r) B A on ``--lora_targets`` (Hu et al.
  2021, "LoRA", Eq. 3; peft's conventions: A as nn.Linear's init, B = 0, so the first forward
  equals the base's);
- ``head``: the output projection lm_head only;
- ``full``: every weight.

The model the engine sees, and so every algorithm (FedAvg, Delta-FL, the baselines, the server
optimizers, Ditto's personal models, FedAU, MIFA, FedBuff, client-level DP), is the trainable
part alone: :meth:`LLMModel.init` gives it and :meth:`LLMModel.apply` merges it with the frozen
rest, which the model holds (closed over by the jitted round: one copy per device, shared by
every lane and replica, never aggregated, clipped or noised). ``--base_dtype=bfloat16`` keeps
that frozen part in bfloat16; the trainable part, its optimizer state and the aggregation stay
float32.

The loss (``loss_kind="custom"``, :func:`masked_token_losses`) of one sequence is the mean
next-token cross-entropy over its scored targets (:mod:`deltafl_jax.datasets.text`: padding
and an instruction's prompt are not scored), its error the share of wrong argmax predictions
among them. A client's perplexity is exp of its mean loss
(:func:`deltafl_jax.evaluation.metrics.perplexity_summaries`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.data import FederatedDataset
from deltafl_jax.datasets.text import decode, first_id
from deltafl_jax.declared import Bounds, setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.models.model import Model, ModelOptions

FINETUNE = ("lora", "full", "head")
BASE_DTYPES = ("float32", "bfloat16")


def _names(name: str, values) -> Tuple[str, ...]:
    """A list flag of names (``--lora_targets=q_proj,v_proj``) as a tuple of strings."""
    del name
    values = values.split(",") if isinstance(values, str) else values
    return tuple(str(v).strip() for v in values if str(v).strip())


@dataclasses.dataclass(frozen=True)
class LLMSettings:
    """What of a pretrained language model is fine-tuned and how it is held
    (``config.llm``; ``--model=llama``).

    Attributes:
      finetune: lora | full | head (the module docstring).
      lora_rank, lora_alpha: the adapters' rank r and scale alpha (the update is alpha / r B A).
      lora_targets: the projections that get adapters (peft's default for Llama: q_proj,
        v_proj).
      base_dtype: the frozen part's dtype (float32 | bfloat16).
      remat: recompute each layer's activations in the backward pass (less memory).
    """

    finetune: str = setting("lora", "--model=llama: what is trained: lora (low-rank adapters on "
                            "--lora_targets; the base frozen) | head (lm_head only) | full",
                            choices=FINETUNE)
    lora_rank: int = setting(8, "--finetune=lora: the adapters' rank r",
                             bounds=Bounds(1, float("inf"), integer=True))
    lora_alpha: float = setting(16.0, "--finetune=lora: the adapters' scale alpha (the update "
                                "is alpha / r B A; peft's lora_alpha)",
                                bounds=Bounds(0.0, float("inf"), low_open=True))
    lora_targets: Tuple[str, ...] = setting(
        ("q_proj", "v_proj"), "--finetune=lora: the projections that get adapters, among q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (all-linear: all seven)",
        kind="list", parse=_names)
    base_dtype: str = setting("float32", "--model=llama: dtype of the frozen base (bfloat16: "
                              "half the memory; the trained part stays float32)",
                              choices=BASE_DTYPES)
    remat: bool = setting(False, "--model=llama: recompute each layer's activations in the "
                          "backward pass (less memory, more compute)")

    def __post_init__(self):
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))

    def check(self) -> None:
        """ConfigError naming the flag of a bad setting."""
        if self.finetune not in FINETUNE:
            raise ConfigError(f"--finetune must be one of {', '.join(FINETUNE)}, got "
                              f"{self.finetune!r}")
        if self.base_dtype not in BASE_DTYPES:
            raise ConfigError(f"--base_dtype must be one of {', '.join(BASE_DTYPES)}, got "
                              f"{self.base_dtype!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or \
                self.lora_rank < 1:
            raise ConfigError(f"--lora_rank must be an integer >= 1, got {self.lora_rank!r}")
        if not np.isfinite(self.lora_alpha) or self.lora_alpha <= 0:
            raise ConfigError(f"--lora_alpha must be positive, got {self.lora_alpha!r}")
        if self.finetune == "lora" and not self.lora_targets:
            raise ConfigError("--lora_targets must name at least one projection")
        if self.finetune == "full" and self.base_dtype != "float32":
            raise ConfigError("--base_dtype=bfloat16 holds the frozen base; with --finetune=full "
                              "nothing is frozen (every weight trains in float32)")


def masked_token_losses(logits, x, y=None):
    """Per-sequence (loss [B], error [B]) of next-token scores `logits` [B, L-1, V] on stored
    sequences x [B, L] (:func:`deltafl_jax.datasets.text.decode`): the mean cross-entropy of
    the scored targets ids[:, 1:], and the share of them whose argmax is wrong (0 for a
    sequence without a scored target)."""
    del y
    ids, scored = decode(x)
    targets = ids[:, 1:].astype(jnp.int32)                         # [B, L-1]
    kept = scored[:, 1:]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    count = jnp.maximum(kept.sum(axis=1), 1).astype(jnp.float32)
    loss = jnp.where(kept, nll, 0.0).sum(axis=1) / count
    wrong = (jnp.argmax(logits, axis=-1) != targets) & kept
    return loss, wrong.sum(axis=1).astype(jnp.float32) / count


@dataclasses.dataclass(frozen=True)
class LLMModel(Model):
    """:class:`Model` whose parameters are the trainable part of a pretrained network; the
    frozen part (a nested dict of arrays, {} with ``--finetune=full``) is merged in by
    :meth:`apply`. `initial` gives the trainable part's initial value from a key;
    `settings` and `base_model` say what was built, for the peft export and generation."""

    frozen: Any = dataclasses.field(default=None, compare=False, repr=False)
    initial: Optional[Callable] = dataclasses.field(default=None, compare=False, repr=False)
    settings: LLMSettings = LLMSettings()
    base_model: str = ""
    perplexity: bool = True    # the evaluation reports per-client perplexity

    def init(self, key):
        return self.initial(key)

    def merged(self, params):
        """The whole network's parameters: `params` merged with the frozen part."""
        from deltafl_jax.models import llama
        return llama.merge_params(params, self.frozen)

    def logits(self, params, ids):
        """Next-token scores [B, T, V] (float32) of token ids [B, T]."""
        return self.module.apply({"params": self.merged(params)}, jnp.asarray(ids, jnp.int32))

    def apply(self, params, x):
        """Scores [B, L-1, V] of the targets ids[:, 1:] from ids[:, :-1] of stored x [B, L]."""
        ids, _ = decode(jnp.asarray(x))
        return self.logits(params, ids[:, :-1])

    def export(self, folder: str, params) -> None:
        """Write the adapters `params` in peft's format into `folder` (``--finetune=lora``;
        nothing otherwise)."""
        if self.settings.finetune != "lora":
            return
        from deltafl_jax.models import hf_checkpoint
        hf_checkpoint.write_peft_adapter(folder, self.module.lora, jax.device_get(params),
                                         self.base_model)


def _lora_config(settings: LLMSettings, config):
    from deltafl_jax.models import llama
    if settings.finetune != "lora":
        return None
    try:
        llama.lora_targets_matching(config, settings.lora_targets)
    except ValueError as e:   # the model's errors are DeltaFLErrors, ValueErrors
        raise ConfigError(f"--lora_targets: {e}") from None
    return llama.LoraConfig(rank=settings.lora_rank, alpha=float(settings.lora_alpha),
                            targets=tuple(settings.lora_targets))


_CHECKPOINTS: Dict[str, Any] = {}   # folder -> (config, params): one read per process


def _checkpoint(folder: str):
    from deltafl_jax.models import hf_checkpoint
    if folder not in _CHECKPOINTS:
        _CHECKPOINTS.clear()     # one base at a time
        _CHECKPOINTS[folder] = hf_checkpoint.read_checkpoint(folder)
    return _CHECKPOINTS[folder]


def _parts(module, base, settings: LLMSettings, length: int):
    """(frozen, initial): the frozen part as device arrays of the base dtype, and key ->
    the trainable part (the checkpoint's weights, or with LoRA fresh adapters: A from the
    key, B = 0)."""
    from deltafl_jax.models import llama
    base = jax.tree.map(jnp.asarray, base)
    if settings.finetune == "lora":
        dummy = jnp.zeros((1, length), jnp.int32)
        adapters = jax.jit(lambda key: llama.split_params(
            module.init(key, dummy)["params"], "lora")[0])
        frozen, initial = base, adapters   # the checkpoint has no adapters: all of it frozen
    else:
        trainable, frozen = llama.split_params(base, settings.finetune)
        trainable = jax.tree.map(lambda a: a.astype(jnp.float32), trainable)
        initial = lambda key: trainable   # noqa: E731  (the checkpoint's weights)
    dtype = jnp.bfloat16 if settings.base_dtype == "bfloat16" else jnp.float32
    frozen = jax.tree.map(lambda a: a.astype(dtype), frozen)
    return frozen, initial


def llama_model(data: FederatedDataset, options: ModelOptions) -> Model:
    """``--model=llama``: the base of ``--dataset=text:PATH`` fine-tuned per ``options.llm``
    (:class:`LLMSettings`). ValueError for data that are not a text dataset."""
    from deltafl_jax.models import llama
    meta = data.metadata or {}
    if meta.get("task") != "causal_lm":
        raise ValueError(f"model 'llama' fine-tunes a pretrained base on token sequences: use "
                         f"--dataset=text:PATH with --base_model=FOLDER, not {data.name}")
    settings = getattr(options, "llm", None) or LLMSettings()
    settings.check()
    config, base = _checkpoint(str(meta["base_model"]))
    lora = _lora_config(settings, config)
    bf16 = "bfloat16" in (settings.base_dtype, getattr(options, "compute_dtype", "float32"))
    dtype = jnp.bfloat16 if bf16 else jnp.float32   # the products' (--compute_dtype)
    module = llama.Llama(config=config, lora=lora, dtype=dtype, remat=bool(settings.remat))
    length = int(data.feature_shape[0]) - 1
    frozen, initial = _parts(module, base, settings, length)
    return LLMModel("llama", module, "custom", tuple(data.feature_shape), np.int32,
                    loss_fn=masked_token_losses, error_rate=True, conv_impl="xla",
                    frozen=frozen, initial=initial, settings=settings,
                    base_model=str(meta["base_model"]))


# ----------------------------------------------------------------------------- serving


def sequence_losses(model: LLMModel, params, x) -> np.ndarray:
    """[B] the mean token loss of each stored sequence x [B, L] (its perplexity: exp)."""
    return np.asarray(model.losses(params, jnp.asarray(x), None))


def generate(model: LLMModel, params, prompt_ids: List[int], max_new_tokens: int,
             eos_id: Optional[int] = None) -> List[int]:
    """Greedy decoding: the prompt's ids followed by up to `max_new_tokens` argmax tokens
    (stopping after `eos_id`), each step one forward pass over the sequence so far (no key
    and value cache; a demonstration, not a server)."""
    limit = int(model.module.config.max_position_embeddings)
    ids = list(prompt_ids)
    forward = jax.jit(model.logits)
    for _ in range(int(max_new_tokens)):
        if len(ids) >= limit:
            break
        scores = forward(params, jnp.asarray([ids], jnp.int32))[0, -1]
        token = int(jnp.argmax(scores))
        ids.append(token)
        if eos_id is not None and token == eos_id:
            break
    return ids


def check_run(model: str, dataset: str, text, settings: LLMSettings) -> None:
    """ConfigError, before any data are read or written: a text dataset without
    ``--model=llama`` or the reverse, and (for a local ``--base_model``) a folder without
    config.json or tokenizer.json, an architecture that is not Llama's, ``--max_length``
    beyond its positions, or a LoRA target that matches no layer. A hub id to download is
    checked once it is here (:func:`llama_model`)."""
    is_text = dataset.startswith("text:")
    if is_text != (model == "llama"):
        raise ConfigError("--model=llama fine-tunes a pretrained base on --dataset=text:PATH, "
                          "and a text dataset's token sequences are for --model=llama"
                          if is_text else f"--model=llama needs --dataset=text:PATH, got "
                          f"--dataset={dataset}")
    if not text.base_model:
        raise ConfigError("--model=llama needs --base_model=FOLDER (a Hugging Face checkpoint "
                          "folder, or a hub id with --download_base_model)")
    if not os.path.isdir(text.base_model):
        if text.download_base_model:
            return
        raise ConfigError(f"--base_model={text.base_model}: no such folder (a Hugging Face hub "
                          f"id is downloaded with --download_base_model only)")
    config = _base_config(text.base_model)
    if text.max_length > int(config.max_position_embeddings):
        raise ConfigError(f"--max_length={text.max_length}: sequences longer than the "
                          f"{config.max_position_embeddings} positions of --base_model="
                          f"{text.base_model}")
    _lora_config(settings, config)


def _base_config(folder: str):
    """The LlamaConfig of a checkpoint folder (ConfigError without config.json or
    tokenizer.json, or for an unsupported architecture, named)."""
    from deltafl_jax.models import llama
    for name in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(folder, name)):
            raise ConfigError(f"--base_model={folder}: no {name} there (a Hugging Face "
                              f"checkpoint folder has config.json, model.safetensors and "
                              f"tokenizer.json)")
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return llama.LlamaConfig.from_hf(json.load(f))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--base_model={folder}: {str(e).splitlines()[0] if str(e) else e!r}"
                          ) from None


def tokenizer_of(model: LLMModel):
    """The base's tokenizer (its tokenizer.json)."""
    from deltafl_jax.models import hf_checkpoint
    return hf_checkpoint.read_tokenizer(model.base_model)


def tokenised(model: LLMModel, texts: List[str], length: int) -> np.ndarray:
    """Stored sequences [n, length] of `texts` (:func:`deltafl_jax.datasets.text.sequences`:
    BOS as the tokenizer adds it, each text ended by EOS, truncated, padded), every token
    scored."""
    from deltafl_jax.datasets.text import sequences
    tok, c = tokenizer_of(model), model.module.config
    eos, pad = first_id(c.eos_token_id), first_id(c.pad_token_id)
    end = [] if eos is None else [eos]
    docs = [(ids, [True] * len(ids)) for ids in (tok.encode(t).ids + end for t in texts)]
    return sequences(docs, length, pad if pad is not None else (eos or 0), pack=False)
