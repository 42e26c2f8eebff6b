"""The disk loaders' core: a loader config (`DiskSpec`) and ``(epoch, step)`` → this host's `HostBatch`.

`make_loader` and `GrainSource` are two ways of driving the same `MinibatchReader`: a loader
iterates steps in order on a few threads, Grain's DataLoader asks for records by index. Either
way a host batch is a pure function of ``(epoch, step)`` (and of the anchor, see `schedule`):
its segment is read once, its minibatch cut out, decoded by the output kind in one numba pass.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from omicsio_jax.core.buffers import RowBuffers
from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.dataset.batched_reads import Fetched, OutputRecords, SegmentCache
from omicsio_jax.dataset.dataset import Dataset
from omicsio_jax.loaders.batch_obs import ObsOf, carried_column, codes, obs_column, obs_names
from omicsio_jax.loaders.mixtures import mixture_config
from omicsio_jax.loaders.options import Placement, numba_threads
from omicsio_jax.outputs.base import Output, OutputContext, RowKeys
from omicsio_jax.outputs.batch import HostBatch
from omicsio_jax.outputs.resolve import resolve_output
from omicsio_jax.records.runs import records_checked
from omicsio_jax.sampling.options import Block, Sampling, as_sampling
from omicsio_jax.sampling.plan import AllRows, SamplingPlan
from omicsio_jax.sampling.schedule import Schedule, Segment

OBS_INTEGERS = np.int32  # the dtype batches carry categorical codes and integer obs as (JAX's default)


@dataclasses.dataclass(frozen=True)
class DiskSpec:
    """Everything that decides a disk loader's batches (see `make_loader`); picklable, resolved against a
    dataset. ``num_hosts`` and ``num_slabs`` come from the loader's `Placement`."""

    batch_size: int
    output: Output
    sampling: Sampling = Block()
    seed: int = 0
    num_epochs: int | None = 1
    rows: np.ndarray | None = None
    obs: tuple[str, ...] = ()
    num_hosts: int = 1
    num_slabs: int = 1

    @staticmethod
    def of(
        *,
        batch_size: int,
        sampling: Sampling | str,
        output: str | Output | Mapping[str, str | Output],
        obs: str | Sequence[str],
        rows: np.ndarray | Sequence[int] | None,
        seed: int,
        num_epochs: int | None,
        placement: Placement,
    ) -> DiskSpec:
        """The spec of `make_loader`'s / `GrainSource`'s arguments (raises for a bad one, naming the fix)."""
        placement.check_batch_size(batch_size)
        return DiskSpec(
            batch_size=batch_size,
            output=resolve_output(output),
            sampling=as_sampling(sampling),
            seed=seed,
            num_epochs=num_epochs,
            rows=None if rows is None else np.asarray(rows),  # checked against the dataset by `plan`
            obs=obs_names(obs),
            num_hosts=placement.num_hosts,
            num_slabs=placement.num_slabs,
        )

    def plan(self, ds: Dataset) -> SamplingPlan:
        """The sampling plan over ``ds`` (raises for a bad knob, naming it and the fix)."""
        if self.rows is None:  # every cell: AllRows, not np.arange (0.8 GB at 10^8 cells)
            rows, sampling = AllRows(ds.num_cells), self.sampling
        else:
            if self.rows.dtype == np.bool_:
                msg = "rows takes row numbers, not a boolean mask: pass rows=np.flatnonzero(mask)"
                raise TypeError(msg)
            rows, sampling = self.sampling.for_rows(ds.check_rows(self.rows))
        if len(rows) == 0:
            empty = "cannot sample from an empty set of cells"
            msg = (
                f"{empty}: {ds.path} holds 0 cells; materialize an input that has cells"
                if self.rows is None
                else f"{empty}: rows= selects none of the {ds.num_cells:,} cells of {ds.path}; pass at least one row"
            )
            raise OmicsIOError(msg)
        plan = sampling.to_plan(
            rows,
            batch_size=self.batch_size,
            seed=self.seed,
            num_hosts=self.num_hosts,
            obs=ObsOf(ds),
        )
        if plan.steps_per_epoch == 0:
            msg = (
                f"{len(plan.rows)} cells make no batch of {self.batch_size} (per host: {plan.local_batch}); "
                f"lower batch_size or serve a partial batch: sampling={type(self.sampling).__name__}(..., "
                "drop_remainder=False)"
            )
            raise OmicsIOError(msg)
        return plan

    def resolve(self, ds: Dataset) -> tuple[SamplingPlan, Output]:
        """The sampling plan and the output bound to ``ds``, after checking every obs column exists and
        fits the batch (integers as int32) (raises for a bad knob, naming it and the fix)."""
        plan = self.plan(ds)
        for name in self.obs:
            carried_column(ds, name, OBS_INTEGERS)
        return plan, self.output.bind(
            OutputContext.of_dataset(ds, rows=plan.local_batch, num_slabs=self.num_slabs)
        )

    def config(self, ds: Dataset, plan: SamplingPlan, output: Output) -> dict:
        """What decides the cells and values of every batch (compared on restore): not the number of
        hosts or devices, which an elastic restore may change."""
        return {
            "dataset": ds.fingerprint[:16],
            **plan.describe(),
            "num_epochs": self.num_epochs,
            "obs": list(self.obs),
            **mixture_config(self.sampling),
            **output.config(),
        }


