r"""ResNet-18-GN on this machine: the round a user runs, its share of the GEMM peak, and one
local SGD step split by part.

    python -m bench.resnet_profile [--rounds=2] [--flag=--clients_per_round=2 ...]
        [--steps=3] [--repeats=3] [--parts=round,step] [--out=bench/results/resnet_profile_cpu.json]

**The round.** ``experiments/cifar10_dirichlet.flags`` with ``--model=resnet18_gn``, configured
by the command line's own flag parsing (:mod:`experiments.cli`), its backend started as the
command line starts it (``start_backend``: on a CPU one host device per core), on CIFAR-10's
known shape (:func:`deltafl_jax.datasets.known_shapes.load_or_stand_in`: the 50,000 / 10,000
images partitioned by the flagfile's own Dir(0.1) into 100 + 100 clients, as ``--estimate``
does offline) with random pixels in place of the stand-in's constant ones. The flagfile's whole
round (3 replicas x 10 clients of up to 3,194 images) is hours on a 2-core CPU, so experiment
flags added after the flagfile (``--flag``, repeatable; default :data:`ROUND_FLAGS`: 2 clients a
round, at most 32 images each: one batch) shrink it; the replicas, the model, the batch, the
augmentation and the lanes stay the flagfile's. The round is stepped as the run loop steps it
(:class:`bench.common.SteppedRun`: the jitted round, the next plan, the metrics on the host),
``--rounds`` rounds after the first (compilation); the figure is their median.

FLOPs, counted from the network's jaxpr with XLA's convolutions
(:func:`bench.common.forward_flops_per_example`, every matrix product and convolution): a
trained example costs its forward pass, the weight gradient and the input gradient of each
product (each the forward's FLOPs), less the stem's input gradient, which no SGD step
computes: 3 x forward - stem; a loss-evaluated example (Delta-FL's F_k(w_t) of the sampled
clients) its forward pass. The round's FLOPs are those times the round's real examples
(``train_real_examples``, ``eval_real_examples``); GFLOP/s is that over s/round, and its share
of the GEMM peak divides it by :func:`bench.common.gemm_peak_gflops` (float32 2048 x 2048),
measured in this run before the round and after the step profile (the higher of the two).

**The step.** One local SGD step of the flagfile's batch (``--batch``, default 32), one client,
one device, in a ``lax.fori_loop`` of ``--steps`` steps (XLA:CPU compiles loops differently
from straight-line code), and each part of it the same way at its own shapes:

- ``stem``: the 3x3 3->64 convolution: forward, and forward + weight gradient (its input is
  the image: no input gradient);
- ``stageS 3x3``: one stride-1 3x3 convolution of stage S (4 in stage 1, 3 in stages 2-4):
  forward, forward + weight gradient, forward + input gradient;
- ``stageS downsample 3x3/2`` and ``stageS shortcut 1x1/2`` (stages 2-4): the same three;
- ``stageS groupnorm``: one GroupNorm (2 groups) forward + backward (input, scale, offset; 5 per
  stage: the stem's and 4 in stage 1, 4 and the shortcut's in stages 2-4);
- ``stageS relu`` and ``stageS relu(add)``: forward + backward (3 and 2 in stage 1, 2 and 2 in
  stages 2-4);
- ``head``: global average pooling, the dense layer and the softmax cross-entropy, forward +
  backward;
- ``sgd update``: p - lr g over the 11,173,962 parameters (the network's own tree);
- ``step``: the whole step (the mean cross-entropy's gradient through the model as the engine
  builds it on this backend, and the update), and ``forward`` alone.

Each part's function ends in ||out||^2 / 2, whose gradient with respect to the output is the
output itself: a gradient then waits for its forward pass, as in the network (with a linear
read-out XLA:CPU runs the two side by side on the two cores, and the difference undercounts
the gradient), at the cost of one elementwise product. The loop carries the inputs, nudged by
their gradients, so nothing is hoisted. A gradient is timed with its forward; its cost is the
difference. A part's time in the step is its time x its count; its GFLOP/s are its FLOPs (the
forward's, counted by :func:`bench.common.jaxpr_matmul_flops`; each gradient the same) over
its time. All programs
run interleaved, each repeat in turn; each figure is the median over ``--repeats`` of the
milliseconds per step. The load average is recorded around each half.

The engine runs this step in unrolled lanes (several clients' steps in one program) and with
the flagfile's crop-and-flip augmentation; the profile is one client without augmentation.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

from bench.common import (SteppedRun, emit, forward_flops_per_example, gemm_peak_gflops,
                          jaxpr_matmul_flops, machine, median)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FLAGFILE = os.path.join("experiments", "cifar10_dirichlet.flags")
ROUND_FLAGS = ("--clients_per_round=2", "--max_examples_per_client=32")
WIDTHS, CLASSES = (64, 128, 256, 512), 10


# ---------------------------------------------------------------------------------------------
# The round


def flagfile_config(extra):
    """The flagfile's configuration with --model=resnet18_gn and `extra` after it, parsed by
    the command line's flags; the backend's XLA flags set as the command line sets them."""
    from experiments import cli
    from experiments.backend import start_backend
    cli.define_experiment_flags()
    cli.FLAGS.unparse_flags()
    cli.FLAGS(["resnet_profile", f"--flagfile={os.path.join(REPO, FLAGFILE)}",
               "--model=resnet18_gn", "--nosave_models", "--output_dir=", *extra])
    start_backend()
    return cli.config_from_flags()


def cifar_data(config):
    """(data, note): the flagfile's partition of CIFAR-10, on its known shape when it is not
    prepared here, with random pixels in place of the stand-in's constant ones."""
    from deltafl_jax.datasets.known_shapes import load_or_stand_in
    data, note = load_or_stand_in(config.data)
    if note:
        rng = np.random.default_rng(0)
        for split in (data.train, data.test):
            split.x[...] = rng.integers(0, 256, split.x.shape, dtype=np.uint8)
    return data, note


