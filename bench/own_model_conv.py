r"""A user's own CNN written with Flax's ``nn.Conv`` against the same network built in.

    python -m bench.own_model_conv [--rounds=5] [--clients=10] [--examples=50] [--with_xla]
        [--with_im2col_wgrad] [--out=bench/results/own_model_conv_cpu.json]

The network is pfl-research's CIFAR-10 benchmark CNN (conv 3x3-32 VALID + ReLU, conv 3x3-64
VALID + ReLU, max-pool 2, dense 128 + ReLU, dense 10; 1,626,442 parameters), timed two ways
in one process, a Delta-FL round (theta = 0.5, one local epoch, batch 10) of each in turn:

- ``own_model``: the ``# my_cifar_cnn.py`` block of docs/guides/own-model.md, as written
  (``nn.Conv``, ``nn.max_pool``, ``nn.Dense``, default lanes), imported from a file as
  ``--model_module`` imports it and trained with ``--model=cifar_cnn`` and the default
  ``--conv_impl`` (on CPU ``winograd``, a registered convolutional model's): its
  convolutions, pooling and dense products take the built-in networks' fast paths by
  interception (:mod:`deltafl_jax.models.conv_intercept`);
- ``builtin``: ``--model=pfl_cnn`` (:mod:`deltafl_jax.models.image`), the tuned built-in
  network (the same fast convolutions, pooling by reshape, unrolled lanes);
- ``own_model_im2col_wgrad`` (with ``--with_im2col_wgrad``): the guide's network with
  ``--conv_impl=im2col_wgrad``, its CPU default before 2026-11-27;
- ``own_model_xla`` (with ``--with_xla``): the guide's network with ``--conv_impl=xla``,
  Flax's convolutions as they are (slow: about 30x).

The data are CIFAR-shaped random images (speed does not depend on the pixels): ``--clients``
training clients of ``--examples`` images each, all sampled every round, and two test clients.
Each figure is the median of ``--rounds`` timed rounds after the first (compile) round, and
the ratio own_model / builtin is given both as the ratio of the medians and as the median of
the ratios of the rounds run back to back (the steadier of the two on a shared machine); the
load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

import numpy as np

from bench.common import CompileTimer, cifar_like_dataset, emit, machine, median

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                     "guides", "own-model.md")
BLOCK = "# my_cifar_cnn.py"
PARAMS = 1_626_442


def guide_block(path: str = GUIDE, first_line: str = BLOCK) -> str:
    """The guide's Python block that starts with `first_line`."""
    text = open(path).read()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (block,) = [b for b in blocks if b.startswith(first_line)]
    return block


def register_guide_model() -> None:
    """Write the guide's block to a file and import it as ``--model_module`` does."""
    from deltafl_jax.models import MODELS
    if "cifar_cnn" in MODELS:
        return
    path = os.path.join(tempfile.mkdtemp(prefix="own_model_conv_"), "my_cifar_cnn.py")
    with open(path, "w") as f:
        f.write(guide_block())
    spec = importlib.util.spec_from_file_location("bench_my_cifar_cnn", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


VARIANTS = {"own_model": ("cifar_cnn", None), "builtin": ("pfl_cnn", None),
            "own_model_im2col_wgrad": ("cifar_cnn", "im2col_wgrad"),
            "own_model_xla": ("cifar_cnn", "xla")}


def build(variant: str, data, args):
    import jax
    from deltafl_jax import DataConfig, ExperimentConfig, build_experiment
    model, conv_impl = VARIANTS[variant]
    cfg = ExperimentConfig(
        data=DataConfig("cifar_like"), model=model, conv_impl=conv_impl, thetas=(0.5,),
        seeds=(1,), num_rounds=args.rounds + 1, clients_per_round=args.clients,
        batch_size=10, learning_rate=0.05, output_dir=None, save_models=False, verbose=False)
    exp = build_experiment(cfg, data)
    params = jax.eval_shape(exp.model.init, jax.random.key(0))
    count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    if count != PARAMS:
        raise SystemExit(f"{variant}: {count} parameters, expected {PARAMS}")
    return exp


class Runner:
    """One variant's experiment and state, one round at a time."""

    def __init__(self, variant, data, args):
        self.variant, self.exp = variant, build(variant, data, args)
        self.state, self.keys, self.t = self.exp.initial_state(), self.exp.keys(), 0
        self.times = []

    def round(self) -> float:
        import jax
        t0 = time.perf_counter()
        self.state, met = self.exp.round_fn(self.state, self.exp.round_data(self.t), self.keys)
        jax.block_until_ready((self.state, met))
        self.t += 1
        return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--examples", type=int, default=50)
    p.add_argument("--with_xla", action="store_true")
    p.add_argument("--with_im2col_wgrad", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    register_guide_model()
    load_before = os.getloadavg()
    data = cifar_like_dataset(a.clients, a.examples)
    names = (["own_model", "builtin"] + (["own_model_im2col_wgrad"] if a.with_im2col_wgrad else [])
             + (["own_model_xla"] if a.with_xla else []))
    runners = {n: Runner(n, data, a) for n in names}
    first = {}
    for n, r in runners.items():
        with CompileTimer() as timer:
            first[n] = {"first_round_s": r.round(), "compile_s": timer.seconds}
    for _ in range(a.rounds):
        for r in runners.values():
            r.times.append(r.round())
    from deltafl_jax.models import default_conv_impl
    rows = {n: {"model": VARIANTS[n][0],
                "conv_impl": (r.exp.model.conv_impl
                              or default_conv_impl(preferences=r.exp.model.lanes)),
                "lanes": r.exp.placement.lanes, "lane_mode": r.exp.placement.lane_mode,
                "s_per_round": median(r.times), "round_times_s": r.times, **first[n]}
            for n, r in runners.items()}
    ratio = rows["own_model"]["s_per_round"] / rows["builtin"]["s_per_round"]
    paired = [a / b for a, b in zip(runners["own_model"].times, runners["builtin"].times)]
    result = {"benchmark": "own_model_conv", "machine": machine(),
              "date": time.strftime("%Y-%m-%d"), "load_average_before": load_before,
              "load_average_after": os.getloadavg(),
              "setup": {"clients_per_round": a.clients, "examples_per_client": a.examples,
                        "batch_size": 10, "local_epochs": 1, "theta": 0.5,
                        "parameters": PARAMS, "timed_rounds": a.rounds},
              "variants": rows, "own_model_over_builtin": ratio,
              "own_model_over_builtin_by_round": paired,
              "own_model_over_builtin_paired_median": median(paired)}
    summary = [f"{n}: {r['s_per_round']:.3f} s/round ({r['lanes']} {r['lane_mode']} lanes, "
               f"compile {r['compile_s']:.1f} s)" for n, r in rows.items()]
    summary.append(f"own_model / builtin: {ratio:.2f} (medians), {median(paired):.2f} (median "
                   f"of the rounds' ratios)")
    summary.append(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    emit(result, a.out, summary=summary)


if __name__ == "__main__":
    main()
