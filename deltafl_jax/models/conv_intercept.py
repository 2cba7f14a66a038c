"""Every convolution and max-pooling of a model on the fast path, without the model knowing.

A network written with Flax's own layers (``nn.Conv``, ``nn.max_pool``) trains in lanes on
XLA:CPU many times slower than the same network on the project's fast path: autodiff's weight
gradient of a convolution is a convolution, which XLA:CPU runs slowly inside the lanes' loops
(:mod:`deltafl_jax.models.conv`; measured about 30x for pfl-research's CIFAR CNN), and the
gradient of ``lax.reduce_window``'s max is a select-and-scatter, measured 7x slower there than
the gradient of the same pooling written as a reshape and a max (pfl-research's CNN's 2x2 pool
of 28 x 28 x 64, 2 unrolled lanes of 10 images in a ``fori_loop``: 32.5 ms against 4.7 ms a
step, one run on the 2-core CPU at load average 13).

:func:`rewritten` removes both at trace time: it traces the model's forward pass to a jaxpr and
evaluates that jaxpr again with

- every ``conv_general_dilated`` that :func:`supported` accepts (the 1-D and 2-D
  channels-last convolutions ``nn.Conv`` emits, with any padding, stride, kernel dilation and
  feature-group count) computed by :func:`deltafl_jax.models.conv.conv_general`: the same
  XLA forward convolution, the weight gradient as an im2col matrix product and the input
  gradient as an ordinary convolution; anything else (input dilation, batch groups, an explicit
  precision or output type, 3-D) is XLA's own, unchanged;
- every max ``reduce_window`` whose windows do not overlap (window = stride, no padding or
  dilation: ``nn.max_pool(x, (k, k), strides=(k, k))``) computed as a reshape and a max, with a
  gradient that routes each window's cotangent to its first maximal element, the element that
  XLA's select-and-scatter picks, so values and gradients are unchanged even at ties
  (overlapping windows keep XLA's own: for a 3x3 stride-2 SAME pool of 24 x 24 x 64 in 2
  lanes, a max of strided slices with the same first-maximum gradient measured 26.5 ms a step
  against XLA's 15.2 ms);

and every other operation bound as it was (the jaxprs of nested ``jit`` calls that hold such
operations are evaluated the same way, inline). A forward pass without them runs as it is.

With ``impl="winograd"`` (the CPU default of a registered convolutional model, as of the
built-in ``pfl_cnn`` and ``resnet18_gn``) the rewrite also gives a model of one's own the
built-in networks' other CPU paths, by what each operand depends on (tracked from the
parameters, the first argument, through every equation):

- a convolution whose input does not depend on the parameters (a first layer, on the data) is
  one im2col product whose patches its weight gradient reuses
  (:func:`~deltafl_jax.models.conv.conv_patches_kept`,
  :func:`~deltafl_jax.models.image_conv.input_layer_impl`): its input gradient, which nothing
  reads, is dropped, and over 1-3 input channels Winograd's products are narrow;
- a product [B, N] x [N, M] (``nn.Dense``) whose second operand depends on the parameters,
  for B <= :data:`~deltafl_jax.models.dense.OUTER_MAX_BATCH`, takes its weight gradient as
  the sum of the B outer products (:func:`~deltafl_jax.models.dense.matmul_outer_grad`), which
  XLA fuses into the optimizer's update.

Why a rewrite of the traced program rather than a drop-in module: a user's network, the guides'
examples and networks copied from elsewhere are written with Flax's layers (or ``lax`` itself);
a module of the project's own would leave each of them slow until rewritten, and would rename
their parameters. The rewrite keeps the module tree, the parameters' names, shapes and
initialisers and the forward values, and changes only how the backward pass is computed.
:meth:`deltafl_jax.models.Model.apply` runs every model through it with the model's
``conv_impl`` (``--conv_impl``; unset: :func:`~deltafl_jax.models.default_conv_impl` of the
backend), so the lanes, the evaluations and serving all see it; ``conv_impl="xla"`` runs the
module as it is. The built-in convolutional networks call
:func:`~deltafl_jax.models.conv.conv_general` directly, the same function.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator, Optional

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax

from deltafl_jax.models.conv import (CONV_IMPLS, conv_fast, conv_patches_kept, explicit_pads,
                                     im2col_forward)
from deltafl_jax.models.dense import OUTER_MAX_BATCH, matmul_outer_grad
from deltafl_jax.models.image_conv import input_layer_impl

_SPECS = {3: ("NWC", "WIO", "NWC"), 4: ("NHWC", "HWIO", "NHWC")}


def _channels_last(lhs, rhs, dimension_numbers) -> bool:
    spec = _SPECS.get(lhs.ndim)
    if spec is None or rhs.ndim != lhs.ndim:
        return False
    return (lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) ==
            lax.conv_dimension_numbers(lhs.shape, rhs.shape, spec))


def supported(lhs, rhs, lhs_dilation=None, dimension_numbers=None, batch_group_count=1,
              precision=None, preferred_element_type=None) -> bool:
    """Whether :func:`fast_conv_general_dilated` takes the fast path for these arguments."""
    return (_channels_last(lhs, rhs, dimension_numbers)
            and all(d == 1 for d in (lhs_dilation or ()))
            and batch_group_count == 1 and precision is None and preferred_element_type is None)


def _as_2d(lhs, rhs, window_strides, padding, rhs_dilation):
    """A 1-D convolution as a 2-D one over a unit first spatial axis."""
    if not isinstance(padding, str):
        padding = ((0, 0),) + tuple(tuple(p) for p in padding)
    return lhs[:, None], rhs[None], (1,) + tuple(window_strides), padding, \
        (1,) + tuple(rhs_dilation)


def fast_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                              rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                              batch_group_count=1, precision=None, preferred_element_type=None,
                              impl: str = "im2col_wgrad"):
    """``lax.conv_general_dilated``'s signature: the fast path of
    :func:`~deltafl_jax.models.conv.conv_general` where :func:`supported`, XLA's own
    otherwise. `impl="im2col"` computes a one-group forward as a matrix product too;
    `impl="winograd"` a 3 x 3 stride-1 one-group convolution by
    :func:`~deltafl_jax.models.conv.conv_winograd`; `impl="patches_kept"` an undilated
    one-group convolution by :func:`~deltafl_jax.models.conv.conv_patches_kept`."""
    if not supported(lhs, rhs, lhs_dilation, dimension_numbers, batch_group_count, precision,
                     preferred_element_type):
        return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation,
                                        rhs_dilation, dimension_numbers, feature_group_count,
                                        batch_group_count, precision, preferred_element_type)
    one_d = lhs.ndim == 3
    dilation = tuple(rhs_dilation or (1,) * (lhs.ndim - 2))
    x, w, strides, pad, dilation = ((lhs, rhs, tuple(window_strides), padding, dilation)
                                    if not one_d else
                                    _as_2d(lhs, rhs, window_strides, padding, dilation))
    pads = explicit_pads(pad, w.shape[:2], strides, dilation, x.shape[1:3])
    if impl == "im2col" and feature_group_count == 1:
        y = im2col_forward(x, w, strides, pads, dilation)
    elif impl == "patches_kept" and feature_group_count == 1 and dilation == (1, 1):
        y = conv_patches_kept(x, w, strides, pads)
    else:
        y = conv_fast(x, w, strides, pads, dilation, int(feature_group_count), impl)
    return y[:, 0] if one_d else y


def _window_view(x, window):
    """x cropped to whole windows and reshaped to [..., n_i, w_i, ...] per axis."""
    out = [n // w for n, w in zip(x.shape, window)]
    x = x[tuple(slice(0, o * w) for o, w in zip(out, window))]
    return x.reshape(tuple(v for o, w in zip(out, window) for v in (o, w)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def max_pool_disjoint(x, window):
    """Max over non-overlapping windows (`window` per axis, stride = window, no padding): the
    value of ``lax.reduce_window(x, -inf, lax.max, window, window, "VALID")``."""
    return _window_view(x, window).max(axis=tuple(range(1, 2 * x.ndim, 2)))


def _pool_fwd(x, window):
    return max_pool_disjoint(x, window), x


def _pool_bwd(window, x, g):
    """Each window's cotangent to its first maximal element (in row-major window order, as
    XLA's select-and-scatter with ``ge``); zero to the cropped border."""
    view = _window_view(x, window)
    axes = tuple(range(1, 2 * x.ndim, 2))
    keep = tuple(range(0, 2 * x.ndim, 2))
    perm = keep + axes
    flat = jnp.transpose(view, perm)
    outer = flat.shape[:x.ndim]
    flat = flat.reshape(outer + (-1,))
    first = jax.nn.one_hot(jnp.argmax(flat, axis=-1), flat.shape[-1], dtype=g.dtype)
    dflat = (first * g[..., None]).reshape(outer + tuple(window))
    dview = jnp.transpose(dflat, tuple(int(i) for i in np.argsort(perm)))
    dx = dview.reshape(tuple(o * w for o, w in zip(outer, window)))
    return (jnp.pad(dx, tuple((0, n - m) for n, m in zip(x.shape, dx.shape))),)