def network_flops(data, batch: int) -> dict:
    """Forward, stem and training FLOPs of one example of ResNet-18-GN with XLA's
    convolutions (module docstring)."""
    import jax
    import jax.numpy as jnp

    from deltafl_jax.models import ModelOptions, build_model
    model = build_model("resnet18_gn", data, ModelOptions(conv_impl="xla"))
    forward = forward_flops_per_example(model)
    x = jnp.zeros((1,) + tuple(model.example_shape), jnp.float32)
    w = jnp.zeros((3, 3, x.shape[-1], WIDTHS[0]), jnp.float32)
    stem = jaxpr_matmul_flops(jax.make_jaxpr(lambda x, w: conv_fn("xla")(x, w))(x, w).jaxpr)
    params = model.init(jax.random.key(0))
    return {"forward": forward, "stem_forward": stem, "train": 3 * forward - stem,
            "parameters": int(sum(np.size(a) for a in jax.tree.leaves(params)))}


def conv_fn(impl):
    from deltafl_jax.models.image_conv import conv_same
    return lambda x, w: conv_same(x, w, impl)


def time_round(config, extra, rounds: int, log) -> dict:
    """The flagfile's round (`config`, parsed with `extra`) stepped `rounds` times after the
    first, with its FLOPs and GFLOP/s."""
    import jax

    from deltafl_jax import build_experiment
    data, note = cifar_data(config)
    exp = build_experiment(config, data)
    flops = network_flops(data, config.batch_size)
    log(f"resnet_profile: compiling the round ({exp.replicas.size} replicas, "
        f"{config.clients_per_round} clients) ...")
    t0 = time.perf_counter()
    run = SteppedRun(exp)
    compile_s = time.perf_counter() - t0
    rows = []
    for t in range(1, rounds + 1):
        metrics, _ = run.step(t)
        rows.append({k: int(np.sum(metrics[k])) for k in (
            "train_real_examples", "train_padded_examples", "eval_real_examples",
            "eval_padded_examples", "train_trips")})
        rows[-1]["seconds"] = run.parts["round"][-1]
        log(f"resnet_profile: round {t}: {rows[-1]['seconds']:.2f} s")
    for r in rows:
        r["gflop"] = (flops["train"] * r["train_real_examples"]
                      + flops["forward"] * r["eval_real_examples"]) / 1e9
        r["gflop_padded"] = (flops["train"] * r["train_padded_examples"]
                             + flops["forward"] * r["eval_padded_examples"]) / 1e9
        r["gflop_per_s"] = r["gflop"] / r["seconds"]
    return {"flagfile": FLAGFILE, "flags": ["--model=resnet18_gn", *extra],
            "data_note": note or "", "replicas": exp.replicas.size,
            "clients_per_round": config.clients_per_round, "batch_size": config.batch_size,
            "augment": config.augment, "placement": {k: v for k, v in vars(exp.placement).items()
                                                     if isinstance(v, (int, float, str, bool))},
            "jax_devices": jax.local_device_count(), "compile_and_first_round_s": compile_s,
            "flops_per_example": flops, "rounds": rows,
            "s_per_round": median([r["seconds"] for r in rows]),
            "gflop_per_round": median([r["gflop"] for r in rows]),
            "gflop_per_s": median([r["gflop_per_s"] for r in rows]),
            "s_per_trained_example": median([r["seconds"] / max(r["train_real_examples"], 1)
                                             for r in rows])}


