"""Tiny Hugging Face folders and text files for the language-model tests (written by the tests,
nothing downloaded): a byte-level BPE tokenizer trained here, a config.json, and with
:func:`tiny_base` random Llama weights written by :mod:`deltafl_jax.models.hf_checkpoint`."""

import json
import os

import numpy as np

WORDS = ("the king is dead long live the queen and all her court sings of the sea "
         "where ships sail in the morning light").split()
SPECIALS = ("<s>", "</s>", "<pad>")   # ids 0, 1, 2


def sentences(n, seed=0, lo=3, hi=12):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi)))) for _ in range(n)]


def train_tokenizer(folder, vocab_size=120):
    """tokenizer.json of a byte-level BPE trained on WORDS (BOS <s> added before a text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(sentences(200) + [" ".join(WORDS)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return tok


def config_dict(vocab_size, positions=64, **changes):
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "vocab_size": vocab_size, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": positions, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
          "pad_token_id": 2, "hidden_act": "silu", "torch_dtype": "float32"}
    hf.update(changes)
    return hf


def tokenizer_folder(folder, positions=64, **changes):
    """A folder with tokenizer.json and config.json (no weights): enough to tokenise."""
    tok = train_tokenizer(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_dict(tok.get_vocab_size(), positions, **changes), f)
    return tok


def tiny_base(folder, positions=64, seed=0, **changes):
    """A whole checkpoint folder: tokenizer, config and random weights (float32)."""
    import jax
    import jax.numpy as jnp
    from deltafl_jax.models import hf_checkpoint, llama
    tok = train_tokenizer(folder + "_tok")
    config = llama.LlamaConfig.from_hf(config_dict(tok.get_vocab_size(), positions, **changes))
    params = llama.Llama(config).init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
    hf_checkpoint.write_checkpoint(folder, config, jax.tree.map(np.asarray, params),
                                   tokenizer_json_path=os.path.join(folder + "_tok",
                                                                    "tokenizer.json"))
    return tok


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def user_rows(users=6, per_user=4, seed=0):
    texts = sentences(users * per_user, seed)
    return [{"user": f"u{i // per_user}", "text": t} for i, t in enumerate(texts)]
