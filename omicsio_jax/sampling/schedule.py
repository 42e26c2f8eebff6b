"""Which cells a host serves at each step of an epoch, including across a change of host count.

A `SamplingPlan` cuts each epoch's global order into *rounds* of ``fetch_factor × batch_size``
cells: round ``r`` is the same cells whatever the number of hosts ``P`` (host ``h`` reads the
``h``-th of its ``P`` fetches), and step ``s`` of the epoch serves minibatch ``s % fetch_factor``
of every host's fetch of round ``s // fetch_factor``. The global batch of a step is therefore
the concatenation, over hosts, of their minibatches: a pure function of (seed, epoch, step, and
the ``P`` that began the round).

An *anchor* is where a run took over an epoch from a run with another number of hosts:
``(epoch, step, hosts)``, ``hosts`` being the number of hosts that began the round of ``step``
(``(epoch, 0, P)`` when nothing was taken over). When a run with ``P' ≠ hosts`` hosts restores
mid-round, it serves the rest of that round exactly as ``hosts`` hosts would have, each global
batch split in ``P'`` equal slices instead (a *remainder* segment: every host reads its slices
out of all the old fetches), then continues round by round with its own ``P'``. Every cell of
the epoch is thus served once, and the global batches are even bit-identical to an uninterrupted
run up to the end of the round.

A *segment* is what a host reads at once: one of its fetches, or a remainder; it serves
``num_steps`` consecutive minibatches of ``local_batch`` rows each.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from omicsio_jax.sampling.coverage import Tally
from omicsio_jax.sampling.plan import EpochOrder, SamplingPlan


class EpochOrders:
    """Caches the global order of the most recent epochs (one block permutation per epoch)."""

    def __init__(self, plan: SamplingPlan, keep: int = 2):
        self._plan, self._keep = plan, keep
        self._orders: dict[int, EpochOrder] = {}
        self._lock = threading.Lock()

    def __call__(self, epoch: int) -> EpochOrder:
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                order = self._plan.order_of(epoch)
                self._orders[epoch] = order
                for old in sorted(self._orders)[: -self._keep]:
                    del self._orders[old]
            return order


@dataclasses.dataclass(frozen=True)
class Anchor:
    """Where this run took over: step ``step`` of ``epoch``, in a round begun by ``hosts`` hosts."""

    epoch: int = 0
    step: int = 0
    hosts: int = 1


@dataclasses.dataclass(frozen=True)
class Segment:
    """Steps ``[first_step, first_step + num_steps)`` of ``epoch``, cut from the fetches of ``hosts``
    hosts: this host's own fetch number ``fetch`` (``remainder`` False), or its slices of every
    global batch of those steps (``remainder`` True)."""

    epoch: int
    first_step: int
    num_steps: int
    hosts: int
    fetch: int
    remainder: bool = False


class Schedule:
    """The segments and steps of one host under ``plan`` (``plan.num_hosts`` hosts), from ``anchor``."""

    def __init__(self, plan: SamplingPlan, host: int, anchor: Anchor | None = None):
        self.plan, self.host = plan, host
        self.orders = EpochOrders(plan)
        self._tails: dict[int, int] = {plan.num_hosts: plan.tail_batches}
        self.anchor = self._normalized(anchor or Anchor(0, 0, plan.num_hosts))
        self._anchor_steps = self._steps(self.anchor)

    def _tail_batches(self, hosts: int) -> int:
        """Minibatches of an epoch's tail when ``hosts`` hosts split it."""
        if hosts not in self._tails:
            self._tails[hosts] = self.plan.with_hosts(hosts).tail_batches
        return self._tails[hosts]

    # ----- geometry ----------------------------------------------------------------------------
    @property
    def _full(self) -> int:
        """Steps of an epoch's full rounds (the same for any number of hosts)."""
        return self.plan.full_rounds * self.plan.fetch_factor

    def _region(self, step: int, hosts: int) -> tuple[int, int, int]:
        """``(first step, steps, fetch number)`` of the round or tail that holds ``step`` under ``hosts``."""
        ff = self.plan.fetch_factor
        if step < self._full:
            return step // ff * ff, ff, step // ff
        return self._full, self._tail_batches(hosts), self.plan.full_rounds

    def _normalized(self, anchor: Anchor) -> Anchor:
        """The anchor with ``hosts`` set to this run's where it makes no difference (at a round's
        first step), rolled over to the next epoch when it stands at the end of one."""
        if anchor.step >= self._steps(anchor):
            return Anchor(anchor.epoch + 1, 0, self.plan.num_hosts)
        first, _, _ = self._region(anchor.step, anchor.hosts)
        if anchor.step == first:
            return Anchor(anchor.epoch, anchor.step, self.plan.num_hosts)
        return anchor

    def _steps(self, anchor: Anchor) -> int:
        tail_hosts = anchor.hosts if anchor.step > self._full else self.plan.num_hosts
        return self._full + self._tail_batches(tail_hosts)

    def _in_remainder(self, epoch: int, step: int) -> bool:
        a = self.anchor
        if epoch != a.epoch or a.hosts == self.plan.num_hosts or step < a.step:
            return False
        first, num, _ = self._region(a.step, a.hosts)
        return step < first + num

    def steps_in_epoch(self, epoch: int) -> int:
        """Steps of ``epoch`` (an anchored tail keeps the tail length of the hosts that began it)."""
        return self._anchor_steps if epoch == self.anchor.epoch else self.plan.steps_per_epoch

    def position(self, start: tuple[int, int], i: int) -> tuple[int, int]:
        """``(epoch, step)`` of the ``i``-th step served from ``start`` (an ``(epoch, step)``)."""
        epoch, step = start
        first = self.steps_in_epoch(epoch) - step
        if i < first:
            return epoch, step + i
        more, step = divmod(i - first, self.plan.steps_per_epoch)
        return epoch + 1 + more, step

    def round_hosts(self, epoch: int, step: int) -> int:
        """Hosts that began the round of ``step`` (what a saved state records)."""
        return self.anchor.hosts if self._in_remainder(epoch, step) else self.plan.num_hosts

    def segment(self, epoch: int, step: int) -> Segment:
        """The segment that serves ``step`` of ``epoch`` on this host."""
        if self._in_remainder(epoch, step):
            a = self.anchor
            first, num, fetch = self._region(a.step, a.hosts)
            return Segment(epoch, a.step, first + num - a.step, a.hosts, fetch, remainder=True)
        first, num, fetch = self._region(step, self.plan.num_hosts)
        return Segment(epoch, first, num, self.plan.num_hosts, fetch)

    # ----- cells -------------------------------------------------------------------------------
    def _old_batches(self, epoch: int, hosts: int, fetch: int) -> np.ndarray:
        """``(steps, hosts × old local batch)``: the global batches of a round or tail under ``hosts``."""
        old = self.plan.with_hosts(hosts)
        order = self.orders(epoch)
        served = [old.serving_rows(old.fetch(epoch, fetch, h, order=order)) for h in range(hosts)]
        stacked = np.stack(served).reshape(hosts, -1, old.local_batch)
        return stacked.transpose(1, 0, 2).reshape(stacked.shape[1], -1)

    def rows(self, seg: Segment) -> np.ndarray:
        """This host's cells of ``seg`` in serving order: ``num_steps × local_batch`` rows, -1 = padding."""
        if not seg.remainder:
            return self.plan.serving_rows(
                self.plan.fetch(seg.epoch, seg.fetch, self.host, order=self.orders(seg.epoch))
            )
        first, _, _ = self._region(seg.first_step, seg.hosts)
        batches = self._old_batches(seg.epoch, seg.hosts, seg.fetch)[seg.first_step - first :]
        b = self.plan.local_batch
        return batches[:, self.host * b : (self.host + 1) * b].reshape(-1)

    def next_segment(self, seg: Segment) -> Segment:
        end = seg.first_step + seg.num_steps
        if end >= self.steps_in_epoch(seg.epoch):
            return self.segment(seg.epoch + 1, 0)
        return self.segment(seg.epoch, end)

    # ----- coverage ----------------------------------------------------------------------------
    def planned(self, epoch: int) -> Tally:
        """What this host serves in ``epoch``; after an elastic takeover mid-epoch, host 0 also
        carries every cell served before the anchor (so the hosts' tallies add up to the epoch)."""
        a = self.anchor
        start = a.step if epoch == a.epoch else 0
        total = self._prefix(epoch, a.step, a.hosts) if (start and self.host == 0) else Tally()
        step = start
        while step < self.steps_in_epoch(epoch):
            seg = self.segment(epoch, step)
            if not seg.remainder and step == seg.first_step and seg.fetch < self.plan.full_rounds:
                rows = self.plan.fetch(
                    epoch, seg.fetch, self.host, order=self.orders(epoch)
                ).rows  # no shuffle needed
            else:
                rows = self.rows(seg)[(step - seg.first_step) * self.plan.local_batch :]
            total = total + Tally.of(rows)
            step = seg.first_step + seg.num_steps
        return total

    def _prefix(self, epoch: int, step: int, hosts: int) -> Tally:
        """Every cell served, on all hosts, before ``step`` of ``epoch`` (its round begun by ``hosts``)."""
        first, _, fetch = self._region(step, hosts)
        round_cells = self.plan.fetch_factor * self.plan.batch_size
        before = Tally.of(self.orders(epoch)[: (first // self.plan.fetch_factor) * round_cells])
        return before + Tally.of(self._old_batches(epoch, hosts, fetch)[: step - first])
