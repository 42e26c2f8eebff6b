"""Fault soak: a 2-host Grain training loop over a dataset on S3 (moto's server on 127.0.0.1)
behind a proxy that injects faults (`_fault_proxy`: 500 and 503 responses, resets, slow and
truncated bodies, ETag changes), for ``--minutes``, checked batch by batch against the fault-free
run of the same loader over the local copy of the same dataset.

Each host is a process (`_soak_host`: ``Placement(process_index=h, process_count=2)``, a Grain
``DataLoader`` with one worker process, the iterator checkpointed with Orbax every few steps, each
in its own checkpoint directory; JAX's distributed runtime is not started, as the loader needs
only the process index and count). While they run, the soak

- SIGKILLs a Grain worker of each host now and then: the loop meets a one-line ``RuntimeError``,
  restores its latest Orbax checkpoint into a new loader and goes on;
- SIGTERMs host 0 at random steps: it saves the current step's checkpoint and exits 0, is started
  again, restores and goes on;
- flips one byte of a chunk in the cache the hosts share: the reader must notice (the chunk's
  hash) and fetch it again.

Kills and SIGTERMs stop at ``--minutes`` (a host not yet hit by one gets its first after): the run
then drains, its hosts recovering and serving until every fault kind has been met, two epochs
audited, an ETag change surfaced and a restore has replayed steps already served, with the proxy's
faults going on. A host restarted every 15 s on a slow machine would otherwise spend the drain
starting up. (On a loaded machine every fault of a short run can land while a host is starting
up, where a restore goes back no step; the drain then waits for one that lands mid-stream.)

Every batch a host serves, replays after a restore included, must equal the fault-free run's at
that step (a 128-bit digest of its cells and values); every epoch's coverage audit must pass (over
both hosts, each cell served exactly once); every fault must be absorbed by a retry or surface as a
one-line error (an ETag change: "changed while in use ... open it again", or a request whose
retries ran out), after which the host restores, as a training job does; any other error (a shard
called corrupted, a traceback) counts as a crash. Host 1's RSS, sampled every 10 s, must not grow
more than 5% once warm: the median of the last fifth of the run against the median of the second
fifth (the first fifth warms JAX, numba and the caches up; medians, as batch buffers come and go
between samples; the peak over the warm median is reported beside). A small cache keeps the reads
going to S3 throughout. A host that has served nothing for a minute after a kill is asked
(SIGUSR1) for every thread's stack, which the results file keeps under ``stalls``.

    .venv/bin/python benchmarks/soak.py                      # 30 minutes: results/soak.json
    .venv/bin/python benchmarks/soak.py --quick                # a smoke run: half a minute (tests/test_soak.py)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
STALL_S = 60.0  # a kill not recovered from in this long: the host's stacks are taken (`Host.check_stall`)
sys.path.insert(0, str(HERE))
from _fault_proxy import FaultProxy  # noqa: E402
from _local_s3 import start_moto  # noqa: E402
from _provenance import provenance, write_result  # noqa: E402
from _soak_host import CACHE_BYTES, CHECKPOINT_EVERY, children, digest, loader_options  # noqa: E402


def _flip_a_cached_byte(remote, local, cache: Path) -> dict | None:
    """Flip one byte inside a fetched chunk of a shard's sparse mirror in ``cache``, then read that
    chunk's cells: the reader must notice (the chunk's hash) and fetch it again."""
    from omicsio_jax import ObjectStoreError

    for shard, entry in enumerate(remote.manifest.shards):
        path = next(cache.rglob(entry.path), None)
        if path is None or path.stat().st_blocks == 0:
            continue
        data = np.fromfile(path, np.uint8)
        ranges = remote.chunk_index(shard).chunk_bytes(np.arange(remote.chunk_index(shard).num_chunks))
        for chunk, (lo, hi) in enumerate(ranges.tolist()):
            if hi - lo > 64 and data[lo:hi].any():  # fetched (a mirror's missing bytes read as zeros)
                at = (lo + hi) // 2
                with open(path, "r+b") as f:
                    f.seek(at)
                    f.write(bytes([data[at] ^ 0x5A]))
                group = remote.chunk_reader.group_size if remote.chunk_reader else 16
                first = entry.first_cell + chunk * group
                rows = np.arange(first, min(first + group, entry.first_cell + entry.num_cells))
                found = {"shard": entry.path, "byte": at, "cells": rows.tolist()[:1] + rows.tolist()[-1:]}
                surfaced = []  # the proxy's faults a read may surface (it is read again, as a loop would)
                for _ in range(8):
                    try:
                        same = all(
                            np.array_equal(a, b)
                            for a, b in zip(remote.read_csr(rows), local.read_csr(rows), strict=True)
                        )
                        return {**found, "read_back_exact": same, "surfaced": surfaced}
                    except ObjectStoreError as e:  # an ObjectChangedError among them
                        surfaced.append(f"{type(e).__name__}: {e}")
                    except Exception as e:  # noqa: BLE001 - reported in the results
                        return {**found, "error": f"{type(e).__name__}: {e}", "surfaced": surfaced}
                return {**found, "error": "every read surfaced a fault", "surfaced": surfaced}
    return None


class Host:
    """One `_soak_host` process as the soak sees it: started (again), its log read and checked
    against the fault-free run's batches, its recoveries counted."""

    def __init__(self, index: int, hosts: int, url: str, work: Path, seed: int, env: dict, local):
        import omicsio_jax as oj

        self.index, self.url, self.work, self.seed, self.env = index, url, work, seed, env
        self.log = work / f"host-{index}.log"
        self.log.touch()
        self.offset = 0
        self.expected = oj.make_loader(local, **loader_options(seed, index, hosts))
        self.digests: list[str] = []
        self.rows: list[np.ndarray] = []  # each expected step's cells, until its epoch is audited
        self.served: set[int] = set()  # steps served and checked
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.up = False  # has served a batch since it last started or restored
        self.killed_workers = self.worker_deaths = self.recovered = self.sigterms = self.resumes = 0
        self.awaiting = self.restarted = False  # a worker killed, not yet recovered from; a restore since
        self.killed_at = 0.0  # when the last worker was killed
        self.stalls: list[dict] = []  # kills not recovered from within STALL_S: the host's stacks then
        self.preempted = False  # SIGTERM sent, the resume from its checkpoint not yet seen
        self.batches = self.replayed = self.mismatches = 0
        self.errors: list[dict] = []
        self.surfaced: list[str] = []
        self.exit_seconds: list[float] = []
        self.seen_workers: set[tuple[int, str]] = set()  # (pid, start time): none may outlive its host
        self.start()

    def start(self) -> None:
        err = (self.work / f"host-{self.index}.err").open("ab")
        args = [str(HERE / "_soak_host.py"), self.url, str(self.work), str(self.index), "2", str(self.seed)]
        self.proc = subprocess.Popen([sys.executable, *args], env=self.env, stdout=err, stderr=err)
        self.up = False
        self.pid = None  # until it logs its start (by then SIGUSR1 dumps stacks, not ends it)

    def expected_digest(self, step: int) -> str:
        while len(self.digests) <= step:
            batch = next(self.expected)
            self.digests.append(digest(batch))
            self.rows.append(np.asarray(batch.index)[np.asarray(batch.mask)])
        return self.digests[step]

    def poll(self) -> None:
        """Read what the host logged since the last poll; restart it if it exited."""
        with self.log.open() as f:
            f.seek(self.offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            self._record(json.loads(line))
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            if code != 0:
                self.errors.append({"type": "HostExit", "message": f"host {self.index} exited with {code}"})
            self.start()

    def _record(self, r: dict) -> None:
        event = r.get("event")
        if event is None:  # a batch
            step = r["s"]
            self.batches += 1
            self.replayed += step in self.served
            self.mismatches += r["d"] != self.expected_digest(step)
            self.served.add(step)
            self.up = True
            if self.awaiting and self.restarted:  # a batch from a new loader: the kill recovered from
                self.recovered += 1
                self.awaiting = self.restarted = False
            return
        self.up = False
        if event in ("start", "restored"):
            self.restarted = True
        if event == "start":
            self.pid = r["pid"]
            self.resumes += r["step"] > 0
            self.preempted = False
        elif event == "sigterm":
            self.exit_seconds.append(r["seconds_to_exit"])
        elif event == "error":
            message = f"{r['type']}: {r['message']}"
            if "Worker process was terminated unexpectedly" in r["message"] and self.awaiting:
                self.worker_deaths += 1
            elif r["type"] in ("ObjectChangedError", "ObjectStoreError") and r["one_line"]:
                self.surfaced.append(message)  # an ETag change, or a request whose retries ran out
            else:
                self.errors.append({"type": r["type"], "message": r["message"], "one_line": r["one_line"]})

    def workers(self) -> list[int]:
        """The host's Grain worker processes (its children but Python's resource tracker)."""
        found = []
        for child in children(self.proc.pid):
            with contextlib.suppress(OSError):
                if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(child)
        return found

    def kill_a_worker(self) -> bool:
        workers = self.workers()  # (seen by the poll just before)
        if not (self.up and workers):
            return False
        os.kill(workers[0], signal.SIGKILL)
        self.killed_workers += 1
        self.up, self.awaiting, self.restarted = False, True, False
        self.killed_at = time.perf_counter()
        return True

    def check_stall(self, now: float) -> None:
        """A kill not recovered from within `STALL_S`: the host's threads' stacks (SIGUSR1 makes it
        write them to its .err file) and its Grain workers, recorded once per kill."""
        if not self.awaiting or now - self.killed_at < STALL_S or len(self.stalls) >= self.killed_workers:
            return
        if self.pid != self.proc.pid:  # (re)started, its handler not yet installed
            return
        err = self.work / f"host-{self.index}.err"
        before = err.stat().st_size
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGUSR1)
        time.sleep(1)
        with err.open("rb") as f:
            f.seek(before)
            stacks = f.read().decode(errors="replace")
        self.stalls.append(
            {
                "kill": self.killed_workers,
                "seconds_since_kill": round(now - self.killed_at, 1),
                "restarted": self.restarted,
                "workers": [_process(w) is not None for w in self.workers()],
                "stacks": stacks[-6000:],
            }
        )

    def terminate(self) -> bool:
        if not self.up:
            return False
        self.proc.send_signal(signal.SIGTERM)
        self.sigterms += 1
        self.up, self.preempted = False, True
        return True

    def rss(self) -> int | None:
        with contextlib.suppress(OSError):
            return int(Path(f"/proc/{self.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return None


def _process(pid: int) -> tuple[int, str] | None:
    """``(pid, start time)`` of a running process (None: gone, or a zombie): a pid is reused."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (pid, fields[19])


def _median(values: list[int]) -> int:
    return int(np.median(values)) if values else 0


def soak(minutes: float, cells: int, rate: float, seed: int, work: Path) -> dict:
    """Two hosts of a Grain loop on S3 behind the fault proxy, killed and preempted, for ``minutes``."""
    server, endpoint = start_moto()
    import boto3

    import omicsio_jax as oj
    from materialize import Layout, make_synthetic_corpus, materialize

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="soak")
    corpus = make_synthetic_corpus(
        work / "corpus", num_cells=cells, seed=seed, write_h5ad=False, progress=False
    )
    layout = Layout(shard_cells=1024)
    materialize(corpus.cells_parquet, work / "local", progress=False, layout=layout)
    materialize(corpus.cells_parquet, "s3://soak/ds", progress=False, layout=layout)

    proxy = FaultProxy(endpoint, rate=rate, seed=seed)
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # the flip's reader reads through the proxy too
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint}
    local = oj.open_dataset(work / "local")
    hosts = [Host(h, 2, "s3://soak/ds", work, seed, env, local) for h in range(2)]
    steps_per_epoch = hosts[0].expected.steps_per_epoch  # each host's

    rng = np.random.default_rng(seed)
    kill_every, term_every = max(60 * minutes / 15, 10.0), max(60 * minutes / 10, 15.0)
    start = time.perf_counter()
    deadline, hard_stop = start + 60 * minutes, start + 180 * minutes + 300
    next_kill = [start + kill_every * rng.uniform(0.5, 1.5) for _ in hosts]
    next_term = start + term_every * rng.uniform(0.5, 1.5)
    audited, counts = 0, np.zeros(cells, np.int64)
    rss: list[tuple[float, int]] = []  # host 1's, every 10 s
    next_rss = start
    flipped = None
    crash = None

    def done() -> bool:
        return (
            time.perf_counter() >= deadline
            and audited >= 2
            and len(proxy.injected) == len(proxy.faults)
            and all(h.recovered and not h.awaiting for h in hosts)
            and hosts[0].resumes > 0
            and not hosts[0].preempted
            and any(h.surfaced for h in hosts)
            and any(h.replayed for h in hosts)
        )

    try:
        while not done() and time.perf_counter() < hard_stop:
            time.sleep(0.5)
            now = time.perf_counter()
            for h in hosts:
                h.poll()
            # an epoch both hosts served in full: each of its cells served exactly once
            epoch_steps = range(audited * steps_per_epoch, (audited + 1) * steps_per_epoch)
            if all(set(epoch_steps) <= h.served for h in hosts):
                counts[:] = 0
                for h in hosts:
                    for step in epoch_steps:
                        np.add.at(counts, h.rows[step], 1)
                        h.rows[step] = None
                if not (counts == 1).all():
                    bad = int((counts != 1).sum())
                    hosts[0].errors.append(
                        {"type": "CoverageError", "message": f"epoch {audited}: {bad} cells not served once"}
                    )
                audited += 1
                if flipped is None:
                    remote = oj.open_dataset(
                        "s3://soak/ds", cache_dir=work / "cache", cache_bytes=CACHE_BYTES
                    )
                    flipped = _flip_a_cached_byte(remote, local, work / "cache")
                    remote.close()
            for h in hosts:
                h.seen_workers.update(filter(None, map(_process, h.workers())))
            if now >= next_rss and (r := hosts[1].rss()) is not None:
                rss.append((round(now - start, 1), r))
                next_rss = now + 10
            for h in hosts:
                h.check_stall(now)
            # kills and SIGTERMs for ``minutes`` (past it, only a first one not yet made): then the
            # run drains, its hosts recovering and serving the epochs still to audit
            for i, h in enumerate(hosts):
                if (now < deadline or not h.killed_workers) and now >= next_kill[i] and h.kill_a_worker():
                    next_kill[i] = now + kill_every * rng.uniform(0.5, 1.5)
            if (now < deadline or not hosts[0].sigterms) and now >= next_term and hosts[0].terminate():
                next_term = now + term_every * rng.uniform(0.5, 1.5)
    except Exception as e:  # noqa: BLE001 - a crash of the soak itself: reported, not hidden
        crash = {"type": type(e).__name__, "message": str(e)}
    finally:
        (work / "stop").touch()
        for h in hosts:
            try:
                h.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                h.proc.kill()
            h.expected.close()
        time.sleep(2)
        orphans = [w for h in hosts for w in h.seen_workers if _process(w[0]) == w]
        for pid, _ in orphans:  # left by a host that exited: reported, then cleaned up
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proxy.stop()
        server.stop()
    elapsed = time.perf_counter() - start
    errors = [e for h in hosts for e in h.errors] + ([crash] if crash else [])
    # warmed up past a fifth of the run (JAX, numba and the caches have filled): the median RSS of
    # the second fifth against the last fifth's (medians: batch buffers come and go between samples)
    warm = _median([r for t, r in rss if elapsed / 5 <= t < 2 * elapsed / 5])
    end = _median([r for t, r in rss if t >= 4 * elapsed / 5])
    peak = max((r for t, r in rss if t >= elapsed / 5), default=0)
    surfaced = [m for h in hosts for m in h.surfaced]
    out = {
        "cells": cells,
        "rate": rate,
        "seed": seed,
        "hosts": 2,
        "grain_workers_per_host": 1,
        "checkpoint_every_steps": CHECKPOINT_EVERY,
        "seconds": elapsed,
        "batches": sum(h.batches for h in hosts),
        "replayed_after_restores": sum(h.replayed for h in hosts),
        "mismatches": sum(h.mismatches for h in hosts),
        "epochs_audited": audited,
        "workers_killed": [h.killed_workers for h in hosts],
        "worker_deaths_seen": [h.worker_deaths for h in hosts],
        "worker_kills_recovered": [h.recovered for h in hosts],
        "stalls": [{"host": h.index, **stall} for h in hosts for stall in h.stalls],
        "sigterms": hosts[0].sigterms,
        "orbax_resumes": [h.resumes for h in hosts],
        "sigterm_to_exit_seconds_max": max(hosts[0].exit_seconds, default=None),
        "grain_workers_seen": sum(len(h.seen_workers) for h in hosts),
        "grain_workers_left_running": len(orphans),
        "requests": proxy.requests,
        "faults_injected": dict(proxy.injected),
        "flipped": flipped,
        "errors": errors,
        "surfaced_and_resumed": len(surfaced),
        "surfaced_examples": sorted(set(surfaced))[:5],
        "rss_host": 1,
        "rss_warm_bytes": warm,
        "rss_end_bytes": end,
        "rss_growth": (end / warm - 1) if warm and end else None,
        "rss_peak_over_warm": (peak / warm - 1) if warm else None,
        "rss_every_10s": rss,
    }
    checks = {
        "no errors": not errors,
        "a changed object read back exactly": flipped is not None and flipped.get("read_back_exact") is True,
        "no mismatches": out["mismatches"] == 0,
        "two epochs audited": audited >= 2,
        "every killed worker recovered": all(h.recovered == h.killed_workers > 0 for h in hosts),
        "every SIGTERM resumed": hosts[0].resumes == hosts[0].sigterms > 0,
        "no Grain worker left running": not orphans,
        "RSS growth measured (a run long enough to warm up)": out["rss_growth"] is not None,
        "RSS growth under 5%": out["rss_growth"] is not None and out["rss_growth"] < 0.05,
    }
    out["failed_checks"] = [name for name, ok in checks.items() if not ok]
    out["passed"] = not out["failed_checks"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=None, help="how long (default 30; 0.5 with --quick)")
    p.add_argument("--cells", type=int, default=20_000)
    p.add_argument("--rate", type=float, default=0.05, help="share of the GETs given a fault")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: results in a temporary folder")
    p.add_argument("--out", default=str(HERE / "results" / "soak.json"))
    args = p.parse_args()
    minutes = args.minutes if args.minutes is not None else (0.5 if args.quick else 30.0)
    with tempfile.TemporaryDirectory(prefix="omicsio-soak-") as tmp:
        result = {
            "benchmark": "soak",
            **provenance(),
            "quick": args.quick,
            **soak(minutes, args.cells, args.rate, args.seed, Path(tmp)),
        }
    path = write_result(args.out, result, quick=args.quick)
    print(
        f"{'PASSED' if result['passed'] else 'FAILED'}: {result['batches']:,} batches, {result['epochs_audited']} "
        f"epochs audited, {result['mismatches']} mismatches, workers killed {result['workers_killed']}, "
        f"SIGTERMs {result['sigterms']}, Orbax resumes {result['orbax_resumes']}, faults {result['faults_injected']} of "
        f"{result['requests']:,} requests, errors {result['errors']}, RSS growth {result['rss_growth']}; {path}"
        + (f"\nfailed: {'; '.join(result['failed_checks'])}" if result["failed_checks"] else "")
    )
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