# ---------------------------------------------------------------------------------------------
# The step


def looped(loss, argnums, steps: int):
    """jit: `steps` evaluations of loss(*args) in a fori_loop (with the gradients of argnums
    when given), the carried args nudged by their gradients (or by the loss) so that each
    step depends on the last."""
    import jax
    from jax import lax

    def body(i, args):
        args = list(args)
        if argnums:
            val, grads = jax.value_and_grad(loss, argnums)(*args)
            for k, g in zip(argnums, grads):
                args[k] = jax.tree.map(lambda a, b: a - 1e-6 * b, args[k], g)
        else:
            val = loss(*args)
        args[0] = jax.tree.map(lambda a: a - 1e-12 * val.astype(a.dtype), args[0])
        return tuple(args)

    return jax.jit(lambda *a: lax.fori_loop(0, steps, body, a))


def readout(f):
    """loss(*args) = ||f(*args)||^2 / 2 (its output gradient is f's output)."""
    import jax.numpy as jnp

    def loss(*args):
        y = f(*args)
        return 0.5 * jnp.vdot(y, y)

    return loss


def conv_parts(batch: int, side: int, impl: str):
    """(name, count, forward function, input shapes, differentiated variants) of each
    convolution of ResNet-18-GN at `batch` images of side x side."""
    from deltafl_jax.models.image_conv import conv1x1_stride2, conv_same, conv_stride2
    out = [("stem 3x3 3->64", 1, lambda x, w: conv_same(x, w, impl),
            ((batch, side, side, 3), (3, 3, 3, WIDTHS[0])), ("weight",))]
    for s, width in enumerate(WIDTHS, start=1):
        hw = side >> (s - 1)
        if s > 1:
            cin, hin = WIDTHS[s - 2], side >> (s - 2)
            out.append((f"stage{s} downsample 3x3/2 {cin}->{width}", 1,
                        lambda x, w: conv_stride2(x, w, impl),
                        ((batch, hin, hin, cin), (3, 3, cin, width)), ("weight", "input")))
            out.append((f"stage{s} shortcut 1x1/2 {cin}->{width}", 1, conv1x1_stride2,
                        ((batch, hin, hin, cin), (1, 1, cin, width)), ("weight", "input")))
        out.append((f"stage{s} 3x3 {width}->{width}", 4 if s == 1 else 3,
                    lambda x, w: conv_same(x, w, impl),
                    ((batch, hw, hw, width), (3, 3, width, width)), ("weight", "input")))
    return out


