r"""pfl-research's federated LoRA fine-tuning of a causal language model (its LLM benchmark,
``benchmarks/llm``), driven round by round over stdin/stdout for ``bench/peer_pfl_llm.py``.

Run with the python of a virtual environment that holds ``pfl`` 0.6, PyTorch, ``transformers``
and ``peft`` (``.venv-pfl``); it imports neither deltafl_jax nor the rest of bench/ (only its
sibling ``peer_common``, standard library).

    <pfl venv>/bin/python bench/peer_pfl_llm_worker.py --write_checkpoint=DIR --config=JSON
    <pfl venv>/bin/python bench/peer_pfl_llm_worker.py --checkpoint=DIR --data=NPZ --cohort=10

``--write_checkpoint``: a Llama of random weights (``transformers.LlamaForCausalLM`` built from
the ``config.json`` given, its own initialisation, torch seed 0) saved in Hugging Face's format
(``config.json`` + ``model.safetensors``), the checkpoint both sides of the bench load.

Otherwise the worker assembles what pfl-research's ``benchmarks/llm/train.py`` assembles, with
the settings of its ``configs/aya.yaml`` unless a flag says otherwise:

- the model: ``AutoModelForCausalLM.from_pretrained(checkpoint)`` wrapped by
  ``peft.get_peft_model`` with ``LoraConfig(task_type="CAUSAL_LM", r, lora_alpha, lora_dropout=0,
  target_modules=None)`` (peft's default targets for Llama: ``q_proj`` and ``v_proj``; the
  benchmark's ``--lora_alpha`` defaults to 8), given a ``loss(**batch)`` that returns the
  Hugging Face model's own loss (the mean token cross-entropy of ``labels``, shifted inside)
  and a ``metrics(**batch)`` (never called: no round evaluates);
- ``PyTorchModel`` with ``torch.optim.SGD`` as the local optimizer and, as the central one,
  ``torch.optim.Adam`` over the trainable (LoRA) parameters at the central learning rate with
  ``eps`` = the benchmark's ``adaptivity_degree`` 1e-4 and ``betas=(0.9, 0.99)``;
  ``amp_dtype`` (the benchmark's bfloat16 autocast; ``float32`` here by default, the engine's
  base dtype on CPU) and ``use_torch_compile`` (``--torch_compile``) as the benchmark passes them;
- ``SimulatedBackend`` with no postprocessor (no DP: the benchmark's privacy mechanisms are
  ``none``); ``FederatedAveraging().run`` with ``NNTrainHyperParams(local_learning_rate,
  local_num_epochs=1, local_batch_size, local_max_grad_norm)``.

The users' data are the token sequences of ``--data`` (an ``.npz`` with ``ids`` [N, L] int32,
the users' rows one after another, ``client_size`` rows each), each user a
``pfl.data.pytorch.PyTorchTensorDataset`` of ``{"input_ids": ids, "labels": ids}`` (every token scored: the
sequences have no padding). The benchmark's datasets pad every sequence to 512 and store the
mask under the key ``attention_masks``, which the model's ``forward`` does not take, so its
steps run without an attention mask too. The central learning-rate schedule (cosine, 50
warm-up rounds) and the central evaluation are left out: neither changes a round's work.

Protocol (``peer_common.serve``): ``READY <json>`` (versions, torch threads, parameter counts,
FLOPs of one training step per example counted by ``torch.utils.flop_counter``, torch's
float32 GEMM rate, the median of a bare local step), then per ``round T`` a federated round and
``DONE <json>`` with its seconds (from the end of the previous round's callback to the end of
this round's ``after_central_iteration``: pfl's whole round) and the sequences trained.
"""

from __future__ import annotations

import argparse
import json
import time

from peer_common import pfl_round_callback, serve

PACKAGES = ("pfl", "torch", "transformers", "peft", "numpy")


def write_checkpoint(folder: str, config_path: str, seed: int) -> None:
    """A random Llama of `config_path`'s shapes in Hugging Face's format in `folder`."""
    import torch
    import transformers

    with open(config_path) as f:
        cfg = transformers.LlamaConfig(**json.load(f))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(folder, safe_serialization=True)


def build_model(args):
    """The benchmark's model: the checkpoint with LoRA adapters, and a ``loss(**batch)``."""
    import types

    import peft
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint,
                                                           torch_dtype="float32")
    lora = peft.LoraConfig(task_type="CAUSAL_LM", r=args.lora_rank, lora_alpha=args.lora_alpha,
                           lora_dropout=0.0, target_modules=None)
    model = peft.get_peft_model(hf, lora)
    model.examples = 0   # sequences through loss(): the round's training work

    def loss(self, input_ids, labels):
        self.examples += len(input_ids)
        return self.forward(input_ids=input_ids, labels=labels, return_dict=True)["loss"]

    def metrics(self, input_ids, labels):
        from pfl.metrics import Weighted
        with torch.no_grad():
            value = self.forward(input_ids=input_ids, labels=labels, return_dict=True)["loss"]
        return {"loss": Weighted.from_unweighted(float(value))}

    model.loss = types.MethodType(loss, model)
    model.metrics = types.MethodType(metrics, model)   # pfl's PyTorchModel asks for both
    return model