max_pool_disjoint.defvjp(_pool_fwd, _pool_bwd)


def _disjoint_pool(params) -> bool:
    return (tuple(params["window_dimensions"]) == tuple(params["window_strides"])
            and all(tuple(p) == (0, 0) for p in params["padding"])
            and all(d == 1 for d in params["base_dilation"])
            and all(d == 1 for d in params["window_dilation"]))


_DENSE_CONTRACTION = ((1,), (0,))          # [B, N] x [N, M]


def _outer_grad_product(lhs, rhs, p, rhs_on_params: bool) -> bool:
    """Whether a ``dot_general`` is a small minibatch's dense layer (module docstring)."""
    return (rhs_on_params and lhs.ndim == 2 and rhs.ndim == 2
            and tuple(map(tuple, p["dimension_numbers"][0])) == _DENSE_CONTRACTION
            and not any(p["dimension_numbers"][1]) and lhs.shape[0] <= OUTER_MAX_BATCH
            and p.get("precision") is None and lhs.dtype == rhs.dtype
            and p.get("preferred_element_type") in (None, lhs.dtype))


def _replacement(eqn, invals, on_params, impl: str):
    """The fast computation of `eqn` on `invals` (`on_params`: whether each depends on the
    parameters), or None to bind it as it is."""
    name, p = eqn.primitive.name, eqn.params
    if name == "conv_general_dilated" and p.get("out_sharding") is None:
        lhs, rhs = invals
        if supported(lhs, rhs, p["lhs_dilation"], p["dimension_numbers"],
                     p["batch_group_count"], p["precision"], p["preferred_element_type"]):
            first = impl == "winograd" and not on_params[0]
            return fast_conv_general_dilated(
                lhs, rhs, p["window_strides"], p["padding"], p["lhs_dilation"],
                p["rhs_dilation"], p["dimension_numbers"], p["feature_group_count"],
                impl=input_layer_impl(impl) if first else impl)
    if name == "reduce_window_max" and _disjoint_pool(p):
        return max_pool_disjoint(invals[0], tuple(p["window_dimensions"]))
    if (name == "dot_general" and impl == "winograd"
            and _outer_grad_product(*invals, p, on_params[1])):
        return matmul_outer_grad(*invals)
    return None


