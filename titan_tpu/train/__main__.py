"""`python -m titan_tpu.train`: the launch line the docs gave before the `train` command took its
place (`python -m titan_tpu train`, `titan-tpu train`). It answers with one line naming the new one,
rather than Python's "No module named titan_tpu.train.__main__"."""

import sys

if __name__ == "__main__":
    print("error: `-m titan_tpu.train` is now `-m titan_tpu train` (a space, not a dot): e.g. torchrun --standalone "
          "--nproc_per_node 2 -m titan_tpu train --config configs/llama3_debug.toml", file=sys.stderr)
    sys.exit(2)
