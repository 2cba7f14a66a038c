r"""The paper's workloads as one benchmark: what a whole paper run costs on this machine.

    python -m bench.paper_grid --model=cnn|linear|gru|lstm [--scale=F] [--rounds=K] [--out=PATH]

Each model is the workload of its flagfile (the replicas θ × seeds, m, the local work, the
rounds and the evaluation period): ``cnn`` ``experiments/emnist.flags``, ``linear``
``experiments/emnist_linear.flags``, ``gru`` ``experiments/shakespeare.flags``, ``lstm``
``experiments/sent140_lstm.flags``, on synthetic data of the real dataset's shape
(:mod:`bench.common`: Table 1's clients and sizes, the loaders' input shapes and dtypes, the
flagfile's ``--normalize``), so no download is needed. The run is built, compiled, and timed
by the code of ``experiments.run --estimate`` (:func:`deltafl_jax.run.estimate.measure`): at
least ``--rounds`` rounds (and ``--min_seconds``) after compilation, and one evaluation.

``--scale=F`` (0 < F <= 1) shrinks the run for a CPU: F × the training and test clients, m
and the rounds, and the first ⌈F × seeds⌉ seeds (θ's are kept), each at least 1 (m at least
1, clients at least m + 1). The JSON (``--out``; default the git-ignored
``bench/out/paper_grid_<model>_<backend>[_scale<F>].json``, so a run leaves the clone clean:
the committed figures of ``bench/results/`` are written with an explicit ``--out``) holds the configuration measured, s/round, compile s, the projected
wall-clock of that configuration's whole run and its parts (build + compile + rounds ×
s/round + evaluations × s/eval), the device memory (peak where the backend reports it, what
the compiled round holds otherwise), the critical-path trips of a round (the engine's
``train_trips`` / ``eval_trips`` metrics), and achieved FLOP/s: the round's useful FLOPs
(forward FLOPs per example from XLA's cost analysis of the model, times the real examples
evaluated plus 3 × those trained) over s/round, against the device's peak from a small table
of known devices ('unknown' elsewhere, e.g. on CPU). XLA's cost analysis of the whole round
is recorded too, but it counts each while loop's body once, so it is not the round's work.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Dict, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

FLAGFILES = {"cnn": "emnist.flags", "linear": "emnist_linear.flags", "gru": "shakespeare.flags",
             "lstm": "sent140_lstm.flags"}

# Dense matmul peaks per device (what JAX's default float32 matmuls run at: TF32 tensor cores
# on NVIDIA Ampere and later, bf16 passes on TPU; FP32 on older GPUs), from the vendors' data
# sheets, without sparsity. Keyed by a substring of jax's device_kind; first match wins.
DEVICE_PEAKS = (
    ("H200", 494.7e12, "TF32 dense (H200 SXM)"),
    ("H100 PCIe", 378e12, "TF32 dense (H100 PCIe)"),
    ("H100", 494.7e12, "TF32 dense (H100 SXM)"),
    ("A100", 156e12, "TF32 dense (A100)"),
    ("L4", 60e12, "TF32 dense (L4)"),
    ("A10G", 35e12, "TF32 dense (A10G)"),
    ("T4", 8.1e12, "FP32 (T4, no TF32)"),
    ("V100", 15.7e12, "FP32 (V100 SXM2, no TF32)"),
    ("TPU v6", 918e12, "bf16 (TPU v6e chip)"),
    ("TPU v5 lite", 197e12, "bf16 (TPU v5e chip)"),
    ("TPU v5", 459e12, "bf16 (TPU v5p chip)"),
    ("TPU v4", 275e12, "bf16 (TPU v4 chip)"),
    ("TPU v3", 61.5e12, "bf16 (TPU v3 core)"),
    ("TPU v2", 22.5e12, "bf16 (TPU v2 core)"),
)


class Fail(Exception):
    """Bad input: one line, exit code 2."""


def device_peak(device_kind: str) -> Tuple[Optional[float], str]:
    for key, peak, basis in DEVICE_PEAKS:
        if key.lower() in device_kind.lower():
            return peak, basis
    return None, "unknown"


def scaled(n: int, scale: float, least: int = 1) -> int:
    return max(least, int(round(n * scale)))


def flagfile_config(model: str, scale: float, extra: Sequence[str] = ()):
    """The flagfile's configuration, scaled, with ``extra`` experiment flags after it:
    (config, train clients, test clients)."""
    from experiments import cli
    cli.define_experiment_flags()
    path = os.path.join(REPO, "experiments", FLAGFILES[model])
    cli.FLAGS.unparse_flags()
    cli.FLAGS(["paper_grid", f"--flagfile={path}", *extra])
    base = cli.config_from_flags()
    train, test = {"cnn": (865, 865), "linear": (865, 865), "gru": (544, 545),
                   "lstm": (438, 439)}[model]
    m = scaled(base.training.clients_per_round, scale)
    rounds = scaled(base.training.num_rounds, scale)
    given = base.training.seeds
    seeds = given[:scaled(len(given), scale)] if scale < 1 else given
    cli.FLAGS.unparse_flags()
    cli.FLAGS(["paper_grid", f"--flagfile={path}", f"--clients_per_round={m}",
               f"--num_rounds={rounds}",
               f"--eval_every={min(base.evaluation.eval_every, rounds)}",
               f"--seeds={','.join(str(s) for s in seeds)}", "--nosave_models", "--output_dir=", *extra])
    return cli.config_from_flags(), scaled(train, scale, m + 1), scaled(test, scale, 2)


def dataset(model: str, config, train: int, test: int):
    """Synthetic data shaped like the flagfile's dataset, normalised as its --normalize."""
    from bench import common
    from deltafl_jax.datasets import normalize
    if model in ("cnn", "linear"):
        data = common.femnist_like_dataset(train, seed=0, flat=model == "linear",
                                           num_test_clients=test)
    elif model == "gru":
        data = common.shakespeare_like_dataset(train, test, seed=0)
    else:
        data = common.sent140_like_dataset(train, test, seed=0)
    return normalize.normalize(data, config.data.normalize, warn=lambda line: None)


