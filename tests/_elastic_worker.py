"""One JAX process of the elastic-restore and Grain tests (run by tests/test_multihost.py, not collected).

    python tests/_elastic_worker.py PROCESS_ID NUM_PROCESSES PORT DATASET CHECKPOINTS MODE OUT.json

MODE ``save:K``: serve K steps of an epoch with make_loader, then save the loader's state with
Orbax (``CheckpointManager`` step K, ``grain.checkpoint.CheckpointSave``: one file per process);
also compare make_grain_loader (0 and 2 worker processes) with make_loader on this host.
MODE ``resume:K``: restore the states of step K, whatever number of processes wrote them
(``oj.read_loader_states``), and serve the rest of the epoch. OUT.json gets the global rows this
process served and whether its coverage audit passed.
"""

import json
import os
import sys


def main() -> None:
    process_id, num_processes, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dataset, checkpoints, mode, out = sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax

    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=120,
        )
    import grain
    import numpy as np
    import orbax.checkpoint as ocp

    import omicsio_jax as oj

    ds = oj.open_dataset(dataset)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    kw = {
        "batch_size": 32,
        "sampling": oj.Block(16, 4, drop_remainder=False),
        "seed": 9,
        "num_epochs": 1,
        "obs": ("drug",),
    }
    loader = oj.make_loader(ds, **kw, placement=mesh)
    action, k = mode.split(":")
    k = int(k)
    served, report = [], {"process_index": jax.process_index(), "process_count": jax.process_count()}

    def local(batch) -> list[int]:
        shards = sorted(batch.index.addressable_shards, key=lambda s: s.index[0].start)
        return np.concatenate([np.asarray(s.data) for s in shards]).tolist()

    if action == "save":
        for _ in range(k):
            served.extend(local(next(loader)))
        with ocp.CheckpointManager(checkpoints) as mngr:
            mngr.save(k, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(loader)))
        expected = [local(b) for b in oj.make_loader(ds, **kw, placement=mesh)]
        for workers in (0, 2):
            grain_loader = oj.make_grain_loader(ds, **kw, placement=mesh, worker_count=workers)
            report[f"grain_w{workers}_equal"] = [b.index.tolist() for b in grain_loader] == expected
    else:
        loader.set_state(oj.read_loader_states(os.path.join(checkpoints, str(k), "data")))
        try:
            for batch in loader:
                served.extend(local(batch))
            report["audit"] = "passed"
        except oj.CoverageError as e:
            report["audit"] = str(e)
    report["served"] = served
    with open(out, "w") as f:
        json.dump(report, f)
    if num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
