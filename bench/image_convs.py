r"""The image models' convolutions in lanes on this machine: XLA's own VALID and stride-2
convolutions against the project's fast path at the same sizes.

    python -m bench.image_convs [--steps=3] [--repeats=5] [--out=bench/results/image_convs_cpu.json]

:mod:`deltafl_jax.models.conv` rewrites the weight gradient of a convolution as an im2col
product, because XLA:CPU's own weight-gradient convolution is slow inside loops. The image
models (:mod:`deltafl_jax.models.image`) need VALID convolutions (pfl-research's CNN) and
stride-2 ones (ResNet-18's downsampling and shortcuts). For each such layer, at batch 10, this
times one local step's forward and backward (gradients of sum(sin(conv(x, w))) with respect to
x and w) of 2 unrolled lanes with their own weights inside a ``lax.fori_loop`` of ``--steps``
steps, as the engine runs them, for

- ``xla``: XLA's convolution with that padding and stride, plain autodiff;
- ``fast``: what the models use on CPU (:mod:`deltafl_jax.models.image_conv`), and every
  ``nn.Conv`` of a model of one's own (:mod:`deltafl_jax.models.conv_intercept`):
  :func:`~deltafl_jax.models.conv.conv_general` with that padding and stride; for 1 x 1
  stride 2 the subsampled input times the kernel;
- ``via_same``: the SAME, stride-1 fast path then a crop (VALID) or the even rows and columns
  (stride 2), the image models' earlier way; for 1 x 1 stride 2 as ``fast``;
- ``same``: the SAME, stride-1 fast path on the same input and kernel (the reference).

Variants run interleaved, each repeat in turn; each figure is the median over ``--repeats`` of
the milliseconds per local step. The machine's load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.common import emit, machine, median
from deltafl_jax.engine.lanes import per_lane
from deltafl_jax.models.conv import conv2d
from deltafl_jax.models.image_conv import conv1x1_stride2, conv_stride2, conv_valid

BATCH, LANES = 10, 2

# (name, input [H, W, C], kernel [k, k, C, O], kind)
CASES = (
    ("pfl_conv1 3x3 VALID 32x32x3->32", (32, 32, 3), (3, 3, 3, 32), "valid"),
    ("pfl_conv2 3x3 VALID 30x30x32->64", (30, 30, 32), (3, 3, 32, 64), "valid"),
    ("resnet stage2 3x3/2 32x32x64->128", (32, 32, 64), (3, 3, 64, 128), "stride2"),
    ("resnet stage3 3x3/2 16x16x128->256", (16, 16, 128), (3, 3, 128, 256), "stride2"),
    ("resnet stage4 3x3/2 8x8x256->512", (8, 8, 256), (3, 3, 256, 512), "stride2"),
    ("resnet shortcut 1x1/2 32x32x64->128", (32, 32, 64), (1, 1, 64, 128), "1x1stride2"),
)


def via_same(kind: str):
    """The SAME fast path and a slice: VALID crops (k - 1) / 2 at each border, stride 2 keeps
    the even rows and columns."""
    def conv(x, w):
        y = conv2d(x, w, "im2col_wgrad")
        if kind == "stride2":
            return y[:, ::2, ::2, :]
        ph, pw = (w.shape[0] - 1) // 2, (w.shape[1] - 1) // 2
        return y[:, ph:y.shape[1] - ph, pw:y.shape[2] - pw, :]
    return conv


def conv_of(kind: str, variant: str):
    if variant == "same":
        return lambda x, w: conv2d(x, w, "im2col_wgrad")
    if variant == "via_same" and kind != "1x1stride2":
        return via_same(kind)
    impl = "xla" if variant == "xla" else "im2col_wgrad"
    if kind == "valid":
        return lambda x, w: conv_valid(x, w, impl)
    if kind == "stride2":
        return lambda x, w: conv_stride2(x, w, impl)
    if variant == "xla":
        return lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "VALID",
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return conv1x1_stride2


def program(conv, steps: int):
    """jit: `steps` local steps of LANES unrolled lanes (each its own x, w), in a fori_loop."""

    def lane(x, w):
        def loss(x, w):
            y = conv(x, w)
            return jnp.sum(jnp.sin(y))
        gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
        return x - 1e-6 * gx, w - 1e-6 * gw

    run = per_lane(lane, LANES, "unroll")

    @jax.jit
    def f(x, w):
        return lax.fori_loop(0, steps, lambda i, c: run(*c), (x, w))

    return f


def time_case(case, steps: int, repeats: int):
    name, shape, kshape, kind = case
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(LANES, BATCH) + shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=(LANES,) + kshape) * 0.05, jnp.float32)
    variants = ("xla", "fast", "via_same", "same")
    fns = {v: program(conv_of(kind, v), steps) for v in variants}
    for f in fns.values():          # compile
        jax.block_until_ready(f(x, w))
    times = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[v](x, w))
            times[v].append((time.perf_counter() - t0) * 1e3 / steps)
    ms = {v: median(t) for v, t in times.items()}
    return {"case": name, "kind": kind, "batch": BATCH, "lanes": LANES,
            "ms_per_step": ms, "all_ms_per_step": times,
            "xla_over_same": ms["xla"] / ms["same"],
            "via_same_over_same": ms["via_same"] / ms["same"],
            "xla_over_via_same": ms["xla"] / ms["via_same"],
            "xla_over_fast": ms["xla"] / ms["fast"],
            "via_same_over_fast": ms["via_same"] / ms["fast"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    load_before = os.getloadavg()
    rows = [time_case(c, a.steps, a.repeats) for c in CASES]
    result = {"benchmark": "image_convs", "machine": machine(),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "steps": a.steps, "repeats": a.repeats, "rows": rows}
    summary = [f"{r['case']}: xla {r['ms_per_step']['xla']:.1f} ms, fast "
               f"{r['ms_per_step']['fast']:.1f} ms, via_same {r['ms_per_step']['via_same']:.1f} "
               f"ms, same {r['ms_per_step']['same']:.1f} ms (xla/fast {r['xla_over_fast']:.2f}, "
               f"via_same/fast {r['via_same_over_fast']:.2f})" for r in rows]
    summary.append(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    emit(result, a.out, summary=summary)


if __name__ == "__main__":
    main()
