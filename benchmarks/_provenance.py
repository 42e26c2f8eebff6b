"""What every results file records about where its figures come from (command, date, commit, machine),
and how its figures are timed.

`provenance()` is merged into each benchmark's JSON (``{**provenance(), ...}``); `report.py` prints
a figure only from a file that carries all of it. Throughput is timed over windows of at least
`MIN_WINDOW_S` (`window`, `timed`), a figure is the median of at least `MIN_ROUNDS` such windows
(`medians` keeps every round's value beside it). `add_window_options` / `check_window` give a script
its ``--seconds``, ``--rounds`` and ``--quick``: a shorter window or fewer rounds are refused unless
``--quick`` (a smoke run), whose results `write_result` puts in a temporary folder, never in
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
QUICK_RESULTS = Path(tempfile.gettempdir()) / "omicsio-bench-quick"  # where --quick runs write
QUICK_WINDOW_S = 1.0  # the default window of a --quick smoke run
MIN_WINDOW_S = 10.0  # a timed window is at least this long
MIN_ROUNDS = 3  # a figure is the median of at least this many windows


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()


def commit() -> str:
    """The checked-out commit, with ``+dirty`` when tracked files differ from it (the results files
    aside: a benchmark that writes its results after every round changes its own). A copy of the
    working tree sent to another machine to run there names the commit it was copied from in
    ``OMICSIO_BENCH_COMMIT`` (recorded with ``+copy``): the copy's own git metadata, if it has
    any, may be an older one's."""
    copied = os.environ.get("OMICSIO_BENCH_COMMIT")
    if copied:
        return f"{copied}+copy"
    sha = _git("rev-parse", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return sha + ("+dirty" if dirty else "")


def baseline_commit(path: str) -> str:
    """The commit checked out at ``path`` (a baseline worktree an A/B times beside this checkout);
    raises where ``path`` is not a checkout, before any figure is measured against it."""
    return subprocess.run(
        ["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = [n.strip() for n in out.splitlines() if n.strip()]
    return f"{len(names)}× {names[0]}" if names else None


def machine() -> dict:
    """CPU model, cores (all and usable by this process), memory, GPU (None without one), the last
    level cache and `memory_probe`'s copy rates."""
    return {
        "cpu": _cpu_model(),
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": _gpu(),
        "python": platform.python_version(),
        "l3_cache_mib": _l3_cache_mib(),
        "copy_gb_s": memory_probe(),
    }


def _l3_cache_mib() -> float | None:
    """The size of the CPU's level 3 cache as the kernel reports it (None where it reports none)."""
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return None
    units = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}
    return float(size[:-1]) * units[size[-1]] if size[-1] in units else float(size) / 2**20


PROBE_MIB = (4, 16, 256)


def memory_probe(seconds: float = 0.4) -> dict[str, float]:
    """One core's copy rate (bytes read + written per second, GB/s, the best of ``seconds`` of copies)
    of arrays of `PROBE_MIB` MiB: held by the core's caches, by a last-level cache's share, and by
    memory alone. Two hosts of one CPU model and core count can differ by several times on
    cache-bound figures (a virtual machine shares its last-level cache with its neighbours), so
    every results file carries the rates of the host its figures were measured on."""
    import numpy as np

    rates = {}
    for mib in PROBE_MIB:
        a = np.ones(mib << 17)  # float64: mib MiB
        b = np.empty_like(a)
        np.copyto(b, a)
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            np.copyto(b, a)
            best = max(best, 2 * a.nbytes / (time.perf_counter() - start) / 1e9)
        rates[f"{mib} MiB"] = round(best, 1)
    return rates


def provenance(argv: list[str] | None = None) -> dict:
    """``{"command", "date", "commit", "machine"}`` of this run (``argv``: default ``sys.argv``)."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return {
        "command": shlex.join(["python", str(script), *argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "commit": commit(),
        "machine": machine(),
    }


@dataclasses.dataclass(frozen=True)
class Window:
    """One timed window: ``cells`` served by ``steps`` calls in ``seconds`` of wall time and
    ``cpu_seconds`` of this process's CPU time (user + sys of every thread)."""

    cells: int
    seconds: float
    steps: int
    cpu_seconds: float

    @property
    def cells_per_s(self) -> float:
        return self.cells / self.seconds

    def as_dict(self) -> dict:
        cpu = max(self.cpu_seconds, 1e-9)
        return {
            "cells": self.cells,
            "batches": self.steps,
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "cells_per_s": self.cells_per_s,
            "cells_per_cpu_s": self.cells / cpu,
            "cpu_per_wall": self.cpu_seconds / self.seconds,
        }


def window(
    step: Callable[[], int],
    *,
    seconds: float = MIN_WINDOW_S,
    until: Callable[[], bool] | None = None,
    finish: Callable[[], object] | None = None,
) -> Window:
    """Call ``step`` (returning the cells it served) until at least ``seconds`` have passed and, if
    given, ``until()`` is true (e.g. at a fetch boundary, so the window holds whole fetches);
    ``finish()`` (e.g. waiting for work still in flight) runs inside the window, at its end. A
    ``StopIteration`` from ``step`` (data that ends, e.g. a single cold epoch) ends the window early:
    its ``seconds`` then say how long it was."""
    cells = steps = 0
    cpu0, start = time.process_time(), time.perf_counter()
    while time.perf_counter() - start < seconds or (until is not None and not until()):
        try:
            cells += step()
        except StopIteration:
            break
        steps += 1
    if finish is not None:
        finish()
    elapsed = time.perf_counter() - start
    return Window(cells, elapsed, steps, time.process_time() - cpu0)


def loader_windows(
    loader: Iterable,
    batch_size: int,
    *,
    seconds: float = MIN_WINDOW_S,
    rounds: int = 1,
    waited: Callable[[object], object] = lambda batch: batch,
) -> list[dict]:
    """``rounds`` windows of at least ``seconds`` over ``loader``'s batches of ``batch_size`` cells,
    each batch's ``waited(batch)`` (the whole batch, or e.g. its ``x``) waited for on the devices,
    after a warm-up of at least 8 batches or 4,096 cells: kernels loaded, the read-ahead and the
    buffer pools full."""
    import jax

    it = iter(loader)
    for _ in range(max(8, 4096 // batch_size)):
        jax.block_until_ready(waited(next(it)))

    def step() -> int:
        jax.block_until_ready(waited(next(it)))
        return batch_size

    return [window(step, seconds=seconds).as_dict() for _ in range(rounds)]


def timed(step: Callable[[], int], *, seconds: float = MIN_WINDOW_S) -> tuple[int, float]:
    """Call ``step`` (returning the cells it served) until at least ``seconds`` have passed; return
    ``(cells, seconds)`` of the whole window."""
    w = window(step, seconds=seconds)
    return w.cells, w.seconds


def run_json(args: list[str], *, checkout: str | None = None) -> dict:
    """``python args…`` in a fresh process; the JSON object its last line of output prints. With
    ``checkout`` (a ``--baseline``), that checkout's packages first on the path and its folder the
    working directory (``-c`` puts the working directory first)."""
    env = None if checkout is None else {**os.environ, "PYTHONPATH": checkout}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=checkout)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def medians(results: list[dict], keys: Iterable[str]) -> dict:
    """For each of ``keys`` present in every result: its median over ``results`` and, as
    ``<key>_runs``, every round's value."""
    out: dict = {}
    for key in keys:
        if results and all(r.get(key) is not None for r in results):
            values = [r[key] for r in results]
            out[key], out[f"{key}_runs"] = median(values), values
    return out


# ----- command-line options of the timed benchmarks ---------------------------------------------


def add_window_options(
    parser: argparse.ArgumentParser,
    *,
    seconds: float | None = MIN_WINDOW_S,
    rounds: int | None = MIN_ROUNDS,
    seconds_flag: str = "--seconds",
    rounds_flag: str = "--rounds",
) -> None:
    """``--seconds`` (the timed window of one round), ``--rounds`` and ``--quick`` (either of the
    first two left out with None)."""
    if seconds is not None:
        parser.add_argument(
            seconds_flag,
            type=float,
            default=None,
            help=f"seconds timed per round, after the warm-up (default {seconds:g}; at least "
            f"{MIN_WINDOW_S:g} unless --quick, whose default is {QUICK_WINDOW_S:g})",
        )
        parser.set_defaults(_window_default=seconds)
    if rounds is not None:
        parser.add_argument(
            rounds_flag,
            type=int,
            default=None,
            help=f"timed rounds; figures are their medians (default {rounds}; at least {MIN_ROUNDS} "
            "unless --quick, whose default is 1)",
        )
        parser.set_defaults(_rounds_default=rounds)
    quick = [text for text, on in (("a short window", seconds), ("one round", rounds)) if on is not None]
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run"
        + (f" ({', '.join(quick)})" if quick else "")
        + ": results go to a temporary folder, not benchmarks/results/",
    )


def check_window(
    args: argparse.Namespace,
    *,
    seconds_attr: str = "seconds",
    rounds_attr: str = "rounds",
    seconds_flag: str = "--seconds",
    rounds_flag: str = "--rounds",
) -> None:
    """Fill in the defaults of `add_window_options` and refuse, in one line, a window shorter than
    `MIN_WINDOW_S` or fewer rounds than `MIN_ROUNDS` unless ``--quick``."""
    prog = Path(sys.argv[0]).name
    if hasattr(args, "_window_default"):
        if getattr(args, seconds_attr) is None:
            setattr(args, seconds_attr, QUICK_WINDOW_S if args.quick else args._window_default)
        require_window(getattr(args, seconds_attr), seconds_flag, quick=args.quick)
    if hasattr(args, "_rounds_default"):
        if getattr(args, rounds_attr) is None:
            setattr(args, rounds_attr, 1 if args.quick else args._rounds_default)
        value = getattr(args, rounds_attr)
        if value < 1:
            raise SystemExit(f"{prog}: {rounds_flag} must be at least 1, got {value}")
        if value < MIN_ROUNDS and not args.quick:
            raise SystemExit(
                f"{prog}: {rounds_flag} {value} is below the minimum of {MIN_ROUNDS} rounds (figures are "
                "medians); pass --quick for a smoke run (results not kept)"
            )


def require_window(seconds: float, flag: str, *, quick: bool) -> None:
    """Refuse, in one line, a timed window (the option ``flag``) shorter than `MIN_WINDOW_S` unless ``quick``."""
    prog = Path(sys.argv[0]).name
    if not seconds > 0:
        raise SystemExit(f"{prog}: {flag} must be positive, got {seconds:g}")
    if seconds < MIN_WINDOW_S and not quick:
        raise SystemExit(
            f"{prog}: {flag} {seconds:g} is below the {MIN_WINDOW_S:g} s minimum window; "
            "pass --quick for a smoke run (results not kept)"
        )


def require_input(path: str | os.PathLike[str], made_by: str, option: str) -> None:
    """Stop, in one line, where the data a benchmark reads is not there yet: which script makes it
    (``made_by``) and which option (``option``) points at another."""
    if not Path(path).exists():
        prog = Path(sys.argv[0]).name
        raise SystemExit(f"{prog}: {path} is missing: make it with {made_by} first, or pass {option}")


def result_path(out: str | os.PathLike[str], *, quick: bool) -> Path:
    """``out``, except that a ``--quick`` run never writes under ``benchmarks/results/``: its file goes
    to `QUICK_RESULTS` instead."""
    path = Path(out)
    if quick and path.resolve().is_relative_to(RESULTS.resolve()):
        return QUICK_RESULTS / path.resolve().relative_to(RESULTS.resolve())
    return path


def write_result(out: str | os.PathLike[str], result: dict, *, quick: bool = False) -> Path:
    """Write ``result`` as JSON to `result_path` and say where."""
    path = result_path(out, quick=quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {path}" + (" (--quick: not a result to quote)" if quick else ""), flush=True)
    return path


def compare(what: str, ours: dict | None, peer: dict | None, key: str = "cells_per_s") -> dict | None:
    """One comparison for the report: our row's and the peer's median ``key`` (rows with a
    ``label``) and their ratio, ours ÷ peer; None when either row lacks the figure."""
    if not ours or not peer or ours.get(key) is None or peer.get(key) is None:
        return None
    return {
        "what": what,
        "key": key,
        "ours": ours["label"],
        "peer": peer["label"],
        "ours_value": ours[key],
        "peer_value": peer[key],
        "ratio": ours[key] / peer[key],
    }
