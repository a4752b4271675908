"""``python -m titan_tpu COMMAND ...`` (what ``torchrun ... -m titan_tpu train --config ...`` launches):
the same as the ``titan-tpu`` console script."""

from titan_tpu.cli import run

if __name__ == "__main__":
    run()