def _warm_up(output: Output) -> None:
    try:
        output.warm_up()
    except Exception:  # noqa: BLE001, S110 - only a head start: the first batch's own call raises what this would
        pass


class MinibatchReader:
    """This host's batch at ``(epoch, step)``: its segment read once (a few ahead), its minibatch decoded.

    ``num_epochs`` bounds the read-ahead; ``prefetch`` segments are read ahead on as many
    threads; ``decode_threads`` numba threads decode a batch (default 1: the callers decode
    several batches at once on their own threads, and numba's parallel kernels called from two
    threads at once on 2 cores stalled for ~0.5 s at random, full-transcriptome dense batch 1,024:
    39–42k cells/s in 2 runs of 6, against a steady 51–53k with one; a caller that is the only one,
    the consumer's thread, may split a batch over several: `default_decode_threads`);
    ``keep_buffers`` batch buffers of each size are recycled.

    The first batch asked for is served first and alone: it reads only its own cells (not its
    whole fetch, a quarter of the chunks at block 16), while numba starts up on another thread
    (`Output.warm_up`), and other callers wait for it; the fetch is read once the batch is out.
    Not from object storage: there the batch's scattered chunks took 538 GETs and left holes that
    cost 307 more for the rest of its fetch, against 10 GETs for the whole fetch at once.
    """

    def __init__(
        self,
        ds: Dataset,
        schedule: Schedule,
        output: Output,
        obs: Sequence[str],
        *,
        num_epochs: int | None,
        prefetch: int = 2,
        decode_threads: int | None = None,
        keep_buffers: int = 6,
    ):
        self.dataset, self.schedule, self.output, self.num_epochs = ds, schedule, output, num_epochs
        # plain ndarray views (a memmap's indexing runs through Python: ~5 µs a batch)
        self._obs = {name: np.asarray(codes(obs_column(ds, name))) for name in obs}
        self.decode_threads = decode_threads or 1
        self._buffers = RowBuffers(keep=keep_buffers)
        self._lock, self._first, self._first_served = threading.Lock(), True, threading.Event()
        self._read = OutputRecords(ds, output.modalities)  # a Modalities output: each of its modalities
        full = schedule.plan.fetch_factor
        self._segments = SegmentCache(
            self._load,
            self._following,
            ahead=prefetch,
            threads=prefetch,
            keep=prefetch + 3,
            weight=lambda seg: seg.num_steps / full,
        )
        # numba's start-up in this process (~0.4 s of Python) overlaps the first fetch's read
        threading.Thread(target=_warm_up, args=(output,), daemon=True, name="omicsio-jax-warm-up").start()

    def _load(self, seg: Segment) -> tuple[np.ndarray, Fetched | dict[str, Fetched]]:
        rows = self.schedule.rows(seg)
        return rows, self._read(rows)

    def _following(self, seg: Segment) -> Segment | None:
        nxt = self.schedule.next_segment(seg)
        return None if self.num_epochs is not None and nxt.epoch >= self.num_epochs else nxt

    def close(self) -> None:
        """Stop reading ahead, and let go of the fetches and buffers kept: a thread stopped mid-read
        leaves an exception whose frames refer to this reader, a cycle that only a garbage collection
        frees, so this memory goes now rather than with it."""
        self._segments.close()
        self._read.release()
        self._buffers.release()

    def __call__(self, epoch: int, step: int) -> HostBatch:
        with self._lock:
            first, self._first = self._first, False
        if not first:  # the first batch has the machine to itself
            self._first_served.wait()
        try:
            return self._batch(epoch, step, alone=first)
        finally:
            if first:
                self._first_served.set()

    def _batch(self, epoch: int, step: int, *, alone: bool) -> HostBatch:
        seg = self.schedule.segment(epoch, step)
        b = self.schedule.plan.local_batch
        lo = (step - seg.first_step) * b
        if (
            alone and not self.dataset.is_remote
        ):  # the first batch reads only its own cells (a quarter of the chunks)
            rows = self.schedule.rows(seg)[lo : lo + b]
            records = self._read.join(
                self._read(rows, announce_first=False), 0, len(rows)
            )  # warm: not a moment lost
        else:
            rows, fetched = self._segments.get(seg)
            rows = rows[lo : lo + b]
            records = self._read.join(fetched, lo, lo + b)
            del fetched
        self._segments.used(seg, seg.num_steps)  # all its steps joined: the segment's records can go
        keys = RowKeys(rows, epoch, self.schedule.plan.seed)
        with records_checked(self.dataset, rows):
            with numba_threads(self.decode_threads):  # numba's count is per thread: only this one's
                x = self.output.from_records(records, self._buffers.empty, keys)
        mask = rows >= 0
        padded = not mask.all()  # padding rows only at an epoch's end (or a host's short share)
        safe = np.where(mask, rows, 0) if padded else rows
        obs = {}
        for name, column in self._obs.items():  # categorical codes: -1 on padding; numerics: NaN
            integers = column.dtype.kind in "iu"  # integers that fit: `DiskSpec.resolve` checked them
            values = column.take(safe).astype(OBS_INTEGERS if integers else np.float32, copy=False)
            if padded:
                values[~mask] = -1 if integers else np.nan
            obs[name] = values
        return HostBatch(x, obs, rows.astype(np.int32), mask)
