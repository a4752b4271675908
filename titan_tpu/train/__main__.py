"""``python -m titan_tpu.train --config ...``: the same as ``titan-tpu train``."""

import sys

from titan_tpu.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