def elementwise_parts(batch: int, side: int):
    """(name, count, function, input shapes) of the GroupNorms, ReLUs and adds."""
    import flax.linen as nn
    import jax

    from deltafl_jax.models.image import GN_EPSILON, GN_GROUPS
    out = []
    for s, width in enumerate(WIDTHS, start=1):
        hw = side >> (s - 1)
        shape = (batch, hw, hw, width)
        gn = nn.GroupNorm(num_groups=GN_GROUPS, epsilon=GN_EPSILON)
        gn_apply = lambda x, scale, bias, gn=gn: gn.apply(
            {"params": {"scale": scale, "bias": bias}}, x)
        out.append((f"stage{s} groupnorm {hw}x{hw}x{width}", 5, gn_apply,
                    (shape, (width,), (width,))))
        out.append((f"stage{s} relu", 3 if s == 1 else 2, jax.nn.relu, (shape,)))
        out.append((f"stage{s} relu(add)", 2, lambda a, b: jax.nn.relu(a + b), (shape, shape)))
    return out


def network_step(batch: int, side: int):
    """(loss(params, x, y), params, x, y, network): the mean cross-entropy of ResNet-18-GN
    with the convolutions the engine uses on this backend."""
    import jax
    import jax.numpy as jnp

    from deltafl_jax.models.conv import default_conv_impl
    from deltafl_jax.models.image import ResNetGN
    rng = np.random.default_rng(0)
    net = ResNetGN(CLASSES, conv_impl=default_conv_impl())
    x = jnp.asarray(rng.random((batch, side, side, 3)), jnp.float32)
    y = jnp.asarray(rng.integers(0, CLASSES, batch), jnp.int32)
    params = net.init(jax.random.key(0), x)

    def loss(p, x, y):
        logp = jax.nn.log_softmax(net.apply(p, x))
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], 1))

    return loss, params, x, y, net


def step_programs(batch: int, side: int, steps: int):
    """{name: (jitted program, args, count, kind, forward FLOPs)} of the step and its parts."""
    import jax
    import jax.numpy as jnp

    from deltafl_jax.models.conv import default_conv_impl
    rng = np.random.default_rng(1)
    arr = lambda shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
    progs = {}
    for name, count, f, shapes, grads in conv_parts(batch, side, default_conv_impl()):
        w_scale = math.sqrt(2.0 / math.prod(shapes[1][:3]))
        args = (arr(shapes[0]), arr(shapes[1], w_scale))
        fwd = jaxpr_matmul_flops(jax.make_jaxpr(f)(*args).jaxpr)
        loss = readout(f)
        progs[name + " | forward"] = (looped(loss, (), steps), args, count, "forward", fwd)
        for g in grads:
            argnums = (1,) if g == "weight" else (0,)
            progs[f"{name} | +{g} grad"] = (looped(loss, argnums, steps), args, count, g,
                                            fwd)
    for name, count, f, shapes in elementwise_parts(batch, side):
        args = tuple(arr(s) if len(s) > 1 else jnp.ones(s, jnp.float32) for s in shapes)
        progs[name + " | forward+backward"] = (
            looped(readout(f), tuple(range(len(args))), steps), args, count,
            "forward+backward", 0.0)
    feats = arr((batch, max(side >> 3, 1), max(side >> 3, 1), WIDTHS[-1]))
    dense, labels = arr((WIDTHS[-1], CLASSES), 0.05), jnp.asarray(
        rng.integers(0, CLASSES, batch), jnp.int32)

    def head(h, w, b, y):
        logp = jax.nn.log_softmax(h.mean(axis=(1, 2)) @ w + b)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], 1))

    hargs = (feats, dense, jnp.zeros((CLASSES,), jnp.float32), labels)
    progs["head | forward+backward"] = (
        looped(head, (0, 1, 2), steps), hargs, 1, "forward+backward",
        jaxpr_matmul_flops(jax.make_jaxpr(head)(*hargs).jaxpr))
    loss, params, x, y, _ = network_step(batch, side)
    grads = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), params)
    update = lambda p, g: jax.tree.map(lambda a, b: a - 0.05 * b, p, g)
    progs["sgd update | p - lr g"] = (jax.jit(lambda p, g: jax.lax.fori_loop(
        0, steps, lambda i, c: (update(c[0], c[1]), c[1]), (p, g))), (params, grads), 1,
        "update", 0.0)
    progs["step | forward"] = (looped(loss, (), steps), (params, x, y), 1, "forward", 0.0)

    def sgd(i, c):
        g = jax.grad(loss)(*c)
        return (update(c[0], g),) + tuple(c[1:])

    progs["step | sgd step"] = (jax.jit(lambda *c: jax.lax.fori_loop(0, steps, sgd, c)),
                                (params, x, y), 1, "step", 0.0)
    return progs


