r"""The engine against pfl-research on federated LoRA fine-tuning of a small Llama, round by
round (issue 52, item 5: the CPU part).

    python -m bench.peer_pfl_llm --pfl_python=.venv-pfl/bin/python [--rounds=5] [--warmup=1]
        [--engines=default,devices=1] [--checkpoint=FOLDER]
        [--out=bench/results/peer_pfl_llm_cpu.json]

The configuration is pfl-research's LLM benchmark (``benchmarks/llm/configs/aya.yaml``) at the
issue's CPU size: LoRA rank 8 on the query and value projections (peft's default for Llama,
alpha 8 as the benchmark's ``--lora_alpha`` default), FedAvg with a cohort of 10 users, one
local epoch of batch 4 at local learning rate 0.1 (pfl's local steps clip the gradient at norm
1.0, ``local_max_grad_norm``), central Adam at 0.01 (betas 0.9, 0.99; eps 1e-4, the benchmark's
``adaptivity_degree``), no DP, the base in ``--dtype`` (float32 by default on the CPU; the
benchmark's bfloat16 autocast with ``--dtype=bfloat16``: the engine's ``--base_dtype``, pfl's
``amp_dtype``). Both sides load the same checkpoint and train the same users'
token sequences:

- the checkpoint: ``--checkpoint`` (a Hugging Face folder with ``tokenizer.json``, e.g. the
  Shakespeare base of ``experiments.pretrain``), or by default a Llama of random weights of
  ``--vocab``, ``--hidden``, ``--layers``, ``--heads``, ``--kv_heads``, ``--intermediate``
  written in Hugging Face's format by :func:`deltafl_jax.models.hf_checkpoint.write_checkpoint`
  (``config.json``, ``model.safetensors``) with a word-level ``tokenizer.json`` (token i is the
  word ``t<i>``, BOS first as a Llama tokenizer adds it);
- the users: a ``.jsonl`` of ``--num_clients`` users (column ``user``) with
  ``--sequences_per_client`` documents each (column ``text``) of random tokens, longer than
  ``--seq_len``; the engine reads it as a user would, ``--dataset=text:FILE
  --client_column=user --max_length=seq_len + 1`` (half the users are its training clients),
  and writes its training clients' sequences for pfl: the first ``seq_len`` tokens of each, as
  ``input_ids`` and ``labels``. So both sides put ``seq_len`` tokens of the same sequences
  through the network (the engine scores all ``seq_len`` next tokens, pfl ``seq_len - 1``).

Sides, each a process of its own that runs one round per request (``peer_common.serve``):

- ``pfl`` (``pfl_compile`` with ``--pfl_compile=0,1``, ``pfl_threads1`` with
  ``--pfl_threads=0,1``: torch on one thread): ``bench/peer_pfl_llm_worker.py`` in the python
  of ``--pfl_python`` (pfl 0.6, torch, transformers, peft), pfl's own simulation as its LLM
  benchmark assembles it (see that file);
- ``engine_<entry>``: ``experiments.run``'s flags (:func:`user_flags`, printed in the JSON's
  ``engine_command_lines``) through :func:`experiments.cli.config_from_flags` and
  :func:`deltafl_jax.build_experiment`, plus each entry of ``--engines`` (``default``: no
  placement flag, so one host device per core as the command line does; ``devices=1``; flags
  joined by ``+``). A round is timed from the host's plan to the new adapters on the host.

Rounds alternate as in ``bench/peer_pfl.py``: in round t every side runs its round t, in an
order that rotates every round; ``os.getloadavg()`` is recorded around each. The figure per
side is the median of ``--rounds`` rounds after ``--warmup``; ``speedup_vs_pfl`` divides the
medians, ``speedup_vs_pfl_paired`` is the median over rounds of the two sides' ratio.

Work per round, counted on both sides: the FLOPs of one local step per sequence times the
sequences trained. pfl's is PyTorch's ``FlopCounterMode`` on a step of its peft model (matrix
products and attention); the engine's the matrix products of the jaxpr of its loss's gradient
with respect to the adapters (:func:`bench.common.jaxpr_matmul_flops`). The two counts must
agree within ``FLOP_TOLERANCE`` (the script exits 2 after writing the JSON when they do not).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

flags.DEFINE_string("pfl_python", None, "python of a venv holding pfl, torch, transformers "
                    "and peft (empty: time the engine only)")
flags.DEFINE_list("pfl_compile", ["0"], "one pfl side per entry (and --pfl_threads entry): 1 "
                  "with torch.compile (the benchmark's aya.yaml sets use_torch_compile), 0 eager")
flags.DEFINE_list("pfl_threads", ["0"], "one pfl side per entry (and --pfl_compile entry), "
                  "torch on that many threads (0: torch's default, one per core)")
flags.DEFINE_list("engines", ["default"], "engine configurations: 'default' or flag=value "
                  "joined by '+'")
flags.DEFINE_integer("rounds", 5, "timed rounds (median reported)")
flags.DEFINE_integer("warmup", 1, "untimed rounds first (compilation)")
flags.DEFINE_string("checkpoint", "", "a Hugging Face folder with tokenizer.json (empty: a "
                    "random Llama of the shapes below)")
flags.DEFINE_integer("vocab", 2048, "random checkpoint: vocabulary")
flags.DEFINE_integer("hidden", 256, "random checkpoint: hidden size")
flags.DEFINE_integer("layers", 4, "random checkpoint: decoder layers")
flags.DEFINE_integer("heads", 8, "random checkpoint: attention heads")
flags.DEFINE_integer("kv_heads", 4, "random checkpoint: key/value heads")
flags.DEFINE_integer("intermediate", 688, "random checkpoint: MLP width")
flags.DEFINE_integer("seq_len", 128, "tokens of a sequence through the network")
flags.DEFINE_integer("num_clients", 40, "users in the file (half train the engine's rounds)")
flags.DEFINE_integer("sequences_per_client", 8, "documents per user")
flags.DEFINE_integer("cohort", 10, "users trained per round")
flags.DEFINE_integer("local_batch", 4, "local minibatch size")
flags.DEFINE_float("local_lr", 0.1, "local learning rate")
flags.DEFINE_float("local_clip", 1.0, "pfl: local_max_grad_norm (0: none)")
flags.DEFINE_float("central_lr", 0.01, "central Adam's learning rate")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "the frozen base's compute "
                  "dtype: the engine's --base_dtype, pfl's amp_dtype (autocast; the benchmark's "
                  "aya.yaml: bfloat16)")
flags.DEFINE_integer("rank", 8, "LoRA rank")
flags.DEFINE_integer("alpha", 8, "LoRA alpha")
flags.DEFINE_string("out", None, "write the JSON here (default the git-ignored "
                    "bench/out/peer_pfl_llm_<backend>.json)")
flags.DEFINE_enum("role", "bench", ["bench", "engine"], "internal: 'engine' is one engine side")
flags.DEFINE_string("engine_flags", "", "internal: the engine side's entry of --engines")
flags.DEFINE_string("workdir", "", "internal: the folder of the checkpoint, users and ids")
FLAGS = flags.FLAGS

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FLOP_TOLERANCE = 0.02    # the two sides' counts of one step's FLOPs
SPECIALS = ("<unk>", "<s>", "</s>")   # ids 0, 1, 2 of the random checkpoint's tokenizer
IDS_FILE = "pfl_ids.npz"


def engine_settings(entry: str) -> dict:
    """'devices=1+clients_per_step=2' -> {'devices': '1', 'clients_per_step': '2'}; 'default'
    -> {}."""
    out = {}
    for part in ([] if entry in ("", "default") else entry.split("+")):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise app.UsageError(f"--engines: {part!r} is not flag=value")
        out[name] = value
    return out


def user_flags(workdir: str, checkpoint: str, entry: str = "default") -> list:
    """The command line of ``experiments.run`` that trains the engine's side."""
    base = {"model": "llama", "dataset": f"text:{os.path.join(workdir, 'users.jsonl')}",
            "text_column": "text", "client_column": "user", "base_model": checkpoint,
            "max_length": FLAGS.seq_len + 1, "finetune": "lora", "lora_rank": FLAGS.rank,
            "lora_alpha": FLAGS.alpha, "lora_targets": "q_proj,v_proj", "algorithm": "fedavg",
            "clients_per_round": FLAGS.cohort, "batch_size": FLAGS.local_batch,
            "local_epochs": 1, "learning_rate": FLAGS.local_lr, "server_optimizer": "adam",
            "server_lr": FLAGS.central_lr, "server_beta1": 0.9, "server_beta2": 0.99,
            "server_eps": 1e-4, "num_rounds": 10000, "seeds": 1,
            "base_dtype": FLAGS.dtype, "data_dir": os.path.join(workdir, "data"),
            "output_dir": "", "save_models": "false"}
    return [f"--{k}={v}" for k, v in {**base, **engine_settings(entry)}.items()]


