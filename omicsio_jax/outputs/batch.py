"""Batch types shared by every loader, and their placement on the devices.

A loader builds a `HostBatch` (this host's rows as numpy arrays) and `place_batch` turns it
into a `Batch` of global jax.Arrays sharded along the mesh's data axis. Both are registered
pytrees, so ``jax.tree.map`` works on them and Grain moves a `HostBatch` out of a worker
process through shared memory, array by array. A `DeviceStep` in a host batch is finished
where the batch lands (a measured-gene mask gathered on the devices from each row's source).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
from typing import Any, NamedTuple

import jax
import numpy as np

from omicsio_jax.core.errors import OmicsIOError


class SparseBatch(NamedTuple):
    """Fixed-shape padded sparse rows, one slab per device: arrays of shape (num_shards, capacity).

    Entry ``j`` of slab ``s`` is ``values[s, j]`` (float32) at row ``row_ids[s, j]`` (within the
    shard's ``batch_size / num_shards`` rows; int16, int32 past 32,767 rows) and column
    ``indices[s, j]`` (uint16 for up to 65,536 genes, else int32); padding entries add 0 at
    (0, 0). `Loader.densify` turns it into the dense batch on the devices. ``sources`` (with
    ``oj.CSR(measured=True)`` over a collection): each row's source, int32 of shape (rows,), -1 for
    padding; ``CSR.measured_mask`` turns it into the rows' masks of measured genes on the devices.
    """

    row_ids: Any
    indices: Any
    values: Any
    sources: Any = None


@dataclasses.dataclass(frozen=True)
class Batch:
    """A global training batch: ``x`` (dense ``(batch, genes)``, `SparseBatch`, or what the output
    kind makes), obs labels, the global row of every cell (``index``, -1 for padding) and ``mask``
    (False for padding)."""

    x: Any
    obs: dict[str, Any]
    index: Any
    mask: Any


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """This host's share of a batch as numpy arrays (what `GrainSource` records and the Grain
    pipelines yield); every array's leading axis is split over this host's devices."""

    x: Any
    obs: dict[str, np.ndarray]
    index: np.ndarray
    mask: np.ndarray


for _cls in (Batch, HostBatch):
    jax.tree_util.register_dataclass(_cls, data_fields=["x", "obs", "index", "mask"], meta_fields=[])


class DeviceStep(abc.ABC):
    """A node of a host batch's ``x`` that `place_batch` finishes on the devices: the arrays of
    `to_place` are placed with every other array of the batch (rows on their leading axis, in
    the same call), then `on_device` makes what the batch serves of them. Subclasses are
    registered pytrees (their arrays travel through Grain like any other)."""

    @abc.abstractmethod
    def to_place(self, sharding: jax.sharding.Sharding) -> Any:
        """This host's arrays to place with ``sharding``: a pytree, rows on every leading axis."""

    @abc.abstractmethod
    def on_device(self, placed: Any) -> Any:
        """What the batch serves, from `to_place`'s pytree placed."""


def _is_step(node: Any) -> bool:
    return isinstance(node, DeviceStep)


