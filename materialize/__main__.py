import sys

from ._cli import main

if __name__ == "__main__":  # the shard writer process (spawn) imports this module too
    sys.exit(main())