def _is_target(eqn, impl: str) -> bool:
    """Whether :func:`_replacement` may replace `eqn` (the kind of operation; its shapes decide)."""
    return eqn.primitive.name == "conv_general_dilated" or (
        eqn.primitive.name == "reduce_window_max" and _disjoint_pool(eqn.params)) or (
        eqn.primitive.name == "dot_general" and impl == "winograd")


def _replaceable(jaxpr, impl: str) -> bool:
    """Whether :func:`_evaluate` would consider replacing anything in `jaxpr`: a target among
    its equations or those of its nested ``jit`` calls (not inside custom-derivative calls,
    such as the built-in networks' own fast convolutions, which stay as they are)."""
    return any(_is_target(e, impl) or (e.primitive.name in ("jit", "pjit")
                                       and _replaceable(e.params["jaxpr"].jaxpr, impl))
               for e in jaxpr.eqns)


def _evaluate(jaxpr, consts, args, on_params, impl: str):
    """Evaluate `jaxpr` on `args` with :func:`_replacement`'s computations; `on_params`:
    whether each of `args` depends on the parameters. Returns (outputs, whether each does)."""
    env, dep = {}, {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    def depends(v):
        return False if isinstance(v, jcore.Literal) else dep[v]

    for v, a in zip(jaxpr.constvars, consts):
        env[v], dep[v] = a, False
    for v, a, d in zip(jaxpr.invars, args, on_params):
        env[v], dep[v] = a, d
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        indeps = [depends(v) for v in eqn.invars]
        outdeps = [any(indeps)] * len(eqn.outvars)
        if (eqn.primitive.name in ("jit", "pjit")
                and _replaceable(eqn.params["jaxpr"].jaxpr, impl)):
            inner = eqn.params["jaxpr"]
            outs, outdeps = _evaluate(inner.jaxpr, inner.consts, invals, indeps, impl)
        else:
            outs = _replacement(eqn, invals, indeps, impl)
            if outs is None:
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, o, d in zip(eqn.outvars, outs, outdeps):
            env[v], dep[v] = o, d
    return [read(v) for v in jaxpr.outvars], [depends(v) for v in jaxpr.outvars]


def rewritten(fn: Callable, impl: Optional[str]) -> Callable:
    """`fn(params, *inputs)` with its convolutions, max-poolings and (under "winograd") small
    dense products on the fast path of `impl` ("im2col_wgrad", "winograd" or "im2col"; module
    docstring); "xla" and None: `fn` itself. The first argument holds the parameters."""
    if impl is not None and impl not in CONV_IMPLS:
        raise ValueError(f"unknown conv impl {impl!r}; expected one of {', '.join(CONV_IMPLS)}")
    if impl in (None, "xla"):
        return fn

    def run(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        if not _replaceable(closed.jaxpr, impl):
            return fn(*args)
        params = len(jax.tree.leaves(args[0]))
        leaves = jax.tree.leaves(args)
        outs, _ = _evaluate(closed.jaxpr, closed.consts, leaves,
                            [i < params for i in range(len(leaves))], impl)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def equations(jaxpr) -> Iterator:
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def has_convolution(module, example) -> bool:
    """Whether the forward pass of a Flax `module` on `example` (an array or
    ``jax.ShapeDtypeStruct`` with a batch axis) runs a convolution; traced, not run."""
    def forward(x):
        variables = module.init(jax.random.key(0), x)
        return module.apply(variables, x)

    jaxpr = jax.make_jaxpr(forward)(example)
    return any(e.primitive.name == "conv_general_dilated" for e in equations(jaxpr.jaxpr))
