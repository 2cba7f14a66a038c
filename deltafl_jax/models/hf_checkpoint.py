"""Hugging Face model folders and peft adapters, read and written without torch.

A base model (Touvron et al. 2023's architecture, :mod:`deltafl_jax.models.llama`) is a folder as
transformers' ``save_pretrained`` writes it: ``config.json``, the weights in
``model.safetensors`` or in shards listed by ``model.safetensors.index.json`` (float32, float16
or bfloat16), and ``tokenizer.json`` (the ``tokenizers`` library's format). Tensors are read and
written with ``safetensors``' NumPy API (bfloat16 as ml_dtypes' NumPy type) and renamed to the
Flax tree: ``model.layers.N.self_attn.q_proj.weight`` [out, in] is ``layers_N/self_attn/q_proj/
kernel`` [in, out], ``model.embed_tokens.weight`` is ``embed_tokens/embedding``, ``lm_head.weight``
is ``lm_head/kernel`` transposed (absent when the head is tied).

A LoRA adapter (Hu et al. 2021) is a folder as peft's ``save_pretrained`` writes it:
``adapter_config.json`` (peft_type LORA, r, lora_alpha, target_modules, ...) and
``adapter_model.safetensors`` with ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``
[r, in] and ``...lora_B.weight`` [out, r], so ``PeftModel.from_pretrained`` loads what
:func:`write_peft_adapter` writes. Whatever cannot be used raises
:class:`~deltafl_jax.errors.HFCheckpointError` with one line naming it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from deltafl_jax.errors import HFCheckpointError
from deltafl_jax.models.llama import (LORA_LEAVES, LlamaConfig, LoraConfig, Params, flatten,
                                      lora_targets_matching, param_shapes, unflatten)

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Tensors some checkpoints carry that the model computes itself (old rotary caches).
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# peft settings that change the forward and that this model does not implement: key -> the
# value (or an empty one) it must have. Those of peft 0.10 are written; the later ones only read.
PEFT_DEFAULTS = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none",
                 "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
                 "alpha_pattern": {}}
PEFT_LATER = {"lora_bias": False, "target_parameters": None, "layer_replication": None,
              "exclude_modules": None, "trainable_token_indices": None,
              "alora_invocation_tokens": None, "use_qalora": False, "use_bdlora": None,
              "arrow_config": None, "velora_config": None, "monteclora_config": None,
              "kasa_config": None}


# --------------------------------------------------------------------------- names

def hf_name(path: Tuple[str, ...]) -> str:
    """transformers' name of the tensor at a Flax path: ("layers_3", "mlp", "up_proj", "kernel")
    -> "model.layers.3.mlp.up_proj.weight"; ("lm_head", "kernel") -> "lm_head.weight"."""
    parts = [p.replace("layers_", "layers.", 1) if p.startswith("layers_") else p
             for p in path[:-1]]
    leaf = "bias" if path[-1] == "bias" else "weight"
    return ".".join(parts + [leaf]) if path[0] == "lm_head" else ".".join(["model"] + parts + [leaf])


def to_hf_layout(path: Tuple[str, ...], array: np.ndarray) -> np.ndarray:
    """Flax kernels [in, out] are transformers' weights [out, in] transposed."""
    return array.T if path[-1] == "kernel" else array


# --------------------------------------------------------------------------- base models

def read_config(folder: str) -> LlamaConfig:
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{folder} has no {CONFIG} (not a Hugging Face model folder)")
    try:
        with open(path) as f:
            return LlamaConfig.from_hf(json.load(f))
    except (ValueError, KeyError, TypeError) as err:
        if isinstance(err, HFCheckpointError):
            raise HFCheckpointError(f"{folder}: {err}") from None
        raise HFCheckpointError(f"{path} cannot be read: {type(err).__name__} {err}") from None


def _weight_files(folder: str) -> list:
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.isfile(os.path.join(folder, WEIGHTS)):
        return [WEIGHTS]
    raise HFCheckpointError(f"{folder} has neither {WEIGHTS} nor {INDEX} (.bin weights need torch "
                            f"and are not read)")