# ----------------------------------------------------------------------------- inputs


def write_random_checkpoint(folder: str) -> None:
    """A Llama of random weights in Hugging Face's format, with a word-level tokenizer."""
    import jax
    import jax.numpy as jnp
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from deltafl_jax.models import hf_checkpoint, llama

    config = llama.LlamaConfig(
        vocab_size=FLAGS.vocab, hidden_size=FLAGS.hidden, intermediate_size=FLAGS.intermediate,
        num_hidden_layers=FLAGS.layers, num_attention_heads=FLAGS.heads,
        num_key_value_heads=FLAGS.kv_heads, max_position_embeddings=max(2048, FLAGS.seq_len + 1),
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    params = llama.Llama(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    vocab = {w: i for i, w in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), FLAGS.vocab)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "tokenizer.json")
        tok.save(path)
        hf_checkpoint.write_checkpoint(folder, config, jax.device_get(params["params"]),
                                       tokenizer_json_path=path)


def write_users(path: str, checkpoint: str) -> None:
    """--num_clients users of --sequences_per_client documents of random tokens, each longer
    than --seq_len + 1 tokens (so every sequence is whole: no padding)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for u in range(FLAGS.num_clients):
            for _ in range(FLAGS.sequences_per_client):
                ids = rng.integers(len(SPECIALS), vocab, 2 * FLAGS.seq_len + 4)
                text = tok.decode([int(i) for i in ids])
                f.write(json.dumps({"user": f"u{u:04d}", "text": text}) + "\n")


# ----------------------------------------------------------------------------- engine side


def engine_config(line: list):
    """The experiment configuration of the command line `line` (experiments.run's flags)."""
    from experiments import cli
    cli.define_experiment_flags()
    FLAGS.unparse_flags()
    FLAGS(["engine", *line])
    return cli.config_from_flags()


def step_flops(model, params, x) -> float:
    """Matrix-product FLOPs of the mean loss's gradient with respect to the adapters on the
    batch x, per sequence (:func:`bench.common.jaxpr_matmul_flops`)."""
    import jax
    import jax.numpy as jnp

    from bench.common import jaxpr_matmul_flops

    loss = lambda p: jnp.mean(model.losses(p, x, None))   # noqa: E731
    return jaxpr_matmul_flops(jax.make_jaxpr(jax.grad(loss))(params).jaxpr) / x.shape[0]


def write_pfl_ids(data, path: str, length: int) -> dict:
    """The training clients' sequences as pfl's users get them (the first `length` tokens,
    clients one after another, the same count each): what was written."""
    from deltafl_jax.datasets.text import decode
    train = data.train
    xs = [np.asarray(train.client(k)[0]) for k in range(train.num_clients)]
    sizes = {len(x) for x in xs}
    if len(sizes) != 1:
        raise RuntimeError(f"the training clients have different counts of sequences: {sizes}")
    ids, scored = decode(np.concatenate(xs))
    if not scored.all():
        raise RuntimeError("a sequence is padded: make the documents longer than --seq_len")
    np.savez(path, ids=ids[:, :length].astype(np.int32))
    return {"clients": len(xs), "client_size": sizes.pop(), "seq_len": int(length)}


def engine_side() -> None:
    """One engine configuration, serving rounds on stdin (peer_common.serve)."""
    import jax

    from bench.common import gemm_peak_gflops
    from bench.peer_common import serve
    from deltafl_jax import build_experiment
    from deltafl_jax.datasets import load_dataset

    entry, workdir, checkpoint = FLAGS.engine_flags, FLAGS.workdir, FLAGS.checkpoint
    line, length = user_flags(workdir, checkpoint, entry), FLAGS.seq_len
    config = engine_config(line)   # resets this script's flags: read them before
    data = load_dataset(config.data)
    exp = build_experiment(config, data)
    written = write_pfl_ids(data, os.path.join(workdir, IDS_FILE), length)
    state, keys = exp.initial_state(), exp.keys()
    x = np.asarray(data.train.client(0)[0])[:config.training.batch_size]
    params = exp.model.init(jax.random.key(0))
    extra = {"placement": vars(exp.placement), "jax_devices": jax.local_device_count(),
             "command_line": " ".join(line), "users_for_pfl": written,
             "parameters": int(sum(np.size(a) for a in jax.tree.leaves(exp.model.frozen)))
             + int(sum(np.size(a) for a in jax.tree.leaves(params))),
             "trainable_parameters": int(sum(np.size(a) for a in jax.tree.leaves(params))),
             "train_flops_per_example": step_flops(exp.model, params, x),
             "jax_gemm_gflops": gemm_peak_gflops(2048)}
    for _, t, _ in serve(("jax", "jaxlib", "flax", "numpy"), extra):
        t0, c0 = time.perf_counter(), time.process_time()
        rd = exp.round_data(t)
        t1 = time.perf_counter()
        state, met = exp.round_fn(state, rd, keys)
        met = jax.device_get(met)
        print("DONE " + json.dumps({"round": t, "seconds": time.perf_counter() - t0,
                                    "host_plan_s": t1 - t0,
                                    "cpu_s": time.process_time() - c0,
                                    "real_examples": int(np.sum(met["train_real_examples"]))}),
              flush=True)


# ----------------------------------------------------------------------------- the bench


def start_sides(workdir: str, checkpoint: str) -> dict:
    """The engine sides first (the first writes the users' ids for pfl), then the pfl ones."""
    from bench.peer_common import Side
    from deltafl_jax.engine.mesh import HOST_DEVICES_FLAG, default_host_devices

    sides = {}
    for entry in FLAGS.engines:
        devices = engine_settings(entry).get("devices", default_host_devices())
        env = dict(os.environ)   # this side's host devices, as the command line sets them
        kept = [f for f in env.get("XLA_FLAGS", "").split()
                if not f.startswith(HOST_DEVICES_FLAG)]
        env["XLA_FLAGS"] = " ".join(kept + [f"{HOST_DEVICES_FLAG}={int(devices)}"])
        sides[f"engine_{entry}"] = Side(
            [sys.executable, "-m", "bench.peer_pfl_llm", "--role=engine",
             f"--engine_flags={entry}", f"--workdir={workdir}", f"--checkpoint={checkpoint}",
             *(f"--{k}={getattr(FLAGS, k)}" for k in
               ("seq_len", "cohort", "local_batch", "local_lr", "central_lr", "dtype", "rank",
                "alpha"))],
            env, cwd=REPO)
    if FLAGS.pfl_python:
        users = next(iter(sides.values())).info["users_for_pfl"]
        for compiled, threads in itertools.product(
                (int(c) for c in FLAGS.pfl_compile), [int(n) for n in FLAGS.pfl_threads]):
            name = "pfl" + ("_compile" if compiled else "") + (
                f"_threads{threads}" if threads else "")
            sides[name] = Side(
                [FLAGS.pfl_python, os.path.join(HERE, "peer_pfl_llm_worker.py"),
                 f"--checkpoint={checkpoint}", f"--data={os.path.join(workdir, IDS_FILE)}",
                 f"--client_size={users['client_size']}", f"--cohort={FLAGS.cohort}",
                 f"--batch_size={FLAGS.local_batch}", f"--learning_rate={FLAGS.local_lr}",
                 f"--clip={FLAGS.local_clip}", f"--central_lr={FLAGS.central_lr}",
                 f"--lora_rank={FLAGS.rank}", f"--lora_alpha={FLAGS.alpha}",
                 f"--amp_dtype={FLAGS.dtype}", f"--torch_compile={compiled}",
                 f"--torch_threads={threads}"], cwd=REPO)
    return sides


def summarise(sides: dict, times: dict) -> dict:
    """s/round, sequences, GFLOP per round and GFLOP/s per side; the ratios against pfl."""
    med = {k: float(np.median(v)) for k, v in times.items()}
    rows = {}
    for name, side in sides.items():
        timed = side.rounds[FLAGS.warmup:]
        examples = float(np.mean([r["real_examples"] for r in timed]))
        gflop = side.info["train_flops_per_example"] * examples / 1e9
        rows[name] = {"s_per_round": med[name], "round_times_s": times[name],
                      "train_sequences_per_round": examples, "gflop_per_round": gflop,
                      "gflops": gflop / med[name],
                      "cpu_s_median": float(np.median([r["cpu_s"] for r in timed])),
                      "cores_busy_median": float(np.median([r["cpu_s"] / r["seconds"]
                                                            for r in timed])),
                      "info": side.info}
    pfl = [k for k in med if k.startswith("pfl")]
    pairs = [(p, k) for p in pfl for k in med if k.startswith("engine")]
    return {"sides": rows, "s_per_round": med,
            "speedup_vs_pfl": {f"{p}_over_{k}": med[p] / med[k] for p, k in pairs},
            "speedup_vs_pfl_paired": {f"{p}_over_{k}": float(np.median(
                np.divide(times[p], times[k]))) for p, k in pairs}}


def flop_check(rows: dict) -> list:
    """The sides' counts of one step's FLOPs per sequence must agree."""
    counts = {k: r["info"]["train_flops_per_example"] for k, r in rows.items()}
    lo, hi = min(counts.values()), max(counts.values())
    if hi > lo * (1 + FLOP_TOLERANCE):
        return [f"the sides count different FLOPs per training sequence: {counts}"]
    return []


def uptime() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def settings() -> dict:
    return {"cohort": FLAGS.cohort, "local_epochs": 1, "local_batch": FLAGS.local_batch,
            "local_lr": FLAGS.local_lr, "pfl_local_max_grad_norm": FLAGS.local_clip,
            "central_optimizer": "adam", "central_lr": FLAGS.central_lr,
            "central_betas": [0.9, 0.99], "central_eps": 1e-4, "lora_rank": FLAGS.rank,
            "lora_alpha": FLAGS.alpha, "lora_targets": ["q_proj", "v_proj"],
            "seq_len": FLAGS.seq_len, "num_clients_in_file": FLAGS.num_clients,
            "sequences_per_client": FLAGS.sequences_per_client, "dtype": FLAGS.dtype,
            "checkpoint": FLAGS.checkpoint or {
                "random": True, "vocab": FLAGS.vocab, "hidden": FLAGS.hidden,
                "layers": FLAGS.layers, "heads": FLAGS.heads, "kv_heads": FLAGS.kv_heads,
                "intermediate": FLAGS.intermediate},
            "rounds_timed": FLAGS.rounds, "warmup": FLAGS.warmup}


def bench() -> None:
    from bench.common import backend_name, emit, machine
    from bench.peer_common import alternate

    if FLAGS.rounds < 1 or FLAGS.warmup < 0:
        raise app.UsageError("--rounds must be >= 1 and --warmup >= 0")
    if FLAGS.pfl_python and not os.path.exists(FLAGS.pfl_python):
        raise app.UsageError(f"--pfl_python={FLAGS.pfl_python} does not exist")
    if FLAGS.checkpoint and not os.path.isfile(os.path.join(FLAGS.checkpoint, "tokenizer.json")):
        raise app.UsageError(f"--checkpoint={FLAGS.checkpoint}: no tokenizer.json there")
    for entry in FLAGS.engines:
        engine_settings(entry)
    result = {"benchmark": "peer_pfl_llm", "machine": machine(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "uptime_start": uptime(), "configuration": settings()}
    with tempfile.TemporaryDirectory(prefix="peer_pfl_llm_") as workdir:
        checkpoint = os.path.abspath(FLAGS.checkpoint) if FLAGS.checkpoint else os.path.join(
            workdir, "checkpoint")
        if not FLAGS.checkpoint:
            write_random_checkpoint(checkpoint)
        write_users(os.path.join(workdir, "users.jsonl"), checkpoint)
        sides = start_sides(workdir, checkpoint)
        try:
            times, loads = alternate(sides, FLAGS.warmup, FLAGS.rounds)
        finally:
            for side in sides.values():
                side.close()
    result["engine_command_lines"] = {k: s.info["command_line"] for k, s in sides.items()
                                      if k.startswith("engine")}
    result.update(summarise(sides, times))
    result["load"] = loads
    result["load1_mean"] = float(np.mean([r["load1_before"] for r in loads]))
    result["uptime_end"] = uptime()
    emit(result, FLAGS.out, name=f"peer_pfl_llm_{backend_name()}")
    bad = flop_check(result["sides"])
    if bad:
        print("; ".join(bad), file=sys.stderr)
        sys.exit(2)


def main(argv):
    del argv
    if FLAGS.role == "engine":
        engine_side()
    else:
        bench()


if __name__ == "__main__":
    app.run(main)
