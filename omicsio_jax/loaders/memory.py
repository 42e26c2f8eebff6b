"""`make_memory_loader`: batches from an `InMemoryPanel`, on the host or already on the devices.

- host (the default): each epoch is a permutation ``default_rng([seed, epoch])`` of the
  cells, and global batch ``s`` is its slice ``[s·B, (s+1)·B)`` whatever the number of hosts;
  host ``h`` gathers its ``h``-th share with a parallel numba row copy into a 64-byte aligned
  buffer that `place_batch` hands XLA, which adopts it without a copy. A restore onto
  another number of hosts therefore continues the epoch exactly.
- ``on_device=True``: the panel is placed once on the devices, sharded along cells with
  ``NamedSharding(mesh, P(axis))`` (cells dealt to devices by the permutation
  ``default_rng([seed, PLACEMENT_STREAM])``); each epoch every device permutes its own cells
  (``default_rng([seed, epoch, device])``, uploaded as one small int32 array per epoch) and a
  jitted gather draws each step's rows where they live: no host-to-device copy per step and no
  cross-device traffic. Cells left over when a device's share is not a multiple of its batch
  slice sit out that epoch (a different few each epoch).

Both are `grain.DatasetIterator`s that replay exactly from ``(epoch, step)`` plus a fingerprint
of data and config, and audit their coverage (on the devices for ``on_device=True``). The panel on
the devices, its placement and its gather, is `DevicePanel` (`loaders.memory_device`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence

import jax
import numba as nb
import numpy as np

from omicsio_jax.core.buffers import RowBuffers
from omicsio_jax.core.errors import OmicsIOError, StateMismatchError
from omicsio_jax.core.producer import Background
from omicsio_jax.loaders.agreement import check_processes_agree, processes_share
from omicsio_jax.loaders.iterator import ClosingIterator, RunLength
from omicsio_jax.loaders.memory_device import DevicePanel
from omicsio_jax.loaders.memory_panel import InMemoryPanel
from omicsio_jax.loaders.options import (
    Placement,
    ReadOptions,
    check_argument,
    numba_threads,
    numba_threads_in_force,
)
from omicsio_jax.loaders.state import as_json, check_state, check_within_run, process_states, reads_state
from omicsio_jax.outputs.batch import Batch, HostBatch
from omicsio_jax.sampling.coverage import Coverage, Tally

STATE_VERSION = 2


@nb.njit(parallel=True, nogil=True, cache=True)
def _gather_rows(x, rows, out):
    for i in nb.prange(rows.shape[0]):
        out[i, :] = x[rows[i], :]


class MemoryLoader(RunLength, ClosingIterator):
    """Batches from an `InMemoryPanel`; `get_state`/`set_state` resume exactly. Use `make_memory_loader`."""

    def __init__(
        self,
        panel: InMemoryPanel,
        *,
        batch_size: int,
        seed: int,
        num_epochs: int | None,
        on_device: bool,
        drop_remainder: bool,
        placement: Placement,
        prefetch: int,
        decode_threads: int | None = None,
    ):
        super().__init__()
        self._stream = None
        self.panel, self.batch_size, self.seed, self.num_epochs = panel, batch_size, seed, num_epochs
        self.resident = "device" if on_device else "host"  # where the panel lives
        self.placement, self.drop_remainder, self.prefetch = placement, drop_remainder, prefetch
        # the numba threads of a host batch's row copy (`numba_threads_in_force`); none on the devices
        self.decode_threads = None if on_device else numba_threads_in_force(decode_threads)
        self.mesh, self.data_axis = placement.mesh, placement.data_axis
        self.host, self.hosts = placement.host, placement.num_hosts
        hosts = self.hosts
        self.local_batch = batch_size // hosts
        self._epoch, self._step, self._anchor, self._served = 0, 0, 0, Tally()
        self._perm_cache: tuple[int | None, np.ndarray | None] = (None, None)
        self._buffers = RowBuffers(keep=prefetch + 4)
        self._device_panel = (
            DevicePanel(panel, batch_size=batch_size, seed=seed, placement=placement) if on_device else None
        )
        n = panel.num_cells
        self.steps_per_epoch = (
            self._device_panel.steps_per_epoch
            if self._device_panel is not None
            else (n // batch_size if drop_remainder else -(-n // batch_size))
        )
        if processes_share(placement):  # each JAX process must have made this loader
            check_processes_agree(self.config(), "make_memory_loader")

    def __repr__(self) -> str:
        p = self.panel
        where = (
            f"devices={self._device_panel.num_devices}"
            if self._device_panel is not None
            else f"read=ReadOptions(prefetch={self.prefetch}, decode_threads={self.decode_threads})"
        )
        return (
            f"MemoryLoader(panel=[{p.num_cells:,} cells × {p.x.shape[1]:,} genes], batch_size={self.batch_size}, "
            f"on_device={self.resident == 'device'}, seed={self.seed}, num_epochs={self.num_epochs}, "
            f"drop_remainder={self.drop_remainder}, obs={list(p.obs)}, steps_per_epoch={self.steps_per_epoch}, "
            f"{where}, hosts={self.hosts})"
        )

    # ----- state -------------------------------------------------------------------------------
    def config(self) -> dict:
        """What decides the batches. Host placement serves the same global batches on any number of
        hosts, so a restore may change it; device placement deals cells to the devices."""
        return as_json(
            {
                "panel": self.panel.fingerprint[:16],
                "batch_size": self.batch_size,
                "seed": self.seed,
                "num_epochs": self.num_epochs,
                "placement": self.resident,
                "drop_remainder": self.drop_remainder,
                "devices": None if self._device_panel is None else self._device_panel.num_devices,
                "hosts": None if self.resident == "host" else self.hosts,
            }
        )

    def get_state(self) -> dict:
        """``{"version", "config", "epoch", "step", ...}``: the next batch to serve (< 1 KB of JSON)."""
        return {
            "version": STATE_VERSION,
            "config": self.config(),
            "epoch": self._epoch,
            "step": self._step,
            "anchor": self._anchor,
            "process": [self.host, self.hosts],
            "served": self.coverage().served.to_json(),
        }

    @reads_state
    def set_state(self, state: dict | Sequence[dict]) -> None:
        """Resume at ``state`` (or every process's states, for another number of hosts); refuses a
        state of another panel or config, one line per difference."""
        states = process_states(state)
        for s in states:
            check_state(s, STATE_VERSION, self.config())
        check_within_run(states[0], self.num_epochs)
        if len({(s["epoch"], s["step"]) for s in states}) != 1:
            msg = "the processes' states stand at different steps: not one checkpoint"
            raise StateMismatchError(msg)
        count = states[0]["process"][1]
        self._stop_stream()
        self._epoch, self._step = int(states[0]["epoch"]), int(states[0]["step"])
        if count == self.hosts:
            own = next((s for s in states if s["process"][0] == self.host), None)
            if own is None:
                msg = f"no state of process {self.host} among {[s['process'] for s in states]}"
                raise StateMismatchError(msg)
            self._anchor, served = int(own["anchor"]), Tally.from_json(own["served"])
        elif len(states) == count:  # host placement only (the config refuses device placement)
            self._anchor = self._step
            served = Tally()
            if self.host == 0:  # process 0 carries what every process served before
                for s in states:
                    served = served + Tally.from_json(s["served"])
        else:
            msg = (
                f"the checkpoint was written by {count} processes and this run has {self.hosts}: pass all "
                f"{count} states (oj.read_loader_states(directory))"
            )
            raise StateMismatchError(msg)
        self._set_served(served)

    def coverage(self) -> Coverage:
        """This process's served and planned cells of the current epoch (see `Coverage`)."""
        served = self._served
        if self._device_panel is not None:
            served = self._served + self._device_panel.served()
        return Coverage(self._epoch, served, self._planned(self._epoch))

    def _set_served(self, served: Tally) -> None:
        self._served = served
        if self._device_panel is not None:
            self._device_panel.reset_tally()

    def _planned(self, epoch: int) -> Tally:
        if self._device_panel is not None:
            return self._device_panel.planned(epoch)
        perm = self._permutation(epoch)
        b, B = self.local_batch, self.batch_size
        start = self._anchor if epoch == self._epoch else 0
        total = Tally.of(self.panel.rowids[perm[: start * B]]) if (start and self.host == 0) else Tally()
        for step in range(start, self.steps_per_epoch):
            total = total + Tally.of(
                self.panel.rowids[perm[step * B + self.host * b : step * B + (self.host + 1) * b]]
            )
        return total

    # ----- iteration ---------------------------------------------------------------------------
    def __next__(self) -> Batch:
        self._assert_not_closed()
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        if self._device_panel is not None:
            batch = self._device_panel.batch(self._epoch, self._step)
        else:
            try:
                if self.prefetch <= 0:  # gather in the caller's thread
                    hb = self._host_batch(self._rows(self._epoch, self._step))
                else:
                    if self._stream is None:
                        # the producer holds the loader weakly (`_host_batches`), not through a method of it
                        ref, epoch, step = weakref.ref(self), self._epoch, self._step
                        self._stream = Background(
                            lambda: _host_batches(ref, epoch, step), depth=self.prefetch
                        )
                    hb = next(self._stream)
                batch = self.placement.place(hb)
            except BaseException:
                # Nothing of this call counts: a batch that failed (gathered or placed), or one the
                # loop stopped waiting for (KeyboardInterrupt), is made again by the next call, from
                # a prefetch thread restarted at this step (the old one has moved past it, or ended
                # with the error, when it would answer every later call with StopIteration).
                self._stop_stream()
                raise
            self._served = self._served + Tally.of(hb.index)
        self._step += 1
        if self._step >= self.steps_per_epoch:
            self.coverage().check(f"make_memory_loader (process {self.host})")
            self._epoch, self._step, self._anchor = self._epoch + 1, 0, 0
            self._set_served(Tally())
        return batch

    def _stop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def close(self) -> None:
        """Stop the prefetch thread; idempotent."""
        self._stop_stream()
        super().close()

    # ----- host placement ----------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_cache[0] != epoch:
            self._perm_cache = (
                epoch,
                np.random.default_rng([self.seed, epoch]).permutation(self.panel.num_cells),
            )
        return self._perm_cache[1]

    def _rows(self, epoch: int, step: int) -> np.ndarray:
        """This host's cells of batch ``step`` of ``epoch``."""
        lo = step * self.batch_size + self.host * self.local_batch
        return self._permutation(epoch)[lo : lo + self.local_batch]

    def _host_batches(self, epoch: int, step: int) -> Iterator[HostBatch]:
        """The host batches from ``(epoch, step)`` on, while this loader is held (`_host_batches`)."""
        return _host_batches(weakref.ref(self), epoch, step)

    def _host_batch(self, rows: np.ndarray) -> HostBatch:
        n, b = len(rows), self.local_batch
        x = self._buffers.empty((b, self.panel.x.shape[1]))
        with numba_threads(self.decode_threads):
            _gather_rows(self.panel.x, rows, x[:n])
        if n < b:
            x[n:] = 0
        obs = {}
        for name, column in self.panel.obs.items():
            out = np.full(b, -1 if column.dtype.kind in "iu" else np.nan, column.dtype)
            out[:n] = column[rows]
            obs[name] = out
        index = np.full(b, -1, np.int32)
        index[:n] = self.panel.rowids[rows]
        return HostBatch(x, obs, index, np.arange(b) < n)


def _host_batches(ref: weakref.ref[MemoryLoader], epoch: int, step: int) -> Iterator[HostBatch]:
    """The host batches of ``ref``'s loader from ``(epoch, step)`` on, for its prefetch thread. The
    thread holds the loader only while it gathers a batch: a loader let go of without `close` is
    then collected, which stops the thread (holding it, the thread kept the loader and its panel
    alive, waiting to hand over a batch nobody would take)."""
    while True:
        loader = ref()
        if loader is None or (loader.num_epochs is not None and epoch >= loader.num_epochs):
            return
        if step >= loader.steps_per_epoch:
            epoch, step = epoch + 1, 0
            continue
        batch = loader._host_batch(loader._rows(epoch, step))
        epoch, step = (epoch + 1, 0) if step + 1 >= loader.steps_per_epoch else (epoch, step + 1)
        del loader
        yield batch


def make_memory_loader(
    panel: InMemoryPanel,
    *,
    batch_size: int,
    seed: int = 0,
    num_epochs: int | None = 1,
    on_device: bool = False,
    drop_remainder: bool = True,
    placement: Placement | jax.sharding.Mesh | None = None,
    read: ReadOptions = ReadOptions(),
) -> MemoryLoader:
    """Batches from a panel in memory: shuffled per epoch, placed as jax.Arrays sharded on the data axis.

    >>> panel = oj.load_panel(oj.open_dataset("out_panel/"), obs=("drug",))      # doctest: +SKIP
    >>> loader = oj.make_memory_loader(panel, batch_size=1024, seed=0, num_epochs=None,
    ...                                on_device=True, placement=mesh)              # doctest: +SKIP
    >>> batch = next(loader); state = loader.get_state()     # loader.set_state(state) replays

    By default the panel stays in host RAM and each batch is copied to the devices; with
    ``on_device`` the whole panel lives on the devices (see the module docstring). With
    ``drop_remainder=False`` (host only) the last batch of an epoch is padded and masked.
    ``placement`` as in `make_loader`; of ``read``, ``prefetch`` > 0 gathers that many host
    batches ahead in a thread; the default 0 gathers in the caller's thread (a small copy, which
    JAX's async dispatch already overlaps with the previous step); ``decode_threads`` numba
    threads copy a batch's rows (default: all of numba's). ``num_threads`` is refused: one thread
    gathers, the caller's or the prefetching one. ``repr(loader)`` shows the settings in force.
    """
    placement, read = Placement.of(placement), ReadOptions.of(read)
    check_argument("make_memory_loader", "batch_size", batch_size, minimum=1)
    check_argument("make_memory_loader", "seed", seed, minimum=0)
    check_argument("make_memory_loader", "num_epochs", num_epochs, minimum=0, optional=True)
    hosts = placement.num_hosts
    devices = 1 if placement.mesh is None else int(placement.mesh.shape[placement.data_axis])
    if batch_size % hosts or batch_size % devices:
        msg = f"batch_size {batch_size} must be a positive multiple of the {hosts} host(s) and {devices} device(s)"
        raise OmicsIOError(msg)
    if not on_device:
        placement.check_batch_size(batch_size)  # each host's share over its devices
    if on_device and not drop_remainder:
        msg = "on_device=True always drops the remainder (each device draws only full batches)"
        raise OmicsIOError(msg)
    if read.num_threads is not None:
        msg = (
            f"make_memory_loader takes no ReadOptions(num_threads={read.num_threads}): one thread gathers each "
            "batch (the caller's, or with ReadOptions(prefetch=n) one thread n batches ahead), its rows copied "
            "on ReadOptions(decode_threads=...) numba threads; leave num_threads None"
        )
        raise OmicsIOError(msg)
    for knob in ("decode_threads", "prefetch"):
        if on_device and getattr(read, knob):
            msg = (
                f"make_memory_loader(on_device=True) takes no ReadOptions({knob}={getattr(read, knob)}): its "
                "batches are gathered by a jitted gather on the devices, dispatched as the step asks for them "
                f"(no host batch to make ahead, no numba); leave {knob} None"
            )
            raise OmicsIOError(msg)
    loader = MemoryLoader(
        panel,
        batch_size=batch_size,
        seed=seed,
        num_epochs=num_epochs,
        on_device=on_device,
        drop_remainder=drop_remainder,
        placement=placement,
        prefetch=read.with_defaults(prefetch=0).prefetch,
        decode_threads=read.decode_threads,
    )
    if loader.steps_per_epoch == 0:
        msg = (
            "the panel holds no cells: its query selected none"
            if panel.num_cells == 0
            else f"{panel.num_cells} cells make no batch of {batch_size}; lower batch_size"
        )
        raise OmicsIOError(msg)
    return loader
