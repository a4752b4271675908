"""``python -m titan_tpu.train --config ...``: the same as ``titan-tpu train``."""

import sys

from titan_tpu.cli import exit_process, main

if __name__ == "__main__":
    exit_process(main(["train", *sys.argv[1:]]))