def train_step_flops(model, batch) -> float:
    """FLOPs of one local step's forward and backward pass per sequence
    (``torch.utils.flop_counter.FlopCounterMode``: its matrix products), counted with the
    attention written as matrix products (``attn_implementation="eager"``: the counter has no
    formula for the CPU kernel of ``scaled_dot_product_attention``, which it would count as
    zero), then the model's own attention back."""
    from torch.utils.flop_counter import FlopCounterMode

    base = model.get_base_model()
    own = base.config._attn_implementation   # pylint: disable=protected-access
    base.set_attn_implementation("eager")
    try:
        with FlopCounterMode(display=False) as counter:
            model.loss(**batch).backward()
    finally:
        base.set_attn_implementation(own)
    model.zero_grad()
    model.examples = 0
    return counter.get_total_flops() / len(batch["input_ids"])


def local_step_seconds(model, batch, lr: float, clip: float, repeats: int = 10) -> float:
    """Median seconds of one bare local step (forward, backward, clip, SGD) outside pfl."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=lr)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        opt.zero_grad()
        model.loss(**batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        times.append(time.perf_counter() - t0)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    model.examples = 0
    times = sorted(times[2:])
    return times[len(times) // 2]


def gemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """torch's float32 n x n GEMM rate (best of `repeats`)."""
    import torch
    a = torch.ones(n, n)
    torch.mm(a, a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def federated_data(args):
    """One ``PyTorchTensorDataset`` of {"input_ids", "labels"} per user (the class that the
    benchmark's ``PyTorchFederatedDataset`` wraps around a user's collated tensors), users
    drawn at random."""
    import numpy as np
    import torch
    from pfl.data import FederatedDataset
    from pfl.data.pytorch import PyTorchTensorDataset
    from pfl.data.sampling import get_user_sampler

    ids = torch.from_numpy(np.load(args.data)["ids"].astype(np.int64))   # [N, L]
    k = args.client_size
    users = list(range(ids.shape[0] // k))

    def make(u):
        rows = ids[u * k:(u + 1) * k]
        return PyTorchTensorDataset({"input_ids": rows, "labels": rows}, user_id=u)

    return FederatedDataset(make, get_user_sampler("random", users)), ids[:args.batch_size]


def run(args):
    import numpy as np
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    model = build_model(args)
    data, first = federated_data(args)
    batch = {"input_ids": first, "labels": first}
    trainable = [p for p in model.parameters() if p.requires_grad]
    extra = {"torch_threads": torch.get_num_threads(),
             "parameters": sum(p.numel() for p in model.parameters()),
             "trainable_parameters": sum(p.numel() for p in trainable),
             "train_flops_per_example": train_step_flops(model, batch),
             "torch_gemm_gflops": gemm_gflops(),
             "torch_step_s": local_step_seconds(model, batch, args.learning_rate, args.clip),
             "amp_dtype": args.amp_dtype, "torch_compile": args.torch_compile,
             "attn_implementation": model.get_base_model().config._attn_implementation}
    central = torch.optim.Adam(trainable, args.central_lr, eps=args.adaptivity_degree,
                               betas=(0.9, 0.99))
    pfl_model = PyTorchModel(model=model, local_optimizer_create=torch.optim.SGD,
                             central_optimizer=central,
                             amp_dtype=getattr(torch, args.amp_dtype),
                             use_torch_compile=args.torch_compile)
    backend = SimulatedBackend(training_data=data, val_data=None, postprocessors=[])
    commands = serve(PACKAGES, extra)
    first_cmd = next(commands, None)
    if first_cmd is None or first_cmd[0] != "round":
        return
    rounds = pfl_round_callback(model, commands, first_cmd[1])
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=args.max_rounds, evaluation_frequency=args.max_rounds + 1,
            train_cohort_size=args.cohort, val_cohort_size=0),
        backend=backend, model=pfl_model,
        model_train_params=NNTrainHyperParams(local_learning_rate=args.learning_rate,
                                              local_num_epochs=1,
                                              local_batch_size=args.batch_size,
                                              local_max_grad_norm=args.clip or None),
        model_eval_params=NNEvalHyperParams(local_batch_size=args.batch_size),
        callbacks=[rounds])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write_checkpoint", default=None, help="write a random checkpoint here")
    ap.add_argument("--config", default=None, help="--write_checkpoint: its config.json")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--client_size", type=int, default=8)
    ap.add_argument("--cohort", type=int, default=10)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--learning_rate", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="local_max_grad_norm (0: none)")
    ap.add_argument("--central_lr", type=float, default=0.01)
    ap.add_argument("--adaptivity_degree", type=float, default=1e-4)
    ap.add_argument("--lora_rank", type=int, default=8)
    ap.add_argument("--lora_alpha", type=int, default=8)
    ap.add_argument("--amp_dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--torch_compile", type=int, default=0)
    ap.add_argument("--max_rounds", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch_threads", type=int, default=0, help="0: torch's default")
    args = ap.parse_args()
    if args.write_checkpoint:
        write_checkpoint(args.write_checkpoint, args.config, args.seed)
    else:
        run(args)


if __name__ == "__main__":
    main()
