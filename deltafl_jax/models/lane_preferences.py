"""How the engine runs a model's client work, per backend: lanes per step, vmapped or unrolled
lanes, and examples per evaluation work item."""

from __future__ import annotations

import dataclasses
from typing import Optional

DENSE_LANE_MODE, DENSE_EVAL_CHUNK = "vmap", 2048
# Convolutional networks on CPU: a vmap over per-client kernels is a grouped convolution, and
# their activations make large evaluation chunks mostly padding and memory. Measured with
# pfl-research's CIFAR CNN written with nn.Conv on the fast convolution path (the setup of
# bench/own_model_conv.py, 3 rounds each interleaved, 2-core CPU at load average 14): 2
# vmapped lanes and chunks of 2048 took 1.96x the s/round of 2 unrolled lanes and chunks of
# 128; 2 vmapped lanes and chunks of 128, 1.16x.
CONV_LANE_MODE, CONV_EVAL_CHUNK = "unroll", 128
# ... and their convolutions by Winograd with the built-in networks' other CPU paths
# (deltafl_jax.models.conv_intercept), as the built-in pfl_cnn and resnet18_gn: pfl-research's
# CNN written with nn.Conv, nn.max_pool and nn.Dense ran at 0.93-1.01x the built-in pfl_cnn's
# s/round this way, 1.02x on im2col_wgrad (bench/own_model_conv.py, docs/guides/own-model.md);
# a local step of the built-in network took 8.6 ms on winograd against 17.3 ms on im2col_wgrad
# (bench/results/peer_pfl_profile_cpu_tile4.json).
CONV_CPU_IMPL = "winograd"


@dataclasses.dataclass(frozen=True)
class LanePreferences:
    """How the engine runs this model's client work, per backend (measured on a 2-core CPU,
    bench/README.md; on accelerators every job of a round (each replica's sampled clients)
    gets a lane while a device's memory holds them, fewer when it does not: :func:`deltafl_jax.run.placement.fit_lanes`).

    cpu_lanes: client lanes per step on CPU.
    cpu_lane_mode: "vmap" (one batched step) or "unroll" (independent unbatched copies, for
      convolutions: a vmap over per-client weights is a grouped convolution, ~5x slower on
      XLA:CPU). None: "vmap", or "unroll" for a registered model whose forward pass has a
      convolution (:meth:`filled`, which :func:`~deltafl_jax.models.build_model` applies).
    cpu_eval_chunk / accelerator_eval_chunk: examples per evaluation work item. cpu_eval_chunk
      None: 2048, or 128 for a registered convolutional model (as cpu_lane_mode).
    cpu_conv_impl: the convolutions on CPU when --conv_impl is unset ("winograd",
      "im2col_wgrad", ...; :func:`~deltafl_jax.models.default_conv_impl`); None: im2col_wgrad,
      or "winograd" for a registered convolutional model (as cpu_lane_mode).
    """

    cpu_lanes: int = 2
    cpu_lane_mode: Optional[str] = None
    cpu_eval_chunk: Optional[int] = None
    accelerator_eval_chunk: int = 1024
    cpu_conv_impl: Optional[str] = None

    @property
    def unset(self) -> bool:
        """Whether the CPU's lane mode, evaluation chunk or convolutions are left to the
        model's layers."""
        return None in (self.cpu_lane_mode, self.cpu_eval_chunk, self.cpu_conv_impl)

    def filled(self, convolutional: bool) -> "LanePreferences":
        """The unset CPU choices filled in for a model with or without convolutions (a model
        without one keeps cpu_conv_impl None: nothing of it is rewritten)."""
        mode, chunk = ((CONV_LANE_MODE, CONV_EVAL_CHUNK) if convolutional
                       else (DENSE_LANE_MODE, DENSE_EVAL_CHUNK))
        return dataclasses.replace(
            self, cpu_lane_mode=self.cpu_lane_mode or mode,
            cpu_eval_chunk=self.cpu_eval_chunk or chunk,
            cpu_conv_impl=self.cpu_conv_impl or (CONV_CPU_IMPL if convolutional else None))

    def lanes(self, m: int, backend: str, devices: int = 1) -> int:
        """Lanes per device. On CPU, unrolled lanes are independent op streams that keep the
        host's cores busy; D > 1 host devices already do that, so each device then runs
        cpu_lanes // D of them (measured: ConvNet, 2 devices x 1 lane 10-16% faster than
        2 x 2, bench/README.md). Vmapped lanes batch one op and keep cpu_lanes. Elsewhere
        m, which the placement may lower to what the device's memory holds."""
        if backend != "cpu":
            return m
        if self.lane_mode(backend) == "unroll":
            return min(m, max(1, self.cpu_lanes // max(1, devices)))
        return min(m, self.cpu_lanes)

    def lane_mode(self, backend: str) -> str:
        return (self.cpu_lane_mode or DENSE_LANE_MODE) if backend == "cpu" else "vmap"

    def eval_chunk(self, backend: str) -> int:
        return ((self.cpu_eval_chunk or DENSE_EVAL_CHUNK) if backend == "cpu"
                else self.accelerator_eval_chunk)
