"""A training run that stalls at a chosen step, for the kill-and-resume tests.

    python tests/_train_kill_worker.py MARKER STALL_AT <omicsio-train arguments>
    python tests/_train_kill_worker.py MARKER STALL_AT pretrain <omicsio-train pretrain arguments>

Runs `train.fit` (or `train.pretrain`) on the parsed command line; after step STALL_AT (and its checkpoint, if one is
due) it writes MARKER and sleeps, so the test can SIGKILL it at exactly that step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from train import fit
from train._cli import parse_config, parse_pretrain_config
from train._pretrain import pretrain


def main() -> None:
    marker, stall_at, argv = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]

    def stall(record: dict) -> None:
        if record["step"] == stall_at:
            marker.write_text(str(stall_at))
            time.sleep(600)

    if argv[:1] == ["pretrain"]:
        pretrain(parse_pretrain_config(argv[1:]), callback=stall)
    else:
        fit(parse_config(argv), callback=stall)


if __name__ == "__main__":
    main()