def run(model: str, scale: float, rounds: int, min_seconds: float, extra: Sequence[str] = (),
        log=lambda line: print(line, file=sys.stderr, flush=True)) -> Dict:
    import jax
    from bench import common
    from deltafl_jax.run.estimate import estimate_run

    config, train, test = flagfile_config(model, scale, extra)
    log(f"paper_grid: {model} ({FLAGFILES[model]}) at scale {scale:g}: {train} train / {test} "
        f"test clients, m={config.training.clients_per_round}, {config.training.num_rounds} rounds")
    t0 = time.perf_counter()
    data = dataset(model, config, train, test)
    data_s = time.perf_counter() - t0
    est = estimate_run(config, data, timed_rounds=rounds, min_seconds=min_seconds, log=log)
    from deltafl_jax.models import ModelOptions, build_model
    # FLOPs of the model in float32 with XLA's scan: the products --compute_dtype and
    # --rnn_impl=pallas run too (a Pallas kernel's products are not in the jaxpr).
    fwd = common.forward_flops_per_example(build_model(
        config.training.model, data, ModelOptions(conv_impl=config.placement.conv_impl,
                                                  use_bias=config.training.use_bias,
                                                  rnn_impl="scan")))
    w = est.work
    round_flops = fwd * (w["eval_real_examples"] + 3 * w["train_real_examples"])
    achieved = round_flops / est.round_s
    kind = str(getattr(jax.devices()[0], "device_kind", jax.default_backend()))
    peak, basis = device_peak(kind) if jax.default_backend() != "cpu" else (None, "unknown")
    return {
        "model": model, "flagfile": f"experiments/{FLAGFILES[model]}", "scale": scale,
        "extra_flags": list(extra),
        "machine": common.machine(),
        "config": {"replicas": est.replicas, "thetas": list(config.thetas),
                   "seeds": list(config.training.seeds),
                   "clients_per_round": config.training.clients_per_round,
                   "train_clients": data.train.num_clients,
                   "test_clients": data.test.num_clients,
                   "train_examples": int(data.train.num_examples),
                   "test_examples": int(data.test.num_examples),
                   "num_rounds": est.num_rounds, "eval_every": est.eval_every,
                   "local_epochs": config.training.local_epochs,
                   "batch_size": config.training.batch_size,
                   "lanes": est.lanes, "devices": est.devices,
                   "compute_dtype": config.precision.compute_dtype,
                   "rnn_impl": config.placement.rnn_impl},
        "s_per_round": est.round_s,
        "compile_s": est.compile_s,
        "whole_run_s": est.projected_s,
        "whole_run_parts": {"build_s": est.build_s, "compile_s": est.compile_s,
                            "rounds": est.num_rounds, "s_per_round": est.round_s,
                            "evaluations": est.evaluations, "s_per_evaluation": est.eval_s},
        "synthetic_data_s": data_s,
        "device_memory_bytes": est.memory.nbytes, "device_memory_source": est.memory.source,
        "critical_path": {"train_trips": w["train_trips"], "eval_trips": w.get("eval_trips"),
                          "per_round": w["train_trips"] + w.get("eval_trips", 0.0),
                          "train_trips_of_timed_rounds": est.train_trips},
        "examples_per_round": {k: v for k, v in w.items() if k.endswith("examples")},
        "forward_flops_per_example": fwd,
        "round_flops": round_flops,
        "achieved_flop_per_s": achieved,
        "device_kind": kind,
        "device_peak_flop_per_s": peak if peak is not None else "unknown",
        "device_peak_basis": basis,
        "fraction_of_peak": achieved / peak if peak else "unknown",
        "xla_cost_analysis_round_flops": est.flops_per_round,
        "timed_rounds": est.timed_rounds,
        "estimate": est.to_json(),
    }


