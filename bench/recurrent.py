r"""One local SGD step of the papers' recurrent models, three ways over the time steps.

    python -m bench.recurrent [--steps=5] [--repeats=5] [--lanes=4] [--out=PATH]

Issue 53: a recurrent model's round is T small matrix products in a row, forward and backward,
each a kernel launch on a GPU. For Shakespeare's GRU (experiments/shakespeare.flags: batch 16,
20-character windows, embedding 8, GRU 128, 53 classes) and Sent140's LSTM
(experiments/sent140_lstm.flags: batch 10, 25 tokens of GloVe-50, LSTM 50, one logit), this
times the forward and backward pass of a batch and the SGD update, of ``--lanes`` clients
vmapped with their own weights (as the engine runs them), ``--steps`` steps inside one
``lax.fori_loop``, for

- ``scan``: the model as ``--rnn_impl=scan`` builds it: Flax's ``nn.RNN`` over its cell, the
  input projection inside each step;
- ``hoisted``: :func:`deltafl_jax.models.recurrent.gru_sequence` / ``lstm_sequence`` with
  ``impl="scan"``: XLA's scan with the input projection of every step as one product before it;
- ``pallas`` (GPU only): the same with ``impl="pallas"``, the Pallas kernels
  (``--rnn_impl=pallas``). Interpreted kernels (CPU) are emulation, not timings: they are left
  out unless ``--interpret`` adds them (``pallas_interpret``, to check their gradients).

All variants share the parameters (the models' own initialisation). Each figure is the median
over ``--repeats`` of the milliseconds per step, variants interleaved; ``max_grad_diff`` is the
largest difference of one step's gradient from ``scan``'s, so a GPU run checks the kernels'
gradients too. Default output: bench/out/recurrent_<backend>.json.
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
from deltafl_jax.models.recurrent import gru_sequence, lstm_sequence
from deltafl_jax.models.text import (GRU_EMBED_DIM, GRU_HIDDEN, LSTM_HIDDEN, LSTM_MAX_TOKENS,
                                     CharGRU, FrozenTable, GloveLSTM)

# name: (batch, steps T, vocabulary / table rows, classes)
CASES = {"gru": (16, 20, 53, 53), "lstm": (10, LSTM_MAX_TOKENS, 400, 2)}
GLOVE_DIM = 50
# variant: the recurrence's impl (recurrent.py); "scan" is the model as --rnn_impl=scan builds it
RECURRENCE = {"hoisted": "scan", "pallas": "pallas", "pallas_interpret": "pallas_interpret"}


def gru_forward(impl):
    """CharGRU's scores [B, 53] from its own parameters, the recurrence by gru_sequence."""
    def forward(p, ids):
        x = p["Embed_0"]["embedding"][ids]                                  # [B, T, 8]
        g = p["GRUCell_0"]
        w_i = jnp.concatenate([g[k]["kernel"] for k in ("ir", "iz", "in")], axis=1)
        b_i = jnp.concatenate([g[k]["bias"] for k in ("ir", "iz", "in")])
        w_h = jnp.concatenate([g[k]["kernel"] for k in ("hr", "hz", "hn")], axis=1)
        h0 = jnp.zeros((ids.shape[0], w_h.shape[0]), jnp.float32)
        hs = gru_sequence(x @ w_i + b_i, w_h, g["hn"]["bias"], h0, impl)      # [B, T, H]
        return hs[:, -1] @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
    return forward


def lstm_forward(table, impl):
    """GloveLSTM's logit [B, 1], the recurrence by lstm_sequence (h-side biases folded in)."""
    def forward(p, ids):
        x = jnp.asarray(table)[ids]                                         # [B, T, 50]
        c = p["OptimizedLSTMCell_0"]
        w_i = jnp.concatenate([c["i" + k]["kernel"] for k in "ifgo"], axis=1)
        b_h = jnp.concatenate([c["h" + k]["bias"] for k in "ifgo"])
        w_h = jnp.concatenate([c["h" + k]["kernel"] for k in "ifgo"], axis=1)
        zeros = jnp.zeros((ids.shape[0], w_h.shape[0]), jnp.float32)
        hs = lstm_sequence(x @ w_i + b_h, w_h, zeros, zeros, impl)
        return hs[:, -1] @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
    return forward


