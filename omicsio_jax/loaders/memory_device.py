"""`DevicePanel`: an `InMemoryPanel` placed once on the devices, for `make_memory_loader(on_device=True)`.

The panel's cells are dealt to the devices by the permutation ``default_rng([seed,
PLACEMENT_STREAM])`` and placed sharded along cells with ``NamedSharding(mesh, P(axis))``. Each
epoch every device permutes its own cells (``default_rng([seed, epoch, device])``, uploaded as
one small int32 array per epoch) and a jitted gather draws each step's rows where they live,
tallying their coverage on the devices in the same call. The `MemoryLoader` keeps the position
(epoch, step) and the state; this module keeps where the cells are and which of them each step
draws.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from omicsio_jax.loaders.memory_panel import InMemoryPanel
from omicsio_jax.loaders.options import Placement
from omicsio_jax.outputs.batch import Batch, data_sharding
from omicsio_jax.sampling.coverage import Tally, device_tally, tally_from_device

PLACEMENT_STREAM = 0x5EED  # the rng stream that deals cells to devices (on_device=True)


@functools.partial(jax.jit, static_argnames=("rows",), donate_argnums=3)
def _draw(arrays, perm, step, acc, *, rows):
    """Each device gathers ``rows`` of its own cells: ``arrays`` leaves are (devices, L, ...) and
    ``perm`` is (devices, L), both sharded on axis 0; results are flattened to (devices × rows, ...).
    ``acc`` (devices, 3) uint32 gets each device's coverage tally of the rows it drew, in the same call.
    Each call makes its own ``mask`` (every row drawn is a cell): a batch's arrays are its own, so a
    step that donates one batch leaves the next ones whole."""
    idx = jax.lax.dynamic_slice_in_dim(perm, step * rows, rows, axis=1)

    def take(a):
        return jax.vmap(lambda local, i: jnp.take(local, i, axis=0, mode="clip"))(a, idx)  # in bounds

    picked = jax.tree.map(take, arrays)
    index = picked["index"]
    acc = acc + jax.vmap(lambda i: jnp.stack(device_tally(i, i >= 0)))(index)
    drawn = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), picked)
    return {**drawn, "mask": drawn["index"] >= 0}, acc


class DevicePanel:
    """``panel`` on the devices of ``placement``, each drawing ``batch_size / devices`` of its own
    cells a step; `batch` draws a step's batch, `served` and `planned` tally its coverage."""

    def __init__(self, panel: InMemoryPanel, *, batch_size: int, seed: int, placement: Placement):
        self.panel, self.seed = panel, seed
        self.mesh, self.data_axis = placement.mesh, placement.data_axis
        n = panel.num_cells
        devices = 1 if self.mesh is None else int(self.mesh.shape[self.data_axis])
        deal = np.random.default_rng([seed, PLACEMENT_STREAM]).permutation(n)
        self._parts = parts = np.array_split(deal, devices)
        self._valid = np.array([len(p) for p in parts])
        rows_local = batch_size // devices
        self.steps_per_epoch = int(self._valid.min()) // rows_local
        self.num_devices, self.rows_local, self.length = devices, rows_local, max(int(self._valid.max()), 1)
        sharding = data_sharding(self.mesh, self.data_axis)
        self.local_devices = sorted(
            {index[0].start or 0 for index in sharding.addressable_devices_indices_map((devices,)).values()}
        )

        def put(column: np.ndarray, fill) -> jax.Array:
            def shard(index) -> np.ndarray:
                d = index[0].start or 0
                part = parts[d]
                out = np.full((1, self.length, *column.shape[1:]), fill, column.dtype)
                out[0, : len(part)] = column[part]
                return out

            return jax.make_array_from_callback((devices, self.length, *column.shape[1:]), sharding, shard)

        self.arrays = {
            "x": put(panel.x, 0),
            "index": put(panel.rowids.astype(np.int32), -1),
            "obs": {k: put(v, -1 if v.dtype.kind in "iu" else np.nan) for k, v in panel.obs.items()},
        }
        self._perm_epoch, self._perm = None, None
        self.reset_tally()

    def order(self, epoch: int, device: int) -> np.ndarray:
        """The order in which device ``device`` draws its own cells in ``epoch`` (positions in its share)."""
        return np.random.default_rng([self.seed, epoch, device]).permutation(self._valid[device])

    def rows(self, epoch: int, device: int) -> np.ndarray:
        """Panel rows device ``device`` draws in ``epoch``, in order."""
        return self._parts[device][self.order(epoch, device)]

    def batch(self, epoch: int, step: int) -> Batch:
        """Batch ``step`` of ``epoch``, drawn on the devices; its cells join the tally (`served`)."""
        if self._perm_epoch != epoch:
            perms = np.zeros((self.num_devices, self.length), np.int32)
            for d in range(self.num_devices):
                perms[d, : self._valid[d]] = self.order(epoch, d)
            self._perm = jax.make_array_from_callback(
                perms.shape, data_sharding(self.mesh, self.data_axis), lambda index: perms[index]
            )
            self._perm_epoch = epoch
        out, self._acc = _draw(self.arrays, self._perm, step, self._acc, rows=self.rows_local)
        return Batch(out["x"], out["obs"], out["index"], out["mask"])

    # ----- coverage ----------------------------------------------------------------------------
    def reset_tally(self) -> None:
        """Zero the devices' tally of the cells drawn (at placement and each new epoch or restore)."""
        zeros = np.zeros((self.num_devices, 3), np.uint32)
        self._acc = jax.make_array_from_callback(
            zeros.shape, data_sharding(self.mesh, self.data_axis), lambda index: zeros[index]
        )

    def served(self) -> Tally:
        """This process's devices' tally of the cells drawn since `reset_tally`."""
        # one shard per data-axis index: on a mesh with more axes, a shard's replicas (along
        # the others) hold the same tally, and `planned` counts each data shard once
        shards = {s.index[0].start or 0: s for s in self._acc.addressable_shards}
        local = sum(
            (np.asarray(s.data, np.uint64).reshape(-1, 3) for s in shards.values()),
            np.zeros(3, np.uint64),
        ).reshape(-1)
        return tally_from_device(*local.tolist())

    def planned(self, epoch: int) -> Tally:
        """The cells this process's devices draw in ``epoch``."""
        rows = np.concatenate(
            [self.rows(epoch, d)[: self.steps_per_epoch * self.rows_local] for d in self.local_devices]
        )
        return Tally.of(self.panel.rowids[rows])
