"""One JAX process of the multi-host test (run by tests/test_multihost.py, not collected by pytest).

python tests/_multihost_worker.py PROCESS_ID NUM_PROCESSES PORT DATASET OUT.json
"""

import json
import os
import sys

process_id, num_processes, port, dataset, out = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    sys.argv[3],
    sys.argv[4],
    sys.argv[5],
)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=120,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import omicsio_jax as oj  # noqa: E402

ds = oj.open_dataset(dataset)
mesh = jax.make_mesh((jax.device_count(),), ("data",))
loader = oj.make_loader(
    ds, batch_size=32, sampling=oj.Block(16, 2), seed=5, num_epochs=2, obs=("drug",), placement=mesh
)
total = jax.jit(jnp.sum)
steps = []
for batch in loader:
    shards = sorted(batch.index.addressable_shards, key=lambda s: s.index[0].start)
    steps.append(
        {
            "local": np.concatenate([np.asarray(s.data) for s in shards]).tolist(),
            "global_shape": list(batch.x.shape),
            "index_sum": int(total(batch.index)),  # a cross-process reduction over the global batch
            "x_sum": float(total(batch.x)),
        }
    )
# Dense(on_device=True): each host's slabs placed and densified on the devices, against the same
# loader building the rows on the host; each host compares the rows its devices hold
kw = {"batch_size": 32, "sampling": oj.Block(16, 2), "seed": 5, "num_epochs": 1, "placement": mesh}
built = oj.make_loader(ds, **kw, output=oj.Dense(normalize="log1p", on_device=True))
reference = oj.make_loader(ds, **kw, output=oj.Dense(normalize="log1p"))
on_device = []
for b, r in zip(built, reference, strict=True):
    shards = {s.device.id: np.asarray(s.data) for s in r.x.addressable_shards}
    on_device.append(
        {
            "global_shape": list(b.x.shape),
            "rows_equal": all(
                np.array_equal(np.asarray(s.data), shards[s.device.id]) for s in b.x.addressable_shards
            ),
            "shards": len(b.x.addressable_shards),
            "x_sum": float(total(b.x)),
            "reference_sum": float(total(r.x)),
        }
    )
# the in-memory panel loaders: every process holds the panel, the batch spans both
panel = oj.load_panel(ds, list(range(50)), progress=False)
memory = {}
for placement in ("host", "device"):
    mem = oj.make_memory_loader(
        panel, batch_size=32, seed=3, num_epochs=1, on_device=placement == "device", placement=mesh
    )
    memory[placement] = []
    for batch in mem:
        shards = sorted(batch.index.addressable_shards, key=lambda s: s.index[0].start)
        memory[placement].append(
            {
                "local": np.concatenate([np.asarray(s.data) for s in shards]).tolist(),
                "index_sum": int(total(batch.index)),
                "x_sum": float(total(batch.x)),
            }
        )
with open(out, "w") as f:
    json.dump(
        {
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "devices": jax.device_count(),
            "local_devices": jax.local_device_count(),
            "steps_per_epoch": loader.steps_per_epoch,
            "steps": steps,
            "memory": memory,
            "on_device": on_device,
        },
        f,
    )
jax.distributed.shutdown()
