"""How the engine runs a model's client work, per backend: lanes per step, vmapped or unrolled
lanes, and examples per evaluation work item."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LanePreferences:
    """How the engine runs this model's client work, per backend (measured on a 2-core CPU,
    bench/README.md; on accelerators every sampled client gets a lane).

    cpu_lanes: client lanes per step on CPU.
    cpu_lane_mode: "vmap" (one batched step) or "unroll" (independent unbatched copies, for
      convolutions: a vmap over per-client weights is a grouped convolution, ~5x slower on
      XLA:CPU).
    cpu_eval_chunk / accelerator_eval_chunk: examples per evaluation work item.
    """

    cpu_lanes: int = 2
    cpu_lane_mode: str = "vmap"
    cpu_eval_chunk: int = 2048
    accelerator_eval_chunk: int = 1024

    def lanes(self, m: int, backend: str, devices: int = 1) -> int:
        """Lanes per device. On CPU, unrolled lanes are independent op streams that keep the
        host's cores busy; D > 1 host devices already do that, so each device then runs
        cpu_lanes // D of them (measured: ConvNet, 2 devices x 1 lane 10-16% faster than
        2 x 2, bench/README.md). Vmapped lanes batch one op and keep cpu_lanes."""
        if backend != "cpu":
            return m
        if self.cpu_lane_mode == "unroll":
            return min(m, max(1, self.cpu_lanes // max(1, devices)))
        return min(m, self.cpu_lanes)

    def lane_mode(self, backend: str) -> str:
        return self.cpu_lane_mode if backend == "cpu" else "vmap"

    def eval_chunk(self, backend: str) -> int:
        return self.cpu_eval_chunk if backend == "cpu" else self.accelerator_eval_chunk
