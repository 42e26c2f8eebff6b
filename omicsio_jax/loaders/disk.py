"""`make_loader`: training batches from a materialized dataset, as sharded jax.Arrays.

The loader is a `grain.DatasetIterator`: the steps from its position are a Grain
``MapDataset.range(...).map(batch at step).to_iter_dataset(ReadOptions)`` decoded and placed on
``num_threads`` threads, while `MinibatchReader` reads the segments ahead. Its state is global
(epoch, step, the anchor of the epoch, see `schedule`) plus this process's coverage tally, so
``grain.checkpoint.CheckpointSave/Restore`` and Orbax's ``save_checkpointables`` work unchanged,
and a restore with another number of processes continues the epoch exactly.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import os
import sys
import weakref
from collections.abc import Mapping, Sequence

import grain
import jax
import numpy as np

from omicsio_jax.core.errors import OmicsIOError, StateMismatchError
from omicsio_jax.dataset.dataset import Dataset, as_dataset
from omicsio_jax.loaders import mixtures
from omicsio_jax.loaders.agreement import check_processes_agree, processes_share
from omicsio_jax.loaders.iterator import ClosingIterator, RunLength
from omicsio_jax.loaders.minibatch import DiskSpec, MinibatchReader
from omicsio_jax.loaders.mixtures import changed_mixture
from omicsio_jax.loaders.options import (
    Placement,
    ReadOptions,
    check_argument,
    default_batches_ahead,
    default_decode_threads,
    default_num_threads,
    default_prefetch,
    float32_batch_bytes,
)
from omicsio_jax.loaders.output_repr import describe_output
from omicsio_jax.loaders.resume import resume_point
from omicsio_jax.loaders.state import (
    as_json,
    check_positions,
    check_state,
    check_within_run,
    process_states,
    read_loader_states,
    reads_state,
)
from omicsio_jax.outputs.base import Output
from omicsio_jax.outputs.batch import Batch, HostBatch, SparseBatch
from omicsio_jax.outputs.csr import CSR
from omicsio_jax.outputs.modalities import Modalities
from omicsio_jax.sampling.coverage import Coverage, Tally
from omicsio_jax.sampling.options import Block, Sampling
from omicsio_jax.sampling.schedule import Anchor, Schedule
from omicsio_jax.storage.memory import release_freed_memory

STATE_VERSION = 2


def _stop(iterator, reader) -> None:
    if iterator is not None:
        iterator.close()
    if reader is not None:
        reader.close()


class Loader(RunLength, ClosingIterator):
    """Iterator of `Batch`es; `get_state`/`set_state` resume bit-exactly. Build with `make_loader`."""

    def __init__(self, ds: Dataset, spec: DiskSpec, *, placement: Placement, read: ReadOptions):
        super().__init__()
        self._iterator = self._reader = self._finalizer = None  # before anything can raise: __del__ closes
        self._before: Loader | None = None  # a new mixture at resume: the epoch it finishes first
        self.dataset, self.spec, self.num_epochs = ds, spec, spec.num_epochs
        self.placement, self.host = placement, placement.host
        self.plan, self.output = spec.resolve(ds)
        kind, rows = self.output.decoding, self.plan.local_batch
        self.read = read.with_defaults(
            num_threads=default_num_threads(kind, batch_size=rows), prefetch=default_prefetch()
        )
        row_bytes = float32_batch_bytes(self.output, rows)
        self.read = self.read.with_defaults(
            decode_threads=default_decode_threads(kind, self.read.num_threads, row_bytes)
        )
        self.num_threads, self.prefetch = self.read.num_threads, self.read.prefetch
        self.batches_ahead = default_batches_ahead(kind, self.num_threads, row_bytes)
        self._finished: Coverage | None = None  # the audit of the last epoch that ended
        self._mixtures: list[dict] | None = None  # every mixture and the epoch it took effect at
        if processes_share(placement):  # each JAX process must have made this loader
            check_processes_agree(self._config, f"make_loader on {ds.path}")
        self._start(0, 0, Anchor(0, 0, self.plan.num_hosts), Tally())

    def __repr__(self) -> str:
        output = describe_output(self.spec.output)
        return (
            f"Loader({str(self.dataset.path)!r}, batch_size={self.spec.batch_size}, sampling={self.spec.sampling}, "
            f"output={output}, obs={list(self.spec.obs)}, seed={self.spec.seed}, "
            f"num_epochs={self.num_epochs}, read={self.read}, batches_ahead={self.batches_ahead}, "
            f"hosts={self.plan.num_hosts})"
        )

    # ----- the stream --------------------------------------------------------------------------
    def _new_reader(self, schedule: Schedule) -> MinibatchReader:
        return MinibatchReader(
            self.dataset,
            schedule,
            self.output,
            self.spec.obs,
            num_epochs=self.num_epochs,
            prefetch=self.prefetch,
            decode_threads=self.read.decode_threads,
            keep_buffers=self.batches_ahead + self.num_threads + 4,
        )

    @property
    def decode_threads(self) -> int:
        """Numba threads that decode one batch (`default_decode_threads`: 1, as ``num_threads``
        batches decode at once, or on more than 2 cores every core for large dense batches decoded
        on the consumer's thread)."""
        return self.read.decode_threads

    def _host_stream(self, schedule: Schedule, reader: MinibatchReader, start: tuple[int, int]):
        """The host batches from ``start`` to the end (endless without ``num_epochs``) as a Grain dataset."""
        total = sys.maxsize
        if self.num_epochs is not None:
            epoch, step = start
            total = max(schedule.steps_in_epoch(epoch) - step, 0) if epoch < self.num_epochs else 0
            total += max(self.num_epochs - epoch - 1, 0) * self.plan.steps_per_epoch
        return grain.MapDataset.range(total).map(lambda i: reader(*schedule.position(start, i)))

    def _start(self, epoch: int, step: int, anchor: Anchor, served: Tally) -> None:
        """Stand at ``(epoch, step)`` of a run that took over at ``anchor``, having served ``served``."""
        self._halt()
        self._schedule = Schedule(self.plan, self.host, anchor)
        if step >= self._schedule.steps_in_epoch(epoch):
            epoch, step, served = epoch + 1, 0, Tally()
        self._epoch, self._step, self._served = epoch, step, served

    def _ensure_iterator(self) -> None:
        if self._iterator is not None:
            return
        reader = self._reader = self._new_reader(self._schedule)
        placement = self.placement  # not self: the threads must not keep the loader alive

        def place(hb: HostBatch) -> tuple[Batch, Tally]:
            return placement.place(hb), Tally.of(hb.index)

        stream = self._host_stream(self._schedule, reader, (self._epoch, self._step)).map(place)
        options = grain.ReadOptions(num_threads=self.num_threads, prefetch_buffer_size=self.batches_ahead)
        self._iterator = iter(stream.to_iter_dataset(options))
        # Stop the threads when the loader goes away or, at the latest, before the interpreter
        # shuts down: a thread still inside a numba or ArrayRecord call then aborts it.
        self._finalizer = weakref.finalize(self, _stop, self._iterator, reader)

    def _halt(self) -> None:
        # forget the stream before stopping it: a KeyboardInterrupt while its threads are joined
        # leaves a loader that starts a new one, not one that calls the closed one
        finalizer, self._iterator, self._reader, self._finalizer = self._finalizer, None, None, None
        if finalizer is not None:
            finalizer()

    def close(self) -> None:
        """Stop the background threads (also done when the loader is collected) and let go of the
        fetches and batch buffers it kept, handing the freed heap back to the system (a job that
        makes a loader per evaluation keeps a flat footprint); idempotent."""
        self._drop_before()
        self._halt()
        super().close()
        self._release_freed_memory()

    # (held by the class: a loader collected as the interpreter shuts down finds the module's names gone)
    _release_freed_memory = staticmethod(release_freed_memory)

    @property
    def _finishing(self) -> Loader | None:
        """The loader of a new mixture's waiting epoch (`_resume_with_new_mixture`) while that epoch has
        batches left, else None: once its last batch is out, this loader's state and coverage."""
        before = self._before
        return before if before is not None and before._epoch < self._epoch else None

    def _drop_before(self) -> None:
        before, self._before = self._before, None  # forgotten first, as `_halt` does
        if before is not None:
            self._finished = before._finished
            before.close()

    def start_prefetch(self) -> None:
        """Start reading and decoding now (e.g. while the model is restored)."""
        self._assert_not_closed()
        self._ensure_iterator()

    def __next__(self) -> Batch:
        self._assert_not_closed()
        finishing = self._finishing
        if finishing is not None:  # the epoch a new mixture waits for
            batch = next(finishing)
            if finishing._epoch >= self._epoch:  # that epoch's last batch: its audit is the last one
                self._finished = finishing._finished
            return batch
        # its threads stop on the call after its last batch, not on that batch's own: a
        # KeyboardInterrupt while they are joined then loses no batch (the next call would have
        # served the old mixture's next epoch in its place)
        self._drop_before()
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        self._ensure_iterator()
        epoch_ends = self._step + 1 >= self._schedule.steps_in_epoch(self._epoch)
        last = epoch_ends and self.num_epochs is not None and self._epoch + 1 >= self.num_epochs
        try:
            batch, tally = next(self._iterator)
            served = self._served + tally
            finished = (
                Coverage(self._epoch, served, self._schedule.planned(self._epoch)) if epoch_ends else None
            )
            if last:
                self._halt()  # the last batch is out: its reading threads and buffers go now
        except BaseException:
            # Nothing of this call counts: a batch the threads made but this call did not return (an
            # error making it, a KeyboardInterrupt while waiting for it) is made again by the next
            # call, from a stream restarted where the last batch returned left it. Grain's stream
            # has moved past it and would serve the next step's batch as this one's.
            self._halt()
            raise
        self._served, self._step = served, self._step + 1  # the position moves only here, with no call
        if finished is not None:
            self._finished = finished
            finished.check(f"make_loader on {self.dataset.path} (process {self.host})")
            self._epoch, self._step, self._served = self._epoch + 1, 0, Tally()
        return batch

    def as_grain_dataset(self) -> grain.IterDataset:
        """The host-side stream from the beginning (numpy `HostBatch`es) as a Grain `IterDataset`,
        before device placement: compose transforms on it and checkpoint it with Grain's own state.
        That state is Grain's position alone (``{"next_index": n}``), with no config to check: it
        restores into a loader of the same dataset and arguments only (for a checked state, use the
        loader's own, `get_state`, or `make_grain_loader`'s iterator)."""
        schedule = Schedule(self.plan, self.host)
        reader = self._new_reader(schedule)
        options = grain.ReadOptions(num_threads=self.num_threads, prefetch_buffer_size=self.batches_ahead)
        return self._host_stream(schedule, reader, (0, 0)).to_iter_dataset(options)

    # ----- device side -------------------------------------------------------------------------
    def densify(self, x: SparseBatch, modality: str | None = None) -> jax.Array:
        """Dense ``(batch_size, genes)`` float32 from a `SparseBatch`, computed on the devices (jitted);
        with an output per modality, of ``modality``'s (``loader.densify(batch.x["atac"], "atac")``)."""
        if isinstance(self.output, Modalities):
            if modality is None:
                msg = f"this loader has an output per modality: name the one to densify ({', '.join(self.output.modalities)})"
                raise OmicsIOError(msg)
            return self.output.densify(x, modality)
        own = self.dataset.modalities[0]
        if modality is not None and modality != own:  # one output, of the dataset's own modality
            msg = (
                f"this loader's output is of modality {own!r}, not {modality!r}: densify(x) (for another "
                "modality, make the loader with an output per modality, output={...})"
            )
            raise OmicsIOError(msg)
        if not isinstance(self.output, CSR):
            msg = f"densify needs output='csr'; this loader's output is {self.output.kind!r}"
            raise OmicsIOError(msg)
        return self.output.densify(x)

    def measured_mask(self, x: SparseBatch) -> jax.Array:
        """``(batch_size, genes)`` bool from a `SparseBatch` of ``oj.CSR(measured=True)`` over a
        collection: the genes each cell's source measured, gathered on the devices."""
        if not isinstance(self.output, CSR):
            msg = f"measured_mask needs output=oj.CSR(measured=True); this loader's output is {self.output.kind!r}"
            raise OmicsIOError(msg)
        return self.output.measured_mask(x)

    # ----- state and audit ---------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    @functools.cached_property
    def _config(self) -> dict:  # on first use (a state asked for): hashing 10^8 rows takes a while
        return as_json(self.spec.config(self.dataset, self.plan, self.output))

    def config(self) -> dict:
        """What decides the batches: dataset fingerprint, every sampling and output knob."""
        return copy.deepcopy(self._config)

    def coverage(self, epoch: int | None = None) -> Coverage:
        """This process's served and planned cells of the current epoch (once every epoch is served,
        of the last one), or of ``epoch`` if it is the one that just ended (see `Coverage`)."""
        if self._finishing is not None:
            return self._finishing.coverage(epoch)
        done = self.num_epochs is not None and self._epoch >= self.num_epochs
        if epoch is None and done and self._finished is not None:
            return self._finished
        if epoch is not None and epoch != self._epoch:
            if self._finished is None or self._finished.epoch != epoch:
                kept = self._epoch - 1 if done else self._epoch
                msg = (
                    f"coverage of epoch {epoch} is not kept: a loader keeps its current epoch's and the one "
                    f"that just ended, and the last it has is epoch {kept}"
                )
                raise OmicsIOError(msg)
            return self._finished
        return Coverage(self._epoch, self._served, self._schedule.planned(self._epoch))

    def get_state(self) -> dict:
        """Small JSON: where the stream stands (global), and what this process served this epoch."""
        if self._finishing is not None:
            return {**self._finishing.get_state(), "mixtures": copy.deepcopy(self._mixtures)}
        a = self._schedule.anchor
        anchor = [a.step, a.hosts] if a.epoch == self._epoch else [0, self.plan.num_hosts]
        return {
            "version": STATE_VERSION,
            "config": copy.deepcopy(self._config),  # the caller's to edit: not this loader's own
            "epoch": self._epoch,
            "step": self._step,
            "anchor": anchor,
            "process": [self.host, self.plan.num_hosts],
            "served": self._served.to_json(),
            **({"mixtures": copy.deepcopy(self._mixtures)} if self._mixtures else {}),
        }

    @reads_state
    def set_state(self, state: dict | Sequence[dict]) -> None:
        """Resume from `get_state` output: this process's own state, or every process's (a list, as
        `read_loader_states` returns it), which also restores onto another number of processes.

        Refuses a state from another dataset or config, one line per difference, except a `Mixture`
        with other weights: the checkpoint's epoch finishes as it began, the new weights take effect
        with the next one (`omicsio_jax.loaders.mixtures`).
        """
        states = process_states(state)
        check_positions(states)
        check_within_run(states[0], self.num_epochs)
        self._drop_before()
        old = changed_mixture(states[0]["config"], self._config)
        if old is not None:
            self._resume_with_new_mixture(states, old)
            return
        for s in states:
            check_state(s, STATE_VERSION, self._config)
        # the mixtures in effect up to the state's epoch: one the saving run was to switch to later is
        # not this loader's, which keeps the state's weights (its own) from there on
        recorded = states[0].get("mixtures")
        self._mixtures = mixtures.history(states[0], states[0]["epoch"] + 1) if recorded else None
        self._start(*resume_point(states, self.plan, self.host))

    def _resume_with_new_mixture(self, states: list[dict], weights: dict[str, float]) -> None:
        """Finish the checkpoint's epoch with its ``weights`` (a loader of its own), then this loader's."""
        epoch, step = states[0]["epoch"], states[0]["step"]
        switch = epoch if step == 0 else epoch + 1  # nothing of the epoch served yet: the new one now
        old = dataclasses.replace(
            self.spec, sampling=dataclasses.replace(self.spec.sampling, weights=weights)
        )
        try:  # the plan of the checkpoint's weights (made once: over 10^8 cells it takes a while)
            before = Loader(self.dataset, old, placement=self.placement, read=self.read) if step else None
            plan = None if step else old.plan(self.dataset)
        except OmicsIOError as e:
            msg = f"the checkpoint's mixture {weights} does not fit this loader's rows: {e}"
            raise StateMismatchError(msg) from e
        if before is not None:
            before.set_state(states)  # checks the states against the config they were written with
            self._before = before
        else:  # nothing left to finish, but the states are checked all the same (version, rows, ...)
            for s in states:
                check_state(s, STATE_VERSION, as_json(old.config(self.dataset, plan, self.output)))
        self._mixtures = [
            *mixtures.history(states[0], switch),
            {"from_epoch": switch, "weights": dict(sorted(self.spec.sampling.weights.items()))},
        ]
        self._start(switch, 0, Anchor(switch, 0, self.plan.num_hosts), Tally())

    async def load(self, directory):
        """Orbax v1 (``orbax.checkpoint.experimental.v1.load_checkpointables``): read every process's
        state, so another number of processes than the checkpoint's restores too. Returns the
        coroutine Orbax awaits."""

        async def restore() -> None:
            self.set_state(await asyncio.to_thread(read_loader_states, directory))

        return restore()


def make_loader(
    ds: Dataset | str | os.PathLike[str],
    *,
    batch_size: int,
    sampling: Sampling | str = Block(),
    output: str | Output | Mapping[str, str | Output] = "dense",
    obs: str | Sequence[str] = (),
    rows: np.ndarray | Sequence[int] | None = None,
    seed: int = 0,
    num_epochs: int | None = 1,
    placement: Placement | jax.sharding.Mesh | None = None,
    read: ReadOptions | None = ReadOptions(),
) -> Loader:
    """Batches of cells from ``ds`` (a `Dataset`, or its path) by block sampling with batched
    fetching (scDataset's recipe).

    >>> auto = (jax.sharding.AxisType.Auto,)  # a train step's gradients need Auto axes    # doctest: +SKIP
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)    # doctest: +SKIP
    >>> loader = oj.make_loader(ds, batch_size=1024, sampling=oj.Block(block_size=16, fetch_factor=64),
    ...                         output=oj.Dense(normalize="log1p"), obs=("drug",), placement=mesh)  # doctest: +SKIP
    >>> for batch in loader: ...        # batch.x: (1024, num_genes) float32, sharded P("data")

    ``batch_size`` is the global batch; each of the placement's hosts serves ``batch_size /
    process_count`` rows. ``sampling`` is an option object: `Block` (the default), `Random`,
    `Stream`, `Weighted`, `ClassBalanced`, `Mixture` (or the names ``"block"``, ``"random"``, ``"stream"``);
    ``output`` an output kind: `Dense`, `Panel`, `CSR`, `GeneformerTokens`, `ScGPTTokens`, a dict
    of them per modality, or the shorthands ``"dense"`` / ``"csr"``. ``obs`` names the obs columns
    each batch carries (a name or a list of them); ``rows`` restricts sampling to a subset (e.g.
    ``ds.rows_where("batch", ["plate_09"], invert=True)``; a set: a row listed twice is served once).
    ``seed`` fixes the sampling (the same seed, the same batches on any machine) and ``num_epochs``
    how many passes the loader makes (None: without end). ``placement`` says where batches go (`Placement`, or a mesh:
    sharded along its ``"data"`` axis) and ``read`` how they are read (`ReadOptions`: by default
    threads chosen for the output kind, the batch size and the machine's cores decode and place
    batches ahead of the consumer, or it decodes them itself, `default_num_threads`, shown by
    ``repr(loader)``, with up to ``loader.batches_ahead`` batches made ahead, `default_batches_ahead`;
    two fetches are read ahead, more on many cores, `default_prefetch`, each of ``fetch_factor ×
    batch_size`` cells held in memory). Measured settings: benchmarks/README.md.
    """
    ds = as_dataset(ds, "make_loader")
    placement, read = Placement.of(placement), ReadOptions.of(read)
    check_argument("make_loader", "batch_size", batch_size, minimum=1)
    check_argument("make_loader", "seed", seed, minimum=0)
    check_argument("make_loader", "num_epochs", num_epochs, minimum=1, optional=True)
    spec = DiskSpec.of(
        batch_size=batch_size,
        sampling=sampling,
        output=output,
        obs=obs,
        rows=rows,
        seed=seed,
        num_epochs=num_epochs,
        placement=placement,
    )
    return Loader(ds, spec, placement=placement, read=read)
