"""The clients' examples, where the placement keeps them, and the device work that reads them.

With ``--client_data=device`` both splits sit on every device, each round's plan indexes the
training split, and an evaluation is one pass over a split's stream. With
``--client_data=host`` the host keeps the splits (in memory, or generated on demand:
:class:`deltafl_jax.data.GeneratedClientData`): each round ships a buffer of the sampled
clients' examples with a plan that indexes it (:func:`deltafl_jax.sampling.plan.pack_round`), and an
evaluation ships its stream in blocks whose sums carry from one block to the next
(:func:`deltafl_jax.engine.evaluate_streams` with ``init``). The device computes the same
numbers from the same examples either way: on one device the two modes agree bit for bit
(tests/test_client_data.py); with a mesh the evaluation's sums are reduced per block, so the
modes agree to float summation order.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax import engine
from deltafl_jax.data import FederatedDataset
from deltafl_jax.engine import mesh as mesh_lib
from deltafl_jax.models import Model
from deltafl_jax.run.placement import Placement
from deltafl_jax.sampling import plan as plan_lib


def eval_program(model: Model, place: Placement, num_segments: int, mesh=None) -> Callable:
    """One jitted evaluation of R models over a stream of up to `num_segments` clients:
    (params, x, y, idx, seg, length, loss0, err0) -> (loss_sum, err_sum), each [R, S], the
    stream's sums added to (loss0, err0); its chunks dealt across the devices of `mesh`."""
    axis = mesh_lib.SINGLE if mesh is None else mesh_lib.DeviceAxis(place.devices,
                                                                    mesh_lib.AXIS)

    def eval_fn(params, x, y, idx, seg, length, loss0, err0):
        group = jnp.zeros((jax.tree.leaves(params)[0].shape[0],), jnp.int32)
        res = engine.evaluate_streams(
            model, params, x, y, engine.EvalStreams(idx, seg, length, num_segments), group,
            engine.EvalLayout(place.eval_chunk, place.eval_lanes, axis), init=(loss0, err0))
        return res.loss_sum, res.error_sum
    return jax.jit(eval_fn if mesh is None else mesh_lib.sharded(eval_fn, mesh, 8))


def _labels(split, n: int) -> np.ndarray:
    return (np.zeros((n,), np.int32) if split.y is None else split.y.astype(np.int32))


class ClientStore:
    """The splits of `data` on the devices or on the host (``place.client_data``)."""

    def __init__(self, data: FederatedDataset, model: Model, place: Placement,
                 caps: plan_lib.Capacities, mesh=None):
        self.data, self.model, self.place, self.caps, self.mesh = data, model, place, caps, mesh
        self.host = place.client_data == "host"
        self._programs: Dict[int, Callable] = {}
        self.device_splits = {}
        if not self.host:
            self.device_splits = {name: self.put((split.x, _labels(split, split.num_examples)))
                                  for name, split in self._splits()}
        self._full_segments = max(data.train.num_clients, data.test.num_clients)
        self._block_idx = None

    def _splits(self):
        return (("train", self.data.train), ("test", self.data.test))

    def put(self, tree):
        """Host values on the device(s): replicated over the mesh when there is one."""
        return jax.device_put(tree) if self.mesh is None else mesh_lib.replicate(tree, self.mesh)

    def program(self, num_segments: int) -> Callable:
        if num_segments not in self._programs:
            self._programs[num_segments] = eval_program(self.model, self.place, num_segments,
                                                        self.mesh)
        return self._programs[num_segments]

    # ---- rounds ---------------------------------------------------------------------------

    def round_data(self, plan: plan_lib.RoundPlan) -> plan_lib.RoundData:
        """A round's plan (packed when the host keeps the split) and the examples it reads,
        on the device(s)."""
        if self.host:
            x, y = self.put(plan_lib.pack_round(self.data.train, plan.clients, self.caps,
                                                plan.sizes))
        else:
            x, y = self.device_splits["train"]
        return plan_lib.RoundData(x=x, y=y, plan=self.put(plan))

    # ---- evaluation -----------------------------------------------------------------------

    def stream_sums(self, params, name: str, clients: Optional[np.ndarray] = None
                    ) -> Tuple[np.ndarray, np.ndarray]:
        """(loss_sum, err_sum) [R, K] over the examples of split `name`'s `clients` (None:
        every client, K = N), on the host as float32."""
        split = dict(self._splits())[name]
        R = jax.tree.leaves(params)[0].shape[0]
        if clients is None and not self.host:
            return self._whole_split(params, name, split, R)
        clients = np.arange(split.num_clients) if clients is None else np.asarray(clients)
        S = self._full_segments if len(clients) == split.num_clients else len(clients)
        run = self.program(S)
        acc = self.put((np.zeros((R, S), np.float32), np.zeros((R, S), np.float32)))
        sizes = split.sizes[clients]
        starts = np.cumsum(sizes) - sizes
        rows = None if self.host else split.rows(clients)
        for block in plan_lib.stream_blocks(sizes, self.place.eval_block, S):
            x, y, idx = self._block(split, name, clients, starts, block, rows)
            acc = run(params, x, y, idx, self.put(block.seg), self.put(block.length), *acc)
        loss, err = mesh_lib.tree_to_host(acc)
        return np.asarray(loss)[:, :len(clients)], np.asarray(err)[:, :len(clients)]

    def _whole_split(self, params, name, split, R):
        """One pass over the device-resident split (its plan built once)."""
        key = f"plan_{name}"
        if key not in self.device_splits:
            self.device_splits[key] = self.put(plan_lib.make_split_plan(
                split.offsets, self.place.eval_chunk, self._full_segments))
        sp = self.device_splits[key]
        x, y = self.device_splits[name]
        zeros = self.put(np.zeros((R, self._full_segments), np.float32))
        loss, err = mesh_lib.tree_to_host(self.program(self._full_segments)(
            params, x, y, sp.eval_idx, sp.eval_seg, sp.eval_len, zeros, zeros))
        k = split.num_clients
        return np.asarray(loss)[:, :k], np.asarray(err)[:, :k]

    def _block(self, split, name, clients, starts, block, rows):
        """(x, y, idx) of one block: gathered on the host, or indices into the device split."""
        B = self.place.eval_block
        if not self.host:
            idx = np.zeros((1, B), np.int32)
            idx[0, :block.hi - block.lo] = rows[block.lo:block.hi]
            x, y = self.device_splits[name]
            return x, y, self.put(idx)
        before = int(starts[block.first])
        xs, ys = split.gather(clients[block.first:block.last])
        lo, hi = block.lo - before, block.hi - before
        x = np.zeros((B,) + tuple(split.feature_shape), split.x_dtype)
        y = np.zeros((B,), np.int32)
        x[:hi - lo] = xs[lo:hi]
        if ys is not None:
            y[:hi - lo] = ys[lo:hi]
        if self._block_idx is None:
            self._block_idx = self.put(np.arange(B, dtype=np.int32)[None])
        return self.put(x), self.put(y), self._block_idx
