"""The models by name: the built-in ones, the text models (resolved on first use) and the ones
registered with :func:`register_model`; :func:`build_model` builds one for a dataset."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Dict

import flax
import jax

from deltafl_jax.data import FederatedDataset
from deltafl_jax.models import builtin
from deltafl_jax.models.conv_intercept import has_convolution
from deltafl_jax.models.model import Model, ModelOptions

LINEAR_MODELS = ("linear", "sent140_linear")
REGRESSION_MODELS = ("mean",)   # their "error" is the squared loss (no accuracy)

MODELS: Dict[str, Callable[[FederatedDataset, ModelOptions], Model]] = {
    "linear": builtin.linear,
    "cnn": builtin.cnn,
    "mlp": builtin.mlp,
    "mean": builtin.mean,
}

# Resolved on first use: "module:function" taking (dataset, options) -> Model.
LAZY_MODELS: Dict[str, str] = {
    "gru": "deltafl_jax.models.text:gru",
    "lstm": "deltafl_jax.models.text:lstm",
    "sent140_linear": "deltafl_jax.models.text:sent140_linear",
    "lstm_nwp": "deltafl_jax.models.text:lstm_nwp",
    "fedavg_cnn": "deltafl_jax.models.image:fedavg_cnn",
    "pfl_cnn": "deltafl_jax.models.image:pfl_cnn",
    "resnet18_gn": "deltafl_jax.models.image:resnet18_gn",
    "llama": "deltafl_jax.models.llm:llama_model",
}


# XLA flags a built-in model needs on a GPU, added to XLA_FLAGS by the command line before JAX
# starts its backend (:func:`gpu_xla_flags`). ResNet-18-GN's round makes XLA:GPU's Triton GEMM
# tiling pass abort the process (jax 0.11.2: ``triton_tiling_propagation.cc: Check failed:
# subdim_size_accumulator == dim_size (256 vs. 32)``, with --conv_impl=xla too); with Triton's
# GEMMs off its products go to cuBLAS and the round compiles and runs (measured on one H200,
# docs/benchmarks/accelerators.md). The CPU and TPU compilers do not read these flags.
GPU_XLA_FLAGS: Dict[str, tuple] = {
    "resnet18_gn": ("--xla_gpu_enable_triton_gemm=false",),
}


def gpu_xla_flags(xla_flags: str, model: str) -> str:
    """`xla_flags` with the GPU flags that built-in `model` needs (:data:`GPU_XLA_FLAGS`) added,
    each unless the flags already set it (the user's value wins)."""
    for flag in GPU_XLA_FLAGS.get(model, ()):
        if flag.split("=")[0] not in xla_flags:
            xla_flags = f"{xla_flags} {flag}".strip()
    return xla_flags


def model_names():
    return sorted(set(MODELS) | set(LAZY_MODELS))


BUILT_IN = frozenset(MODELS) | frozenset(LAZY_MODELS)


def register_model(name: str, factory: Callable[[FederatedDataset, ModelOptions], Model],
                   replace: bool = False) -> None:
    """Make ``--model=name`` build ``factory(data, options)``: your own model, a
    :class:`Model` around a Flax module (e.g. ``loss_kind="custom"`` with its ``loss_fn``).
    Register it before the run (and before ``load_model`` of one of its runs, which rebuilds
    the network by name). ValueError for a built-in name, or a registered one unless
    `replace`."""
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"a model name is a non-empty string without surrounding spaces, got "
                         f"{name!r}")
    if name in BUILT_IN:
        raise ValueError(f"model {name!r} is built in; register yours under another name")
    if name in MODELS and not replace:
        raise ValueError(f"model {name!r} is registered already (pass replace=True)")
    if not callable(factory):
        raise ValueError(f"register_model({name!r}, ...): the factory must be callable")
    MODELS[name] = factory


def _convolves(model: Model, data: FederatedDataset) -> bool:
    """Whether a registered `model`'s forward pass on one of its examples runs a convolution:
    traced, not run. A forward pass that cannot take the examples' shape (a 2-D convolution
    on flat features) is a ValueError naming the model, the shape and the dataset, with the
    first line of what JAX or Flax said."""
    example = jax.ShapeDtypeStruct((1,) + tuple(model.example_shape), model.input_dtype)
    try:
        return has_convolution(model.module, jax.eval_shape(model.preprocess, example))
    except (TypeError, ValueError, flax.errors.FlaxError) as e:
        said = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"model {model.name!r} cannot take {data.name}'s examples of shape "
            f"{tuple(model.example_shape)} ({model.input_dtype}): its forward pass fails with "
            f"\"{said.strip()}\"; give it a dataset of the shape it expects, or reshape the "
            f"input in its module") from None


def _completed(model: Model, options: ModelOptions, convolves) -> Model:
    """`model` with its ``conv_impl`` and its ``compute_dtype`` (``--compute_dtype``, for
    every model, built in or registered) from `options` unless its factory set them; a
    registered model's CPU lane choices that its preferences leave unset filled in by
    whether its forward pass has a convolution (`convolves`, None for a built-in model;
    :meth:`LanePreferences.filled`). float32 leaves ``compute_dtype`` None: the model as
    it was."""
    if convolves is not None and model.lanes.unset:
        model = dataclasses.replace(model, lanes=model.lanes.filled(convolves))
    if model.conv_impl is None and (options.conv_impl or options.conv_backend):
        model = dataclasses.replace(model, conv_impl=options.conv_impl_for(model.lanes))
    if model.compute_dtype is None and options.compute_dtype not in (None, "float32"):
        model = dataclasses.replace(model, compute_dtype=options.compute_dtype)
    return model


def build_model(name: str, data: FederatedDataset, options: ModelOptions = ModelOptions()) -> Model:
    """The model `name` for `data`, completed by :func:`_completed`.
    Raises ValueError for an unknown name (saying how a model of one's own is
    registered) or a mismatch."""
    if name in MODELS:
        model = MODELS[name](data, options)
        return _completed(model, options, _convolves(model, data) if name not in BUILT_IN
                          else None)
    if name in LAZY_MODELS:
        module_name, fn_name = LAZY_MODELS[name].split(":")
        factory = getattr(importlib.import_module(module_name), fn_name)
        return _completed(factory(data, options), options, None)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(model_names())}, or "
                     f"register yours first: import the module that calls "
                     f"deltafl_jax.register_model({name!r}, ...) (on the command line: "
                     f"--model_module=MODULE_OR_FILE)")
