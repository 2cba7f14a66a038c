"""--model=llama (deltafl_jax/models/llm.py): a pretrained base fine-tuned with LoRA as the
engine's model. The adapters are the parameters every algorithm sees, the base is closed over;
with B = 0 the first forward equals the base's (Llama without adapters on the checkpoint);
the masked token loss against NumPy; the peft export read back; the one-line refusals.
Slow (CI's second step): FedAvg equals Delta-FL at theta = 1 bit for bit and serves
perplexity equal to the evaluation's, Ditto / DP / FedBuff run, the bad inputs of the command
(exit 2, nothing written), resume after SIGKILL bit for bit, 1 and 2 devices agree."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltafl_jax import DataConfig, ExperimentConfig
from deltafl_jax.data import ClientData, FederatedDataset
from deltafl_jax.errors import ConfigError
from deltafl_jax.models import ModelOptions, build_model, hf_checkpoint, llama
from deltafl_jax.models.llm import LLMSettings, masked_token_losses
from deltafl_jax.datasets.text import encode
from llm_fixtures import config_dict, tiny_base, user_rows, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTH = 12


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llm") / "base")
    tiny_base(folder)
    return folder


def _data(folder, length=LENGTH, seed=0):
    """A FederatedDataset of random stored sequences as the text loader gives them."""
    config, _ = hf_checkpoint.read_checkpoint(folder)
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, config.vocab_size, size=(6, length))
    x = encode(ids, rng.random((6, length)) < 0.8)
    split = ClientData(x=x, y=None, offsets=np.array([0, 3, 6]), client_ids=np.array([0, 1]))
    meta = {"task": "causal_lm", "base_model": folder, "input_vocab_size": config.vocab_size}
    return FederatedDataset(name="text:rows", train=split, test=split,
                            num_classes=config.vocab_size, x_scale=None, metadata=meta)


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _paths(v, prefix + (k,))]
    return [prefix]


def test_lora_params_are_adapters_and_first_forward_equals_base(base):
    data = _data(base)
    model = build_model("llama", data, ModelOptions(llm=LLMSettings(lora_rank=4)))
    params = model.init(jax.random.key(3))
    paths = _paths(params)
    assert paths and all(p[-2] in ("lora_A", "lora_B") for p in paths)
    assert {p[-3] for p in paths} == {"q_proj", "v_proj"}
    config, weights = hf_checkpoint.read_checkpoint(base)
    ids = jnp.asarray(np.abs(data.train.x) % config.vocab_size)   # any tokens
    got = model.logits(params, ids)
    want = llama.Llama(config).apply({"params": weights}, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # A is drawn (not zero) and B is zero: peft's init
    a = params["layers_0"]["self_attn"]["q_proj"]["lora_A"]["kernel"]
    b = params["layers_0"]["self_attn"]["q_proj"]["lora_B"]["kernel"]
    assert a.shape == (config.hidden_size, 4) and np.abs(np.asarray(a)).max() > 0
    assert not np.asarray(b).any()


def test_bfloat16_base_keeps_adapters_float32(base):
    model = build_model("llama", _data(base), ModelOptions(llm=LLMSettings(base_dtype="bfloat16")))
    params = model.init(jax.random.key(0))
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    assert {a.dtype for a in jax.tree.leaves(model.frozen)} == {jnp.dtype(jnp.bfloat16)}
    loss = model.losses(params, jnp.asarray(_data(base).train.x), None)
    assert loss.shape == (6,) and bool(jnp.all(jnp.isfinite(loss)))


def test_masked_token_losses_against_numpy():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 7, size=(3, 5))
    scored = rng.random((3, 5)) < 0.6
    scored[2, 1:] = False                                   # a sequence without a target
    logits = rng.normal(size=(3, 4, 7)).astype(np.float32)
    loss, err = masked_token_losses(jnp.asarray(logits), jnp.asarray(encode(ids, scored)))
    for b in range(3):
        nll, wrong = [], []
        for t in range(4):
            if scored[b, t + 1]:
                z = logits[b, t].astype(np.float64)
                logp = z - np.log(np.exp(z - z.max()).sum()) - z.max()
                nll.append(-logp[ids[b, t + 1]])
                wrong.append(np.argmax(z) != ids[b, t + 1])
        np.testing.assert_allclose(loss[b], np.mean(nll) if nll else 0.0, rtol=1e-5)
        np.testing.assert_allclose(err[b], np.mean(wrong) if wrong else 0.0, rtol=1e-6)


def test_peft_export_reads_back(base, tmp_path):
    model = build_model("llama", _data(base), ModelOptions(llm=LLMSettings(lora_rank=2)))
    params = jax.tree.map(lambda a: a + 0.5, model.init(jax.random.key(1)))   # B != 0
    model.export(str(tmp_path / "peft"), params)
    lora, adapters = hf_checkpoint.read_peft_adapter(str(tmp_path / "peft"))
    assert (lora.rank, lora.alpha, tuple(lora.targets)) == (2, 16.0, ("q_proj", "v_proj"))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 adapters, jax.device_get(params))


def _checkpoint_variant(base, tmp_path, case):
    folder = str(tmp_path / case)
    shutil.copytree(base, folder)
    if case == "no_config":
        os.remove(os.path.join(folder, "config.json"))
    elif case == "no_tokenizer":
        os.remove(os.path.join(folder, "tokenizer.json"))
    elif case == "architecture":
        with open(os.path.join(folder, "config.json")) as f:
            hf = json.load(f)
        hf.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(hf, f)
    return folder


BAD = {"no_config": ({}, "no config.json"), "no_tokenizer": ({}, "no tokenizer.json"),
       "architecture": ({}, "gpt2"), "lora_target": ({"lora_targets": ("qkv",)}, "'qkv'"),
       "too_long": ({"max_length": 65}, "--max_length=65"),
       "not_text": ({"dataset": "synthetic"}, "--model=llama needs --dataset=text:PATH")}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_base_refused_by_the_configuration(base, tmp_path, case):
    folder = _checkpoint_variant(base, tmp_path, case)
    settings, want = BAD[case]
    settings = dict(settings)
    data = DataConfig(settings.pop("dataset", f"text:{tmp_path}/rows.jsonl"), base_model=folder,
                      client_column="user", max_length=settings.pop("max_length", LENGTH))
    with pytest.raises(ConfigError) as err:
        ExperimentConfig(data, model="llama", algorithm="fedavg", output_dir=str(tmp_path / "o"),
                         **settings)
    assert want in str(err.value) and "\n" not in str(err.value), str(err.value)


# ----------------------------------------------------------------------------- runs (slow)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return write_jsonl(str(tmp_path_factory.mktemp("rows") / "rows.jsonl"),
                       user_rows(users=8, per_user=4))


def _flags(base, rows, out, *extra):
    return [sys.executable, "-m", "experiments.run", f"--dataset=text:{rows}",
            f"--base_model={base}", "--client_column=user", f"--max_length={LENGTH}",
            "--model=llama", "--lora_rank=2", "--num_rounds=4", "--clients_per_round=2",
            "--local_steps=2", "--batch_size=2", "--learning_rate=0.5", "--eval_every=2",
            # one device unless a test asks for more: on an overloaded CPU, XLA's cross-device
            # all-reduce between its host threads can exceed its 40 s rendezvous and abort
            "--devices=1", f"--output_dir={out}", *extra]


def _run(base, rows, out, *extra, env=None):
    proc = subprocess.run(_flags(base, rows, out, *extra), cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _models(out):
    index = json.load(open(os.path.join(out, "models", "index.json")))
    return [flax.serialization.msgpack_restore(
        open(os.path.join(out, "models", e["file"]), "rb").read()) for e in index["replicas"]]


@pytest.mark.slow
def test_fedavg_equals_deltafl_at_theta_one_and_serves(base, rows, tmp_path):
    out = str(tmp_path / "runs")
    _run(base, rows, out, "--algorithm=fedavg,deltafl", "--thetas=1.0")
    a, b = _models(os.path.join(out, "fedavg")), _models(os.path.join(out, "deltafl"))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert any(np.asarray(leaf).any() for leaf in jax.tree.leaves(
        [v for k, v in _flat(a[0]).items() if "lora_B" in k]))     # B has moved
    from deltafl_jax import load_model
    served = load_model(os.path.join(out, "fedavg"))
    run = os.path.join(out, "fedavg")
    assert os.path.isfile(os.path.join(run, "models", "theta=1_seed=1.peft",
                                       "adapter_model.safetensors"))
    with np.load(os.path.join(run, "clients.npz")) as z:
        losses, ids = z["test_loss"][0], z["test_client_ids"]
    from deltafl_jax.datasets import load_dataset
    data = load_dataset(DataConfig(f"text:{rows}", base_model=base, client_column="user",
                                   max_length=LENGTH))
    for k, cid in enumerate(data.test.client_ids):
        assert str(ids[k]) == str(cid)
        np.testing.assert_allclose(served.perplexity(data.test.client(k)[0]),
                                   np.exp(losses[k]), rtol=1e-4)
    summary = json.load(open(os.path.join(run, "summary.json")))["final"]["theta=1_seed=1"]
    np.testing.assert_allclose(summary["test_ppl_mean"], np.exp(losses).mean(), rtol=1e-9)
    text = served.generate("the king", max_new_tokens=5)
    assert isinstance(text, str) and text.startswith("the king")


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k2: v2 for k, v in tree.items() for k2, v2 in _flat(v, f"{prefix}/{k}").items()}
    return {prefix: tree}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ditto", "dp", "fedbuff"])
def test_algorithms_run_on_the_adapters(base, rows, tmp_path, algorithm):
    extra = {"ditto": ["--algorithm=ditto", "--ditto_lambda=0.5"],
             "dp": ["--algorithm=fedavg", "--dp_clip=0.5", "--dp_noise_multiplier=0.1",
                    "--server_lr=1.0", "--weighting=unweighted"],
             "fedbuff": ["--algorithm=fedbuff", "--concurrency=3", "--buffer_size=2",
                         "--client_speed=lognormal"]}[algorithm]
    out = str(tmp_path / algorithm)
    _run(base, rows, out, *extra)
    (params,) = _models(out)[:1]
    keys = _flat(params)
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys)
    assert all(np.all(np.isfinite(np.asarray(v))) for v in keys.values())
    if algorithm == "ditto":
        index = json.load(open(os.path.join(out, "models", "index.json")))
        assert "personal_file" in index["replicas"][0]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no_config", "no_tokenizer", "architecture", "lora_target",
                                  "too_long", "client_column"])
def test_bad_input_one_line_exit_2_nothing_written(base, rows, tmp_path, case):
    folder = _checkpoint_variant(base, tmp_path, case)
    extra = {"lora_target": ["--lora_targets=qkv"], "too_long": ["--max_length=65"],
             "client_column": ["--client_column=speaker"]}.get(case, [])
    out = str(tmp_path / "out")
    env = dict(os.environ, DELTAFL_DATA=str(tmp_path / "cache"))
    proc = subprocess.run(_flags(folder, rows, out, "--algorithm=fedavg", *extra), cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert not os.path.exists(out) and not os.path.exists(tmp_path / "cache")


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_identical(base, rows, tmp_path):
    from test_resume import assert_same_outputs, saved_rounds
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    extra = ("--algorithm=deltafl", "--thetas=1.0,0.5", "--num_rounds=6", "--checkpoint_every=1")
    _run(base, rows, whole, *extra)
    proc = subprocess.Popen(_flags(base, rows, cut, *extra), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if saved_rounds(cut) and max(saved_rounds(cut)) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    again = _run(base, rows, cut, *extra)
    assert "resum" in (again.stdout + again.stderr).lower()
    assert_same_outputs(whole, cut)


@pytest.mark.slow
def test_one_and_two_devices_agree(base, rows, tmp_path):
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                      " --xla_force_host_platform_device_count=2"))
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    extra = ("--algorithm=deltafl", "--thetas=0.5", "--clients_per_round=4")
    _run(base, rows, one, *extra, "--devices=1", env=env)
    _run(base, rows, two, *extra, "--devices=2", env=env)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 _models(one), _models(two))
    with np.load(os.path.join(one, "clients.npz")) as a, np.load(os.path.join(two,
                                                                             "clients.npz")) as b:
        np.testing.assert_allclose(a["test_loss"], b["test_loss"], rtol=1e-5)


@pytest.mark.slow
def test_pretrain_writes_a_checkpoint_of_the_other_plays(tmp_path):
    """experiments.pretrain with its flagfile, shrunk: a folder that read_checkpoint loads and
    whose Llama gives the logits of the trained parameters; roles.jsonl holds only the plays of
    the other genres; transformers loads it where installed."""
    out = str(tmp_path / "base")
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.pretrain",
         "--flagfile=experiments/pretrain_shakespeare.flags", f"--output_dir={out}",
         "--vocab_size=300", "--hidden_size=16", "--intermediate_size=32", "--num_layers=1",
         "--max_length=32", "--steps=3", "--batch_size=2"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config, params = hf_checkpoint.read_checkpoint(out)
    assert (config.vocab_size, config.hidden_size, config.max_position_embeddings) == (300, 16, 32)
    rows = [json.loads(l) for l in open(os.path.join(out, "roles.jsonl"))]
    genres = {r["play"].split("/")[0] for r in rows}
    assert rows and not genres & {"histories", "problems"}
    summary = json.load(open(os.path.join(out, "pretrain.json")))
    assert summary["client_roles"] == len(rows) and np.isfinite(summary["losses"]["held_out"])
    ids = np.array([hf_checkpoint.read_tokenizer(out).encode(rows[0]["text"][:80]).ids])
    ours = np.asarray(llama.Llama(config).apply({"params": params}, jnp.asarray(ids)))
    torch = pytest.importorskip("torch", reason="the llm-ref extra compares with transformers")
    transformers = pytest.importorskip("transformers", reason="the llm-ref extra")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = ref(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_perplexity_summaries_by_hand():
    """exp of each client's loss; the mean, the lower p90 (the 9th smallest of 10) and the worst
    10% (of 10 clients: the largest) of each population; train_loss (with its L2) left out."""
    from deltafl_jax.evaluation.metrics import perplexity_summaries
    rng = np.random.default_rng(0)
    loss = rng.uniform(1.0, 5.0, size=(2, 10))
    out = perplexity_summaries({"test_loss": loss, "seen_ft3_loss": loss[::-1],
                                "train_loss": loss, "test_error": loss})
    assert sorted(out) == sorted(f"{p}_ppl_{s}" for p in ("test", "seen_ft3")
                                 for s in ("mean", "p90", "worst10"))
    for r in range(2):
        ppl = np.sort(np.exp(loss[r]))
        np.testing.assert_allclose(out["test_ppl_mean"][r], ppl.mean(), rtol=1e-12)
        np.testing.assert_allclose(out["test_ppl_p90"][r], ppl[8], rtol=1e-6)
        np.testing.assert_allclose(out["test_ppl_worst10"][r], ppl[9], rtol=1e-12)
        np.testing.assert_allclose(out["seen_ft3_ppl_worst10"][1 - r], ppl[9], rtol=1e-12)