def read_tensors(folder: str, files) -> Dict[str, np.ndarray]:
    """name -> array of every tensor in `files` of `folder` (safetensors' NumPy API)."""
    from safetensors import safe_open
    tensors = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise HFCheckpointError(f"{path} is missing")
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def read_checkpoint(folder: str, dtype=None) -> Tuple[LlamaConfig, Params]:
    """(config, params) of a Hugging Face folder; params in the Flax tree of Llama(config) as
    NumPy arrays of the stored dtype (or `dtype`). Missing, unexpected or misshapen tensors raise
    HFCheckpointError naming the first."""
    config = read_config(folder)
    tensors = read_tensors(folder, _weight_files(folder))
    items = []
    for path, shape in param_shapes(config).items():
        name = hf_name(path)
        if name not in tensors:
            raise HFCheckpointError(f"{folder}: tensor {name} is missing")
        stored = tensors.pop(name)
        hf_shape = shape[::-1] if path[-1] == "kernel" else shape
        if tuple(stored.shape) != hf_shape:
            raise HFCheckpointError(f"{folder}: tensor {name} has shape {tuple(stored.shape)}, "
                                    f"config.json implies {hf_shape}")
        array = to_hf_layout(path, stored)   # transposing is its own inverse
        items.append((path, array if dtype is None else array.astype(dtype)))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)   # a tied head saved all the same
    unexpected = sorted(k for k in tensors if not IGNORED.fullmatch(k))
    if unexpected:
        raise HFCheckpointError(f"{folder}: unexpected tensor {unexpected[0]} (another architecture?)")
    return config, unflatten(items)


def write_checkpoint(folder: str, config: LlamaConfig, params: Mapping[str, Any],
                     tokenizer_json_path: Optional[str] = None,
                     max_shard_bytes: Optional[int] = None) -> None:
    """Writes `params` (the Flax tree of Llama(config), no adapters) as a folder transformers
    loads: config.json, model.safetensors (or shards of at most `max_shard_bytes` and their
    index), and tokenizer.json with a tokenizer_config.json when `tokenizer_json_path` is given.
    Everything is checked before anything is written."""
    from safetensors.numpy import save_file
    leaves = dict(flatten(params))
    if any(part in LORA_LEAVES for path in leaves for part in path):
        raise HFCheckpointError("write_checkpoint writes a base model and these parameters hold "
                                "LoRA adapters: write those with write_peft_adapter")
    expected = param_shapes(config)
    for path, shape in expected.items():
        if path not in leaves or tuple(np.shape(leaves[path])) != shape:
            raise HFCheckpointError(f"parameter {'/'.join(path)} is missing or not of shape {shape}")
    if tokenizer_json_path is not None and not os.path.isfile(tokenizer_json_path):
        raise HFCheckpointError(f"tokenizer {tokenizer_json_path} does not exist")
    tensors = {hf_name(p): np.ascontiguousarray(to_hf_layout(p, np.asarray(leaves[p])))
               for p in expected}
    os.makedirs(folder, exist_ok=True)
    hf = config.to_hf()
    hf["torch_dtype"] = str(tensors["model.embed_tokens.weight"].dtype)
    _write_json(os.path.join(folder, CONFIG), hf)
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, os.path.join(folder, WEIGHTS), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, names in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in names}, os.path.join(folder, file),
                      metadata={"format": "pt"})
            weight_map.update({n: file for n in names})
        total = sum(t.nbytes for t in tensors.values())
        _write_json(os.path.join(folder, INDEX), {"metadata": {"total_size": total},
                                                  "weight_map": weight_map})
    if tokenizer_json_path is not None:
        shutil.copyfile(tokenizer_json_path, os.path.join(folder, TOKENIZER))
        _write_json(os.path.join(folder, "tokenizer_config.json"),
                    {"tokenizer_class": "PreTrainedTokenizerFast",
                     "model_max_length": config.max_position_embeddings})


def _shards(tensors: Mapping[str, np.ndarray], max_bytes: Optional[int]) -> list:
    """Names grouped in order into shards of at most `max_bytes` (one tensor may exceed it)."""
    shards: list = [[]]
    size = 0
    for name, array in tensors.items():
        if max_bytes is not None and shards[-1] and size + array.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += array.nbytes
    return shards


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def read_tokenizer(folder: str):
    """The folder's tokenizer.json as a ``tokenizers.Tokenizer``."""
    path = os.path.join(folder, TOKENIZER)
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{folder} has no {TOKENIZER} (a sentencepiece tokenizer.model "
                                f"alone is not read)")
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


def resolve_base_model(spec: str, download: bool) -> str:
    """The local folder of ``--base_model``: a folder as it is; a hub id ("owner/name") fetched
    with huggingface_hub's snapshot_download only when `download` (safetensors, json and
    tokenizer files)."""
    if os.path.isdir(spec):
        return spec
    if not HUB_ID.fullmatch(spec):
        raise HFCheckpointError(f"--base_model={spec} is neither a folder nor a hub id (owner/name)")
    if not download:
        raise HFCheckpointError(f"--base_model={spec}: no such folder; to fetch the hub model "
                                f"{spec}, pass --download")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "tokenizer*"])
    except Exception as err:   # offline, unknown id, gated: one line whatever the cause
        reason = (str(err).strip().splitlines() or [""])[0][:160]
        raise HFCheckpointError(f"--base_model={spec} cannot be downloaded: "
                                f"{type(err).__name__} {reason}") from None