def time_programs(progs: dict, steps: int, repeats: int, log) -> dict:
    """Median ms per step of each program, interleaved (each repeat in turn)."""
    import jax
    for fn, args, *_ in progs.values():
        jax.block_until_ready(fn(*args))   # compiles
    log(f"resnet_profile: {len(progs)} step programs compiled; timing ...")
    times = {n: [] for n in progs}
    for _ in range(repeats):
        for name, (fn, args, *_) in progs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - t0) * 1e3 / steps)
    return {n: median(t) for n, t in times.items()}, times


def split_table(progs: dict, ms: dict) -> list:
    """One row per part: its count, ms per call and in the step, FLOPs, GFLOP/s; a gradient's
    time is its program's less the forward's."""
    rows = []
    for name, (_, _, count, kind, fwd) in progs.items():
        part, _, variant = name.partition(" | ")
        if part.startswith("step"):
            continue
        t = ms[name]
        if kind in ("weight", "input"):
            t = ms[name] - ms[part + " | forward"]
        rows.append({"part": part, "variant": variant.lstrip("+"), "count": count,
                     "ms_per_call": t, "ms_in_step": t * count,
                     "gflop_per_call": fwd / 1e9 if fwd else None,
                     "gflop_per_s": fwd / 1e9 / (t / 1e3) if fwd and t > 0 else None})
    return rows


def group_of(row) -> str:
    part = row["part"]
    for key, group in (("stem", "stem conv"), ("downsample", "downsample 3x3/2"),
                       ("shortcut", "shortcut 1x1/2"), ("groupnorm", "groupnorm"),
                       ("relu", "relu / add"), ("head", "head"), ("sgd", "sgd update")):
        if key in part:
            return group
    return "3x3 convs " + {"forward": "forward", "weight grad": "weight grad",
                           "input grad": "input grad"}[row["variant"]]


def profile_step(batch: int, side: int, steps: int, repeats: int, log) -> dict:
    progs = step_programs(batch, side, steps)
    ms, all_ms = time_programs(progs, steps, repeats, log)
    rows = split_table(progs, ms)
    groups = {}
    for r in rows:
        g = groups.setdefault(group_of(r), {"ms_in_step": 0.0, "gflop": 0.0})
        g["ms_in_step"] += r["ms_in_step"]
        g["gflop"] += (r["gflop_per_call"] or 0.0) * r["count"]
    step_ms, parts_ms = ms["step | sgd step"], sum(r["ms_in_step"] for r in rows)
    for g in groups.values():
        g["share_of_parts"] = g["ms_in_step"] / parts_ms
        g["gflop_per_s"] = (g["gflop"] / (g["ms_in_step"] / 1e3)
                            if g["gflop"] and g["ms_in_step"] > 0 else None)
    conv_gflop = sum((r["gflop_per_call"] or 0.0) * r["count"] for r in rows)
    return {"batch": batch, "side": side, "steps": steps, "repeats": repeats,
            "step_ms": step_ms, "forward_ms": ms["step | forward"],
            "parts_sum_ms": parts_ms, "parts_sum_over_step": parts_ms / step_ms,
            "step_gflop": conv_gflop, "step_gflop_per_s": conv_gflop / (step_ms / 1e3),
            "groups": groups, "parts": rows, "all_ms_per_step": all_ms}


# ---------------------------------------------------------------------------------------------


