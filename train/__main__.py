"""``python -m train``: the same as ``omicsio-train``."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