def case_setup(name: str, batch: int):
    """(params, ids, labels, {variant: forward}) of a case at `batch` examples per lane."""
    _, steps, vocab, classes = CASES[name]
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, vocab, (batch, steps)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, classes, batch), jnp.int32)
    if name == "gru":
        module = CharGRU(num_classes=classes, vocab_size=vocab, embed_dim=GRU_EMBED_DIM,
                         hidden=GRU_HIDDEN)
        forwards = {v: gru_forward(impl) for v, impl in RECURRENCE.items()}
    else:
        table = rng.normal(size=(vocab, GLOVE_DIM)).astype(np.float32)
        module = GloveLSTM(table=FrozenTable(table), hidden=LSTM_HIDDEN)
        forwards = {v: lstm_forward(table, impl) for v, impl in RECURRENCE.items()}
    forwards["scan"] = lambda p, x: module.apply({"params": p}, x)
    return module.init(jax.random.key(0), ids)["params"], ids, labels, forwards


def loss_of(forward, classes: int):
    def loss(p, ids, y):
        out = forward(p, ids).astype(jnp.float32)
        if classes == 2:   # one logit, binary logistic loss
            z = out[:, 0]
            return jnp.mean(jnp.logaddexp(0.0, z) - y * z)
        logp = jax.nn.log_softmax(out, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))
    return loss


def program(loss, steps: int):
    """jit: `steps` SGD steps (lr 0.1) of vmapped lanes, each with its own parameters."""
    grad = jax.vmap(jax.grad(loss), in_axes=(0, None, None))

    @jax.jit
    def run(params, ids, y):
        def step(_, p):
            return jax.tree.map(lambda w, g: w - 0.1 * g, p, grad(p, ids, y))
        return lax.fori_loop(0, steps, step, params)

    return run, jax.jit(grad)


def time_case(name: str, variants, a):
    params, ids, y, forwards = case_setup(name, a.batch or CASES[name][0])
    lanes = jax.tree.map(lambda w: jnp.stack([w * (1.0 + 0.01 * k) for k in range(a.lanes)]),
                         params)
    classes = CASES[name][3]
    fns = {v: program(loss_of(forwards[v], classes), a.steps) for v in variants}
    grads = {v: fns[v][1](lanes, ids, y) for v in variants}
    diff = {v: max(float(jnp.max(jnp.abs(g - s))) for g, s in
                   zip(jax.tree.leaves(grads[v]), jax.tree.leaves(grads["scan"])))
            for v in variants}
    for v in variants:   # compile
        jax.block_until_ready(fns[v][0](lanes, ids, y))
    times = {v: [] for v in variants}
    for _ in range(a.repeats):
        for v in variants:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[v][0](lanes, ids, y))
            times[v].append((time.perf_counter() - t0) * 1e3 / a.steps)
    ms = {v: median(t) for v, t in times.items()}
    return {"case": name, "batch": int(ids.shape[0]), "time_steps": int(ids.shape[1]),
            "lanes": a.lanes, "ms_per_step": ms, "all_ms_per_step": times,
            "max_grad_diff": diff, "over_scan": {v: ms[v] / ms["scan"] for v in variants}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--batch", type=int, default=0, help="0: the flag files' batch sizes")
    p.add_argument("--cases", default="gru,lstm")
    p.add_argument("--interpret", action="store_true",
                   help="add the interpreted kernels (a check of their gradients; no timing)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    backend = jax.default_backend()
    variants = (("scan", "hoisted") + (("pallas",) if backend == "gpu" else ())
                + (("pallas_interpret",) if a.interpret else ()))
    load_before = os.getloadavg()
    rows = [time_case(name, variants, a) for name in a.cases.split(",")]
    result = {"benchmark": f"recurrent_{backend}", "machine": machine(),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "steps": a.steps, "repeats": a.repeats, "variants": list(variants), "rows": rows}
    summary = [f"{r['case']} (B={r['batch']}, T={r['time_steps']}, {r['lanes']} lanes): "
               + ", ".join(f"{v} {r['ms_per_step'][v]:.2f} ms (x{r['over_scan'][v]:.2f}, "
                           f"grad diff {r['max_grad_diff'][v]:.1e})" for v in variants)
               for r in rows]
    summary.append(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    emit(result, a.out, summary=summary)


if __name__ == "__main__":
    main()
