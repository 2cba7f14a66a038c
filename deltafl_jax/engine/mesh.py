"""The device mesh: one round across every device of one or many machines.

With D > 1 devices the round is ``jit(shard_map(round_fn))`` over a 1-D mesh (axis
``"devices"``). The state, the training split and the round plan are replicated; the client
work is dealt across D x c global lanes (:func:`deltafl_jax.engine.lanes.deal_jobs`,
evaluation items round-robin), each device runs its own while loops to its own trip counts, and
the partial sums are reduced once after the loops (``psum``; the jobs' updates cross the
devices through D - 1 collective permutes instead,
:func:`deltafl_jax.engine.lanes.device_ordered_sum`, a big leaf's in chunks, in a loop of the
same trip count on every device; no collective inside the lanes' loops, whose trip counts
differ).
The filter and the server update then run identically on every device. With D = 1 none of
this is used, and the round is the plain jitted function.

On a CPU, JAX shows one device for the whole host. :func:`host_device_flags` asks XLA for
D host devices instead (before the backend starts); each then runs its share of the lanes on
its own thread, so the cores work on different clients at once (``--devices=D``; measured in
bench/README.md). The commands ask for one per core unless ``--devices`` is given
(:func:`default_host_devices`).

Multi-host: every process holds the same replicated values; :func:`replicate` builds global
arrays from host values, and :func:`to_host` reads a replicated global array on any process.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "devices"


@dataclasses.dataclass(frozen=True)
class DeviceAxis:
    """How many devices share the client work, and the mesh axis name inside shard_map
    (None when D = 1: no collectives at all)."""

    count: int = 1
    name: Optional[str] = None

    def index(self):
        """This device's index on the axis (0 without a mesh)."""
        return jax.lax.axis_index(self.name) if self.name else 0

    def sum(self, x):
        return jax.lax.psum(x, self.name) if self.name else x

    def max(self, x):
        return jax.lax.pmax(x, self.name) if self.name else x

    def shift(self, x, s: int):
        """Device j's x, on device (j + s) mod D (one collective permute; x itself when
        s = 0 mod D or D = 1)."""
        if not self.name or s % self.count == 0:
            return x
        return jax.lax.ppermute(x, self.name,
                                [(j, (j + s) % self.count) for j in range(self.count)])

    def spread(self, x):
        """[D]: every device's value of the scalar x, in device order (one all-reduce)."""
        x = jax.numpy.asarray(x)
        if not self.name:
            return x[None]
        slot = jax.nn.one_hot(self.index(), self.count, dtype=x.dtype)
        return jax.lax.psum(slot * x, self.name)


SINGLE = DeviceAxis()

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def default_host_devices() -> int:
    """The host devices of a CPU run without ``--devices``: one per core this process may run
    on. A replica's floats do not depend on the device count (each replica adds its clients
    in its own order, :func:`deltafl_jax.engine.lanes.finish_order`), so a run on more cores
    gives the same models bit for bit, sooner."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # not on Linux
        return max(1, os.cpu_count() or 1)


def host_device_flags(xla_flags: str, devices: Optional[int]) -> str:
    """XLA_FLAGS with the host (CPU) platform split into `devices` devices, when more than one
    is asked for and the flags do not already choose a count. Only the CPU platform reads the
    flag: on a GPU or TPU machine it adds unused host devices and changes nothing else. Must be
    applied before JAX starts its backend."""
    if devices is None or devices <= 1 or HOST_DEVICES_FLAG in xla_flags:
        return xla_flags
    return f"{xla_flags} {HOST_DEVICES_FLAG}={int(devices)}".strip()


def make_mesh(devices: int) -> Mesh:
    """A 1-D mesh over the first `devices` devices of every process (all of them: -1)."""
    all_devices = jax.devices()
    count = len(all_devices) if devices in (None, -1, 0) else int(devices)
    if count > len(all_devices):
        raise ValueError(f"--devices={count} but only {len(all_devices)} "
                         f"{jax.default_backend()} device(s) are visible")
    return Mesh(np.array(all_devices[:count]), (AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def replicate(tree, mesh: Mesh):
    """Every leaf as a global array replicated on every device of `mesh` (any process)."""
    sharding = replicated(mesh)

    def put(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = put(jax.random.key_data(x))
            impl = jax.random.key_impl(x)
            return jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl),
                           out_shardings=sharding)(data)
        host = to_host(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree)


def to_host(x) -> np.ndarray:
    """A NumPy copy of a replicated (or single-device) array, on any process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def tree_to_host(tree) -> Any:
    return jax.tree.map(to_host, tree)


def sharded(fn, mesh: Mesh, num_args: int):
    """shard_map of `fn` with every argument and output replicated."""
    specs = tuple(P() for _ in range(num_args))
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
