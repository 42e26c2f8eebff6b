"""One of several processes reading a dataset's shards with direct reads on 8 threads at once:
every thread holds its reads open until every process's threads do (a barrier of files), then
checks each group's bytes against the file's. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

import omicsio_jax as oj
from omicsio_jax.storage import aio, direct_io

THREADS = 8


def main(dataset_dir: str, ready_dir: str, index: int, processes: int) -> None:
    with oj.open_dataset(dataset_dir, direct_io=False) as ds:
        paths = [ds.local_path(s.path) for s in ds.manifest.shards]
        indexes = [ds.chunk_index(i) for i in range(len(paths))]
    raws = [p.read_bytes() for p in paths]
    ready = Path(ready_dir)

    def everyone_holds_reads() -> None:  # the last of this process's threads: wait for every process
        (ready / str(index)).touch()
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < processes and time.monotonic() < deadline:
            time.sleep(0.02)

    barrier = threading.Barrier(THREADS, action=everyone_holds_reads)
    failures: list[str] = []

    def read(thread: int) -> None:
        rng = np.random.default_rng(1000 * index + thread)
        groups = []
        for _ in range(12):
            f = int(rng.integers(len(paths)))
            chunks = np.sort(rng.choice(indexes[f].num_chunks, 6, replace=False))
            ranges = indexes[f].chunk_bytes(chunks)
            groups.append((np.full(len(ranges), f, np.int64), ranges))
        reads = direct_io.DirectReads()
        out = reads.read_groups(paths, groups)
        got = [next(out)]  # this thread's reads are under way (a context leased, or read buffered)
        barrier.wait()
        got += list(out)
        for (files, ranges), (buf, base, ends) in zip(groups, got, strict=True):
            for f, (lo, hi), at, end in zip(
                files.tolist(), ranges.tolist(), base.tolist(), ends.tolist(), strict=True
            ):
                if end != hi or bytes(buf[at : at + hi - lo]) != raws[f][lo:hi]:
                    failures.append(f"thread {thread}: bytes {lo}..{hi} of {paths[f].name} differ")

    threads = [threading.Thread(target=read, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"failures": failures, "contexts": aio.contexts().made}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
