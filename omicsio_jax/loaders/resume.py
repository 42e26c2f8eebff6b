"""Where a restored `Loader` stands: the position its processes' saved states agree on.

A disk loader's state is global (epoch, step, the anchor of the epoch, see `schedule`) plus what
its process served this epoch. `resume_point` checks that the states are one checkpoint and turns
them into this process's position: restored onto as many processes as saved them, each takes up
its own state; onto another number (elastic), the rest of the round is served as the saving
processes would have served it, split over this run's processes.
"""

from __future__ import annotations

from typing import NamedTuple

from omicsio_jax.core.errors import OmicsIOError, StateMismatchError
from omicsio_jax.sampling.coverage import Tally
from omicsio_jax.sampling.plan import SamplingPlan
from omicsio_jax.sampling.schedule import Anchor, Schedule


class ResumePoint(NamedTuple):
    """The position a loader resumes at: ``(epoch, step)`` of a run that took over at ``anchor``,
    having served ``served`` this epoch."""

    epoch: int
    step: int
    anchor: Anchor
    served: Tally


def resume_point(states: list[dict], plan: SamplingPlan, host: int) -> ResumePoint:
    """Process ``host``'s position, on ``plan``'s processes, from ``states`` (this process's own
    state, or every saving process's); refuses states that are not one checkpoint of a position."""
    count = states[0]["process"][1]
    hosts = plan.num_hosts
    if len(states) == 1 and count == hosts:
        mine = states[0]
        if mine["process"][0] != host:
            msg = (
                f"this is the state of process {mine['process'][0]}, and this loader is process {host}: "
                "restore each process's own state (Grain's CheckpointRestore does), or pass every "
                "process's (oj.read_loader_states(directory))"
            )
            raise StateMismatchError(msg)
    elif len(states) != count or sorted(s["process"][0] for s in states) != list(range(count)):
        ids = [s["process"][0] for s in states]
        repeated = sorted({p for p in ids if ids.count(p) > 1})
        if repeated:
            msg = (
                f"the states passed repeat process {', '.join(map(str, repeated))}'s: pass each process's "
                f"state once (the checkpoint's {count}, as oj.read_loader_states(directory) reads them)"
            )
        else:
            msg = (
                f"the checkpoint was written by {count} processes and this run has {hosts}: pass all {count} "
                "states to set_state (oj.read_loader_states(directory) reads them)"
            )
        raise StateMismatchError(msg)
    positions = {(s["epoch"], s["step"], tuple(s["anchor"])) for s in states}
    if len(positions) > 1:
        msg = f"the processes' states stand at different positions {sorted(positions)}: not one checkpoint"
        raise StateMismatchError(msg)
    epoch, step, (anchor_step, anchor_hosts) = positions.pop()
    saved = plan if count == hosts else plan.with_hosts(count)
    try:  # the processes that began the anchor's round must be able to have split its batches
        saved.with_hosts(anchor_hosts)
    except OmicsIOError as e:
        msg = f"malformed loader state: anchor [{anchor_step}, {anchor_hosts}]: {e}"
        raise StateMismatchError(msg) from e
    steps = Schedule(saved, 0, Anchor(epoch, anchor_step, anchor_hosts)).steps_in_epoch(epoch)
    if not anchor_step <= step < steps:  # get_state stands before an epoch's end, after its anchor
        msg = (
            f"malformed loader state: step {step} (anchor step {anchor_step}) is not a step of epoch "
            f"{epoch}, which has {steps} steps: pass what the loader's get_state returned"
        )
        raise StateMismatchError(msg)
    if count == hosts:
        own = next(s for s in states if s["process"][0] == host)
        return ResumePoint(
            epoch, step, Anchor(epoch, anchor_step, anchor_hosts), Tally.from_json(own["served"])
        )
    # Elastic: the remainder of the round is served as the saving processes would have served it,
    # split over this run's processes; process 0 carries what they served so far.
    old = Schedule(saved, 0, Anchor(epoch, anchor_step, anchor_hosts))
    served = Tally()
    if host == 0:
        for s in states:
            served = served + Tally.from_json(s["served"])
    return ResumePoint(epoch, step, Anchor(epoch, step, old.round_hosts(epoch, step)), served)
