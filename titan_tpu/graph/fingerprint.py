"""The fingerprint of a program handed to XLA: what ties a run to the program `titan-tpu compile`
certified.

A program is identified by its module text as handed to XLA (StableHLO, from our lowering through
JAX or from TorchTPU's), with source locations taken out: they name files and lines of the
process that traced it, not what the program computes. Two processes that trace the same step
for the same devices print the same fingerprint; any change of an op, a shape, a sharding, a
donation or a collective changes it.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["program_fingerprint"]

_LOCATION = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")  # an op's trailing loc(...), one level of nesting
_LOCATION_ALIAS = re.compile(r"^#loc\d*\s*=.*$\n?", re.M)  # "#loc3 = loc(...)" definitions


def program_fingerprint(module_text: str) -> str:
    """16 hex digits of the SHA-256 of the module text without its source locations."""
    text = _LOCATION_ALIAS.sub("", _LOCATION.sub("", module_text))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
