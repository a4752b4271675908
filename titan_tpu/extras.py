"""The optional extras of pyproject.toml a command needs: whether one is installed, else a one-line
error naming the extra and how to install it.

In the base layer so the run setup (which checks a config's [evaluation] before a run starts) and the
evaluation package (which imports lm-eval) ask the same place, and neither imports the other.
"""

from __future__ import annotations

LM_EVAL_INSTALL = "pip install 'lm-eval>=0.4,<0.5' (or the eval extra: pip install -e '.[eval]')"


def require_lm_eval(what: str = "titan-tpu eval --tasks") -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(f"{what} needs lm-evaluation-harness, which is not installed: {LM_EVAL_INSTALL}") from None