def bad_option(a, parts) -> str:
    """What is wrong with the options, or ""."""
    if not parts <= {"round", "step"}:
        return f"--parts={a.parts}: name round, step or both"
    for name in ("rounds", "steps", "repeats", "gemm_n"):
        if getattr(a, name) < 1:
            return f"--{name} must be at least 1, got {getattr(a, name)}"
    if a.batch is not None and a.batch < 1:
        return f"--batch must be at least 1, got {a.batch}"
    if a.side < 8 or a.side % 8:
        return f"--side must be a multiple of 8 (three stride-2 stages), got {a.side}"
    return ""


def usage(line: str) -> None:
    """One line on stderr, exit code 2, nothing written."""
    print(f"resnet_profile: {line}", file=sys.stderr)
    sys.exit(2)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="timed rounds after the first")
    p.add_argument("--flag", action="append", default=None,
                   help=f"an experiment flag after the flagfile's (repeatable; default "
                        f"{' '.join(ROUND_FLAGS)})")
    p.add_argument("--batch", type=int, default=None, help="the step's batch (default the "
                   "flagfile's --batch_size)")
    p.add_argument("--side", type=int, default=32, help="the step's image side")
    p.add_argument("--steps", type=int, default=3, help="steps per timed loop")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gemm_n", type=int, default=2048)
    p.add_argument("--parts", default="round,step", help="round, step or both")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    parts = set(a.parts.split(","))
    bad = bad_option(a, parts)
    if bad:
        usage(bad)
    log = lambda line: print(line, file=sys.stderr, flush=True)
    extra = list(ROUND_FLAGS if a.flag is None else a.flag)
    try:
        config = flagfile_config(extra)   # before JAX starts: the command line's XLA flags
    except Exception as e:  # absl's flag errors and the configuration's, one line each
        usage(f"--flag: {(str(e).strip().splitlines() or [type(e).__name__])[0]}")
    result = {"benchmark": "resnet_profile", "machine": machine(),
              "command": " ".join(["python -m bench.resnet_profile"] + sys.argv[1:]),
              "load_average_start": os.getloadavg()}
    gemm = [gemm_peak_gflops(a.gemm_n)]
    if "round" in parts:
        result["round"] = time_round(config, extra, a.rounds, log)
        result["load_average_after_round"] = os.getloadavg()
    if "step" in parts:
        result["step"] = profile_step(a.batch or config.batch_size, a.side, a.steps,
                                      a.repeats, log)
        result["load_average_after_step"] = os.getloadavg()
    gemm.append(gemm_peak_gflops(a.gemm_n))
    result["gemm_gflops_measured"] = gemm
    result["gemm_peak_gflops"] = peak = max(gemm)
    summary = [f"load average at start {result['load_average_start'][0]:.2f}; GEMM peak "
               f"{peak:.1f} GFLOP/s (measured {', '.join(f'{g:.1f}' for g in gemm)})"]
    if "round" in result:
        r = result["round"]
        r["share_of_gemm_peak"] = r["gflop_per_s"] / peak
        summary.append(f"round: {r['s_per_round']:.2f} s, {r['gflop_per_round']:.0f} GFLOP, "
                       f"{r['gflop_per_s']:.1f} GFLOP/s = {r['share_of_gemm_peak']:.0%} of the "
                       f"GEMM peak ({r['replicas']} replicas, flags {' '.join(r['flags'])})")
    if "step" in result:
        s = result["step"]
        s["share_of_gemm_peak"] = s["step_gflop_per_s"] / peak
        summary.append(f"step (batch {s['batch']}): {s['step_ms']:.0f} ms, "
                       f"{s['step_gflop_per_s']:.1f} GFLOP/s = {s['share_of_gemm_peak']:.0%} "
                       f"of the GEMM peak; parts sum to {s['parts_sum_over_step']:.2f} x it")
        for name, g in sorted(s["groups"].items(), key=lambda kv: -kv[1]["ms_in_step"]):
            rate = f", {g['gflop_per_s']:.1f} GFLOP/s" if g["gflop_per_s"] else ""
            summary.append(f"  {name}: {g['ms_in_step']:.0f} ms "
                           f"({g['share_of_parts']:.0%} of the parts){rate}")
    result["load_average_end"] = os.getloadavg()
    emit(result, a.out, summary=summary)


if __name__ == "__main__":
    main()
