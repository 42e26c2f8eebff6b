"""materialize over an existing dataset on S3, SIGKILLed at one stage of the replacement:
``write`` (the new generation's first upload), ``switch`` (just before the prefix's manifest is
rewritten) or ``delete`` (just before the old generation is deleted)."""

from __future__ import annotations

import os
import signal
import sys

from materialize import Layout, materialize
from omicsio_jax.storage import store

STAGE = sys.argv[3]


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _wrap(name: str, when) -> None:
    original = getattr(store.S3Store, name)

    def wrapped(self, *args, **kwargs):
        if when(self, *args):
            _kill()
        return original(self, *args, **kwargs)

    setattr(store.S3Store, name, wrapped)


_wrap("upload", lambda self, *a: STAGE == "write" and "/gen-" in self.url)
_wrap("write_bytes", lambda self, key, *a: STAGE == "write" and "/gen-" in self.url)
_wrap(
    "write_bytes",
    lambda self, key, *a: STAGE == "switch" and key == "manifest.json" and "/gen-" not in self.url,
)
_wrap("delete", lambda self, *a: STAGE == "delete" and "/gen-" not in self.url)

if __name__ == "__main__":
    materialize(
        sys.argv[1], sys.argv[2], progress=False, workers=1, overwrite=True, layout=Layout(shard_cells=512)
    )
    sys.exit(3)  # not killed: the stage was never reached