def default_out(model: str, scale: float, backend: str) -> str:
    """The git-ignored default: bench/out/paper_grid_<model>_<backend>[_scale<F>].json."""
    from bench import paths
    tail = "" if scale == 1 else f"_scale{scale:g}"
    return paths.default_out(f"paper_grid_{model}_{backend}{tail}")


def summary(r: Dict) -> list:
    """The one-screen summary printed after a run (the JSON holds everything)."""
    c, p, cp = r["config"], r["whole_run_parts"], r["critical_path"]
    mem = r["device_memory_bytes"]
    peak = r["fraction_of_peak"]
    return [
        f"paper_grid {r['model']} ({r['flagfile']}) at scale {r['scale']:g} on "
        f"{r['machine']['backend']} ({r['device_kind']})",
        f"  {c['replicas']} replicas (θ {', '.join(f'{t:g}' for t in c['thetas'])} × "
        f"{len(c['seeds'])} seeds), m = {c['clients_per_round']} of {c['train_clients']} train "
        f"/ {c['test_clients']} test clients, {c['num_rounds']} rounds, evaluation every "
        f"{c['eval_every']}",
        f"  s/round {r['s_per_round']:.4g}, compile {r['compile_s']:.3g} s, s/evaluation "
        f"{p['s_per_evaluation']:.4g}",
        f"  whole run (projected) {r['whole_run_s']:.4g} s = {p['build_s']:.3g} build + "
        f"{p['compile_s']:.3g} compile + {p['rounds']} × {p['s_per_round']:.4g} + "
        f"{p['evaluations']} × {p['s_per_evaluation']:.4g}",
        f"  device memory {mem / 1e6:.1f} MB ({r['device_memory_source']})",
        f"  critical path {cp['train_trips']:.0f} + {cp['eval_trips'] or 0:.0f} trips/round "
        f"(train + eval)",
        f"  achieved {r['achieved_flop_per_s'] / 1e9:.4g} GFLOP/s "
        f"({r['round_flops'] / 1e9:.4g} GFLOP/round), fraction of the device's peak: "
        + (f"{peak:.3g}" if isinstance(peak, float) else str(peak))]


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.paper_grid", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--model", required=True, choices=sorted(FLAGFILES))
    p.add_argument("--scale", type=float, default=1.0, help="0 < F <= 1: shrink the run")
    p.add_argument("--rounds", type=int, default=5, help="rounds timed at least")
    p.add_argument("--min_seconds", type=float, default=5.0, help="seconds of rounds at least")
    p.add_argument("--flag", action="append", default=[], dest="extra",
                   help="an experiment flag added after the flagfile's, e.g. --flag=--lanes=64, "
                   "--flag=--compute_dtype=bfloat16, --flag=--rnn_impl=pallas (repeatable)")
    p.add_argument("--out", default=None, help="the JSON (default the git-ignored "
                   "bench/out/paper_grid_<model>_<backend>[_scale<F>].json)")
    args = p.parse_args(argv)
    if not 0 < args.scale <= 1 or not math.isfinite(args.scale):
        raise Fail(f"--scale must be in (0, 1], got {args.scale:g}")
    if args.rounds < 1:
        raise Fail(f"--rounds must be at least 1, got {args.rounds}")
    if args.min_seconds < 0:
        raise Fail(f"--min_seconds must be >= 0, got {args.min_seconds:g}")
    return args


def main(argv=None) -> None:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    import jax
    from bench import common
    result = run(args.model, args.scale, args.rounds, args.min_seconds, args.extra)
    common.emit(result, args.out or default_out(args.model, args.scale, jax.default_backend()),
                summary=summary(result))


if __name__ == "__main__":
    main()
