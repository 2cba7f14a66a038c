"""The GRU and LSTM recurrences over a whole sequence, as XLA's scan or as Pallas kernels
(issue 53; ``--rnn_impl``).

The text models (:mod:`deltafl_jax.models.text`: Shakespeare's GRU, Sent140's LSTM, the
StackOverflow word LSTM; delta-fl-long.md App. C.1.3) spend their time in the recurrence: T small
matrix products in a row, each a kernel launch on a GPU. Here the input projection
x_t W_i + b of every step is one matrix product outside the loop (``xp``, given by the caller),
and the recurrence over the steps is one of:

- ``"scan"``: ``lax.scan`` over the steps (the reference; XLA differentiates it);
- ``"pallas"``: one Pallas kernel (Triton on a GPU) that loops over the steps and keeps the state
  in registers, saving the gates; its gradient (``jax.custom_vjp``) is a second kernel running
  backward in time that gives d(xp) and d(h0) (and d(c0)), after which the recurrent weights'
  gradient is ONE matrix product over all steps, sum_t h_{t-1}^T dA_t;
- ``"pallas_interpret"``: the same kernels interpreted (``interpret=True``), so that they run
  and are tested on a CPU.

The cells are Flax's, so parameters are interchangeable with ``nn.GRUCell`` and
``nn.OptimizedLSTMCell`` (Cho et al. 2014; Hochreiter & Schmidhuber 1997):

  GRU   r = s(xr + h W_hr), z = s(xz + h W_hz), n = tanh(xn + r (h W_hn + b_hn)),
        h' = (1 - z) n + z h             (xr, xz, xn: x W_ir + b_ir, x W_iz + b_iz, x W_in + b_in)
  LSTM  [i, f, g, o] = [s, s, tanh, s](x W_i + b_h + h W_h),  c' = f c + i g,  h' = o tanh(c')
        (Flax puts the LSTM's biases on the h side; they are folded into xp here).

Inside the kernels the state and the gates are float32 whatever the operands' dtype (bfloat16
operands are multiplied with float32 accumulation). Triton tiles must be powers of two (and at
least 16 for a matrix product), so the kernels see the batch and the hidden size padded with
zeros (50 -> 64, 670 -> 1024) and the gate matrix split per gate into [H, H] blocks; zero padding
keeps the padded units at h = c = 0 for both cells, and the padding is sliced off.

Default (:func:`default_rnn_impl`): ``"scan"`` on every backend. The kernels lower to Triton
for CUDA (tests/test_recurrent_kernels.py exports them without a GPU), but no GPU has compiled or
timed them yet; until one does, ``--rnn_impl=pallas`` is an explicit choice
(docs/reference/models.md, "The recurrent layers: scan and Pallas").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from deltafl_jax.models.model import RNN_IMPLS

GRU_GATES = 3    # r, z, n
LSTM_GATES = 4   # i, f, g, o
MIN_TILE = 16    # Triton's smallest matrix-product tile


def default_rnn_impl(backend: str | None = None) -> str:
    """The recurrent layers when ``--rnn_impl`` is unset: XLA's scan on every backend.

    CPU: interpreted kernels are only for tests, and scan is the reference. TPU: the kernels
    are written for Triton. GPU: the Pallas kernels lower for CUDA but have never been compiled
    or timed on a GPU; scan stays the default until a GPU session measures them
    (``bench/recurrent.py``), so that an unset flag never meets an unproven kernel.
    """
    del backend
    return "scan"


def check_rnn_impl(impl: str, backend: str | None = None) -> None:
    """ValueError unless `impl` is one of RNN_IMPLS and can run on `backend` (None: the one
    running): ``"pallas"`` compiles through Triton, which only a GPU has."""
    if impl not in RNN_IMPLS:
        raise ValueError(f"--rnn_impl must be one of {', '.join(RNN_IMPLS)}, got {impl!r}")
    backend = backend or jax.default_backend()
    if impl == "pallas" and backend != "gpu":
        raise ValueError(f"--rnn_impl=pallas compiles Triton kernels, which need a GPU; the "
                         f"backend is {backend} (use scan, or pallas_interpret to test the "
                         f"kernels on a CPU)")


# ----------------------------------------------------------------------------------------------
# The public entry points: batch-major in, batch-major out.


def gru_sequence(xp, w_h, b_hn, h0, impl: str = "scan"):
    """GRU states of every step.

    xp [B, T, 3H]: x_t W_i + b_i for the gates (r, z, n); w_h [H, 3H]: (W_hr, W_hz, W_hn)
    side by side; b_hn [H]; h0 [B, H]. Returns hs [B, T, H] (hs[:, t] = h_{t+1}).
    """
    if impl == "scan":
        return _scan(_gru_step, xp, w_h, (h0,), b_hn)
    return _padded_call(_gru_pallas, GRU_GATES, xp, w_h, (h0,), b_hn, impl)


def lstm_sequence(xp, w_h, c0, h0, impl: str = "scan"):
    """LSTM hidden states of every step (Flax's OptimizedLSTMCell).

    xp [B, T, 4H]: x_t W_i + b_h for the gates (i, f, g, o); w_h [H, 4H]; c0, h0 [B, H].
    Returns hs [B, T, H].
    """
    if impl == "scan":
        return _scan(_lstm_step, xp, w_h, (c0, h0), None)
    return _padded_call(_lstm_pallas, LSTM_GATES, xp, w_h, (c0, h0), None, impl)


# ----------------------------------------------------------------------------------------------
# The reference: lax.scan with the projection hoisted.


def _mm(a, w):
    """a [.., K] @ w [K, N] with float32 accumulation (a cast to w's dtype)."""
    return jnp.dot(a.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _gru_step(carry, xp_t, w_h, b_hn):
    """One GRU step on float32 state: carry (h,), xp_t [B, 3H] -> (h',), plus the gates
    (r, z, n, h W_hn + b_hn) the backward pass needs."""
    (h,) = carry
    hidden = h.shape[-1]
    hw = _mm(h, w_h)                                     # [B, 3H]
    xr, xz, xn = (xp_t[..., k * hidden:(k + 1) * hidden].astype(jnp.float32) for k in range(3))
    r = jax.nn.sigmoid(xr + hw[..., :hidden])
    z = jax.nn.sigmoid(xz + hw[..., hidden:2 * hidden])
    hn = hw[..., 2 * hidden:] + b_hn.astype(jnp.float32)
    n = jnp.tanh(xn + r * hn)
    return ((1.0 - z) * n + z * h,)


def _lstm_step(carry, xp_t, w_h, _):
    """One LSTM step on float32 state: carry (c, h), xp_t [B, 4H] -> (c', h')."""
    c, h = carry
    hidden = h.shape[-1]
    a = xp_t.astype(jnp.float32) + _mm(h, w_h)          # [B, 4H]
    i, f, o = (jax.nn.sigmoid(a[..., k * hidden:(k + 1) * hidden]) for k in (0, 1, 3))
    g = jnp.tanh(a[..., 2 * hidden:3 * hidden])
    c = f * c + i * g
    return c, o * jnp.tanh(c)


def _scan(step, xp, w_h, carry0, extra):
    out_dtype = jnp.result_type(xp, w_h)

    def body(carry, xp_t):
        carry = step(carry, xp_t, w_h, extra)
        return carry, carry[-1]

    carry0 = tuple(c.astype(jnp.float32) for c in carry0)
    _, hs = lax.scan(body, carry0, jnp.swapaxes(xp, 0, 1))   # [T, B, H]
    return jnp.swapaxes(hs, 0, 1).astype(out_dtype)


# ----------------------------------------------------------------------------------------------
# Padding to Triton's tiles: [B, T, G*H] -> [T, G, Bp, Hp] and back.


def _tile(n: int) -> int:
    return max(MIN_TILE, 1 << (n - 1).bit_length())


def _padded_call(core, gates, xp, w_h, carry0, extra, impl):
    """Pads the operands to tiles, runs `core` (a custom_vjp of the kernels) time-major, and
    slices the result back to hs [B, T, H]."""
    batch, steps, _ = xp.shape
    hidden = w_h.shape[0]
    bp, hp = _tile(batch), _tile(hidden)
    out_dtype = jnp.result_type(xp, w_h)
    x4 = xp.reshape(batch, steps, gates, hidden).transpose(1, 2, 0, 3)      # [T, G, B, H]
    x4 = jnp.pad(x4, ((0, 0), (0, 0), (0, bp - batch), (0, hp - hidden)))
    w3 = w_h.reshape(hidden, gates, hidden).transpose(1, 0, 2)              # [G, H, H]
    w3 = jnp.pad(w3, ((0, 0), (0, hp - hidden), (0, hp - hidden)))
    state = tuple(jnp.pad(s.astype(jnp.float32), ((0, bp - batch), (0, hp - hidden)))
                  for s in carry0)                                          # [Bp, Hp]
    args = (x4, w3) + state
    if extra is not None:
        args += (jnp.pad(extra.astype(jnp.float32), (0, hp - hidden))[None, :],)  # [1, Hp]
    hs = core(impl == "pallas_interpret", *args)                            # [T, Bp, Hp]
    return jnp.swapaxes(hs[:, :batch, :hidden], 0, 1).astype(out_dtype)


def _call(kernel, outs, interpret, *args):
    """pallas_call over whole arrays (one program; the kernel loops over the steps)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton
    return pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(s, jnp.float32) for s in outs],
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1))(*args)


def _dot(a, w):
    """a [Bp, Hp] float32 @ w [Hp, Hp] inside a kernel, float32 accumulation."""
    return jnp.dot(a.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _backward_in_time(steps, body, init):
    """fori_loop over t = T-1, ..., 0."""
    return lax.fori_loop(0, steps, lambda k, carry: body(steps - 1 - k, carry), init)


def _weight_grad(hprev, da, w3):
    """sum_t h_{t-1}^T dA_t per gate, one product: hprev [T, Bp, Hp], da [T, G, Bp, Hp] ->
    [G, Hp, Hp] in w3's dtype."""
    return jnp.einsum("tbh,tgbk->ghk", hprev, da,
                      preferred_element_type=jnp.float32).astype(w3.dtype)


# ----------------------------------------------------------------------------------------------
# GRU kernels.


def _gru_forward_kernel(x_ref, w_ref, h0_ref, b_ref, hs_ref, gates_ref):
    """x [T, 3, Bp, Hp], w [3, Hp, Hp], h0 [Bp, Hp], b_hn [1, Hp] -> hs [T, Bp, Hp] and the
    gates [T, 4, Bp, Hp] (r, z, n, h W_hn + b_hn)."""

    def step(t, h):
        x = lambda k: x_ref[t, k].astype(jnp.float32)   # noqa: E731
        r = jax.nn.sigmoid(x(0) + _dot(h, w_ref[0]))
        z = jax.nn.sigmoid(x(1) + _dot(h, w_ref[1]))
        hn = _dot(h, w_ref[2]) + b_ref[...]
        n = jnp.tanh(x(2) + r * hn)
        h = (1.0 - z) * n + z * h
        hs_ref[t] = h
        for k, gate in enumerate((r, z, n, hn)):
            gates_ref[t, k] = gate
        return h

    lax.fori_loop(0, x_ref.shape[0], step, h0_ref[...])


def _gru_backward_kernel(dhs_ref, hprev_ref, gates_ref, wt_ref, dx_ref, dh0_ref):
    """dhs, hprev [T, Bp, Hp], gates [T, 4, Bp, Hp], wt [3, Hp, Hp] (W_g^T) -> dx [T, 3, Bp, Hp]
    (d of the pre-activations xr, xz, xn) and dh0 [Bp, Hp]."""

    def step(t, dh):
        dh = dh + dhs_ref[t]
        r, z, n, hn = (gates_ref[t, k] for k in range(4))
        da_n = dh * (1.0 - z) * (1.0 - n * n)
        da_z = dh * (hprev_ref[t] - n) * z * (1.0 - z)
        da_r = da_n * hn * r * (1.0 - r)
        for k, d in enumerate((da_r, da_z, da_n)):
            dx_ref[t, k] = d
        return (dh * z + _dot(da_r, wt_ref[0]) + _dot(da_z, wt_ref[1])
                + _dot(da_n * r, wt_ref[2]))

    dh0_ref[...] = _backward_in_time(dhs_ref.shape[0], step, jnp.zeros(dh0_ref.shape,
                                                                        jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gru_pallas(interpret, x4, w3, h0, b):
    return _gru_forward(interpret, x4, w3, h0, b)[0]


def _gru_forward(interpret, x4, w3, h0, b):
    steps, _, bp, hp = x4.shape
    hs, gates = _call(_gru_forward_kernel, [(steps, bp, hp), (steps, 4, bp, hp)], interpret,
                      x4, w3, h0, b)
    return hs, (x4, w3, h0, b, hs, gates)


def _gru_backward(interpret, res, dhs):
    x4, w3, h0, b, hs, gates = res
    steps, _, bp, hp = x4.shape
    hprev = jnp.concatenate([h0[None], hs[:-1]], axis=0)                  # [T, Bp, Hp]
    dx, dh0 = _call(_gru_backward_kernel, [(steps, GRU_GATES, bp, hp), (bp, hp)], interpret,
                    dhs.astype(jnp.float32), hprev, gates, jnp.swapaxes(w3, 1, 2))
    dhn = dx[:, 2] * gates[:, 0]                                          # d(h W_hn + b_hn)
    da = jnp.stack([dx[:, 0], dx[:, 1], dhn], axis=1)                     # [T, 3, Bp, Hp]
    db = dhn.sum(axis=(0, 1))[None, :].astype(b.dtype)
    return dx.astype(x4.dtype), _weight_grad(hprev, da, w3), dh0.astype(h0.dtype), db


_gru_pallas.defvjp(_gru_forward, _gru_backward)


# ----------------------------------------------------------------------------------------------
# LSTM kernels.


def _lstm_forward_kernel(x_ref, w_ref, c0_ref, h0_ref, hs_ref, cs_ref, gates_ref):
    """x [T, 4, Bp, Hp], w [4, Hp, Hp], c0, h0 [Bp, Hp] -> hs, cs [T, Bp, Hp] and the gates
    [T, 4, Bp, Hp] (i, f, g, o)."""

    def step(t, carry):
        c, h = carry
        a = [x_ref[t, k].astype(jnp.float32) + _dot(h, w_ref[k]) for k in range(4)]
        i, f, o = jax.nn.sigmoid(a[0]), jax.nn.sigmoid(a[1]), jax.nn.sigmoid(a[3])
        g = jnp.tanh(a[2])
        c = f * c + i * g
        h = o * jnp.tanh(c)
        hs_ref[t] = h
        cs_ref[t] = c
        for k, gate in enumerate((i, f, g, o)):
            gates_ref[t, k] = gate
        return c, h

    lax.fori_loop(0, x_ref.shape[0], step, (c0_ref[...], h0_ref[...]))


def _lstm_backward_kernel(dhs_ref, cs_ref, cprev_ref, gates_ref, wt_ref, dx_ref, dc0_ref,
                          dh0_ref):
    """dhs, cs, cprev [T, Bp, Hp], gates [T, 4, Bp, Hp], wt [4, Hp, Hp] (W_g^T) ->
    dx [T, 4, Bp, Hp] (d of the pre-activations) and dc0, dh0 [Bp, Hp]."""

    def step(t, carry):
        dc, dh = carry
        dh = dh + dhs_ref[t]
        i, f, g, o = (gates_ref[t, k] for k in range(4))
        tc = jnp.tanh(cs_ref[t])
        dc = dc + dh * o * (1.0 - tc * tc)
        da = (dc * g * i * (1.0 - i), dc * cprev_ref[t] * f * (1.0 - f),
              dc * i * (1.0 - g * g), dh * tc * o * (1.0 - o))
        for k in range(4):
            dx_ref[t, k] = da[k]
        return dc * f, sum(_dot(da[k], wt_ref[k]) for k in range(4))

    zeros = jnp.zeros(dh0_ref.shape, jnp.float32)
    dc0, dh0 = _backward_in_time(dhs_ref.shape[0], step, (zeros, zeros))
    dc0_ref[...] = dc0
    dh0_ref[...] = dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lstm_pallas(interpret, x4, w3, c0, h0):
    return _lstm_forward(interpret, x4, w3, c0, h0)[0]


def _lstm_forward(interpret, x4, w3, c0, h0):
    steps, _, bp, hp = x4.shape
    hs, cs, gates = _call(_lstm_forward_kernel, [(steps, bp, hp), (steps, bp, hp),
                                                 (steps, LSTM_GATES, bp, hp)],
                          interpret, x4, w3, c0, h0)
    return hs, (x4, w3, c0, h0, hs, cs, gates)


def _lstm_backward(interpret, res, dhs):
    x4, w3, c0, h0, hs, cs, gates = res
    steps, _, bp, hp = x4.shape
    cprev = jnp.concatenate([c0[None], cs[:-1]], axis=0)                  # [T, Bp, Hp]
    hprev = jnp.concatenate([h0[None], hs[:-1]], axis=0)
    dx, dc0, dh0 = _call(_lstm_backward_kernel, [(steps, LSTM_GATES, bp, hp), (bp, hp),
                                                 (bp, hp)],
                         interpret, dhs.astype(jnp.float32), cs, cprev, gates,
                         jnp.swapaxes(w3, 1, 2))
    return (dx.astype(x4.dtype), _weight_grad(hprev, dx, w3), dc0.astype(c0.dtype),
            dh0.astype(h0.dtype))


_lstm_pallas.defvjp(_lstm_forward, _lstm_backward)