# --------------------------------------------------------------------------- peft adapters

def adapter_leaves(params: Mapping[str, Any]) -> Dict[Tuple[str, ...], Any]:
    """path -> array of the lora_A/lora_B kernels in `params` (adapters or a whole tree)."""
    return {path: leaf for path, leaf in flatten(params)
            if any(part in LORA_LEAVES for part in path)}


def write_peft_adapter(folder: str, lora_config: LoraConfig, adapters: Mapping[str, Any],
                       base_model_name_or_path: Optional[str] = None) -> None:
    """Writes the adapters (the lora_A/lora_B leaves of a Llama's params) as peft's
    adapter_config.json and adapter_model.safetensors (float32, [r, in] and [out, r])."""
    from safetensors.numpy import save_file
    leaves = adapter_leaves(adapters)
    if not leaves:
        raise HFCheckpointError("write_peft_adapter: the parameters hold no lora_A/lora_B")
    tensors = {PEFT_PREFIX + hf_name(path): np.ascontiguousarray(np.asarray(leaf, np.float32).T)
               for path, leaf in leaves.items()}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    _write_json(os.path.join(folder, ADAPTER_CONFIG), dict(
        PEFT_DEFAULTS, peft_type="LORA", task_type="CAUSAL_LM", r=lora_config.rank,
        lora_alpha=lora_config.alpha, lora_dropout=lora_config.dropout,
        target_modules=list(lora_config.targets), init_lora_weights=True, inference_mode=True,
        base_model_name_or_path=base_model_name_or_path, revision=None, layers_pattern=None))


def read_peft_config(folder: str) -> LoraConfig:
    """The LoraConfig of peft's adapter_config.json; settings this model does not implement
    (DoRA, rsLoRA, per-module ranks, ...) are refused by name."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{folder} has no {ADAPTER_CONFIG} (not a peft adapter)")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise HFCheckpointError(f"{path}: peft_type {cfg['peft_type']} is not supported (LORA only)")
    for key, default in {**PEFT_DEFAULTS, **PEFT_LATER}.items():
        if cfg.get(key) and cfg[key] != default:   # None, False, {} and [] are all "off"
            raise HFCheckpointError(f"{path}: {key}={cfg[key]!r} is not supported")
    targets = cfg.get("target_modules") or ()
    targets = [targets] if isinstance(targets, str) else list(targets)
    return LoraConfig(rank=int(cfg["r"]), alpha=float(cfg.get("lora_alpha", 8)),
                      targets=tuple(targets), dropout=float(cfg.get("lora_dropout", 0.0)))


def read_peft_adapter(folder: str, config: Optional[LlamaConfig] = None) -> Tuple[LoraConfig, Params]:
    """(LoraConfig, adapters) of a peft folder; adapters is the nested dict of lora_A/lora_B
    kernels in the Flax tree ([in, r], [r, out]), to merge with the base's params. With the
    base's `config`, every targeted projection of every layer must be there, of its shape."""
    lora = read_peft_config(folder)      # its targets checked and in the layer's order
    names = lora_targets_matching(config, lora.targets)
    tensors = read_tensors(folder, [ADAPTER_WEIGHTS])
    wanted = ({p: s for p, s in param_shapes(config, lora).items()
               if any(part in LORA_LEAVES for part in p)} if config is not None else None)
    items = []
    for key, array in tensors.items():
        path = _adapter_path(key)
        if path is None or path[-3] not in names or (wanted is not None and path not in wanted):
            raise HFCheckpointError(f"{folder}: adapter tensor {key} matches no targeted layer")
        if wanted is not None and tuple(array.T.shape) != wanted[path]:
            raise HFCheckpointError(f"{folder}: adapter tensor {key} has shape {array.shape}")
        items.append((path, np.asarray(array.T, np.float32)))
    if wanted is not None and len(items) != len(wanted):
        missing = sorted(set(wanted) - {p for p, _ in items})[0]
        raise HFCheckpointError(f"{folder}: adapter tensor {PEFT_PREFIX + hf_name(missing)} is missing")
    return lora, unflatten(items)


def _adapter_path(key: str) -> Optional[Tuple[str, ...]]:
    """("layers_N", block, proj, "lora_A"|"lora_B", "kernel") of a peft key, else None."""
    match = re.fullmatch(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                         r"(lora_A|lora_B)(?:\.default)?\.weight", key)
    if match is None:
        return None
    layer, block, proj, leaf = match.groups()
    return (f"layers_{layer}", block, proj, leaf, "kernel")