def data_sharding(mesh, data_axis: str = "data") -> jax.sharding.Sharding:
    """``NamedSharding(mesh, P(data_axis))``, or the first local device when there is no mesh."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if not isinstance(mesh, jax.sharding.Mesh):
        msg = (
            f"mesh must be a jax.sharding.Mesh or None, got {mesh!r}: for an oj.Placement p, call "
            "p.place(host_batch) or oj.place_batch(host_batch, p.mesh, p.data_axis)"
        )
        raise OmicsIOError(msg)
    if data_axis not in mesh.axis_names:
        msg = f"data_axis={data_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}: pass one of them"
        raise OmicsIOError(msg)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(data_axis))


def place_batch(host_batch: HostBatch | dict, mesh=None, data_axis: str = "data") -> Batch | dict:
    """This host's batch (a `HostBatch` or a dict of numpy arrays) → global jax.Arrays sharded on ``data_axis``.

    >>> auto = (jax.sharding.AxisType.Auto,)  # a train step's gradients need Auto axes    # doctest: +SKIP
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)    # doctest: +SKIP
    >>> for host_batch in grain_loader:                                     # doctest: +SKIP
    ...     batch = oj.place_batch(host_batch, mesh)     # batch.x: (global batch, genes), P("data")

    Every array is split along its leading axis over this host's devices of ``data_axis``; the
    global leading size is the sum over hosts (``jax.make_array_from_process_local_data`` when
    there are several processes; in one, `put_arrays`, the same arrays at a third of the cost).
    On CPU, host buffers aligned to 64 bytes are adopted without a copy (others are copied).
    Without a mesh, the batch goes to the first local device.
    A `DeviceStep` (``oj.Dense(measured=True)``'s ``x``) is finished on the devices.
    """
    nodes, treedef = jax.tree.flatten(host_batch, is_leaf=_is_step)
    steps = {i: node for i, node in enumerate(nodes) if isinstance(node, DeviceStep)}
    sharding = data_sharding(mesh, data_axis)
    leaves, leaf_tree = nodes, treedef  # without a step, the leaves are the nodes
    if steps:
        host_batch = treedef.unflatten(
            [steps[i].to_place(sharding) if i in steps else n for i, n in enumerate(nodes)]
        )
        leaves, leaf_tree = jax.tree.flatten(host_batch)
    try:
        arrays = put_arrays(leaves, sharding)
        if arrays is not None:
            placed = leaf_tree.unflatten(arrays)
        elif mesh is None:
            placed = jax.device_put(host_batch, sharding)  # the first local device
        else:
            # one call for the whole pytree: half the time of one per array, and one hand-off of the GIL
            # instead of one per array (each can wait a 5 ms switch interval while decoding threads run)
            placed = jax.make_array_from_process_local_data(sharding, host_batch)
    except ValueError:  # JAX's, for a batch its devices do not split evenly: said in our terms
        slabs = jax.tree.flatten(host_batch, is_leaf=lambda n: isinstance(n, SparseBatch))[0]
        slab_ids = {
            id(a) for s in slabs if isinstance(s, SparseBatch) for a in (s.row_ids, s.indices, s.values)
        }
        _check_divisible(leaves, mesh, data_axis, slab_ids)
        raise
    if steps:
        parts = treedef.flatten_up_to(placed)
        placed = treedef.unflatten([steps[i].on_device(p) if i in steps else p for i, p in enumerate(parts)])
    return Batch(placed.x, placed.obs, placed.index, placed.mask) if isinstance(placed, HostBatch) else placed


def _check_divisible(leaves: list, mesh, data_axis: str, slabs: set[int] = frozenset()) -> None:
    """Refuse, in one line, a batch whose global leading size (this host's times the processes) the
    devices of ``data_axis`` do not divide. ``slabs``: the ids of the leaves of a `SparseBatch`
    (a csr batch, ``Dense(on_device=True)``'s), whose leading axis is the loader's slab count, not
    rows."""
    if mesh is None:
        return
    devices, hosts = mesh.shape[data_axis], jax.process_count()
    for leaf in leaves:
        size = np.shape(leaf)[0] if np.ndim(leaf) else 1
        if not (size * hosts) % devices:
            continue
        if id(leaf) in slabs:
            msg = (
                f"place_batch: the batch was built as {size} device slab(s), not one per device of the "
                f"{devices} of mesh axis {data_axis!r}: give its loader the mesh (placement=mesh, in "
                "make_loader, make_grain_loader or GrainSource)"
            )
            raise OmicsIOError(msg)
        of = f"{size} rows" if hosts == 1 else f"{size} rows on each of {hosts} processes"
        msg = (
            f"place_batch: a batch of {of} does not split over the {devices} devices of mesh axis "
            f"{data_axis!r}: make the loader's batch_size a multiple of {devices}"
        )
        raise OmicsIOError(msg)


def put_arrays(arrays: list, sharding: jax.sharding.Sharding) -> list[jax.Array] | None:
    """``arrays`` (numpy) as committed jax.Arrays with ``sharding``, each split along its leading
    axis over the devices, by the call that ``jax.device_put`` and
    ``jax.make_array_from_process_local_data`` end in (`_device_put`) without the checks and tree
    handling around it: ~8 µs an array on CPU instead of ~25 (a batch of 64 rows is four to eight
    arrays, placed a thousand times a second). None (use jax's public calls) in a multi-process
    run (the global shape spans processes), for anything but numpy arrays, or where this jax has
    no such call."""
    if _device_put is None or jax.process_count() > 1:
        return None
    if not all(type(a) is np.ndarray and a.dtype.kind in _PLAIN_KINDS for a in arrays):
        return None
    out = []
    for a in arrays:
        dtype = jax.dtypes.canonicalize_dtype(a.dtype)  # int64 → int32 unless x64 is on, as jax's calls do
        if dtype != a.dtype:  # converted here: not every jax's last call converts
            a = a.astype(dtype)
        aval = _aval(a.shape, dtype)
        where = sharding.addressable_devices_indices_map(a.shape)  # device → its slice of ``a``
        shards = [a] if len(where) == 1 else [a[i] for i in where.values()]
        out.append(_device_put(aval, sharding, shards, list(where)))
    return out


_PLAIN_KINDS = frozenset("biuf")  # bool, integers, floats: what a host batch holds


def _private_device_put():
    """jax's ``pxla.batched_device_put`` and ``core.ShapedArray``, if this jax has them with the
    signature `put_arrays` calls (unchanged from jax 0.4.3x to 0.10); else ``(None, None)``."""
    try:
        from jax._src.core import ShapedArray
        from jax._src.interpreters.pxla import batched_device_put
    except ImportError:
        return None, None
    params = list(inspect.signature(batched_device_put).parameters)
    if params[:4] != ["aval", "sharding", "xs", "devices"]:
        return None, None
    return batched_device_put, ShapedArray


_device_put, _ShapedArray = _private_device_put()


@functools.lru_cache(maxsize=256)
def _aval(shape: tuple[int, ...], dtype: np.dtype):
    """The ``ShapedArray`` of ``(shape, dtype)``, made once (~4 µs each time; a batch's shapes repeat)."""
    return _ShapedArray(shape, dtype)


def local_shards(mesh, data_axis: str = "data") -> int:
    """How many slices of a host's batch its devices hold along ``data_axis`` (1 without a mesh)."""
    if mesh is None:
        return 1
    axis = list(mesh.axis_names).index(data_axis)
    local = {d.id for d in mesh.local_devices}
    coords = {idx[axis] for idx, d in np.ndenumerate(mesh.devices) if d.id in local}
    return len(coords)
