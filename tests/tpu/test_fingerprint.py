"""A program's fingerprint (graph/fingerprint.py) names what it computes, not where the code that
traced it is installed: a Pallas kernel's Mosaic body carries the kernel file's absolute path in
its bytecode, which a clean clone elsewhere (CI's) would otherwise fingerprint differently."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax.experimental import pallas as pl

from titan_tpu.graph.fingerprint import program_fingerprint


def _add_kernel(x_ref, o_ref, *, amount):
    o_ref[...] = x_ref[...] + amount


def _lowered_for_tpu(amount: float, file_prefix: str | None) -> str:
    """A one-kernel program lowered for TPU, its source files' names with `file_prefix` cut off."""
    kernel = functools.partial(_add_kernel, amount=amount)

    def program(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x) * 2

    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    with jax_config.hlo_source_file_canonicalization_regex(file_prefix):
        return jax.jit(program).trace(x).lower(lowering_platforms=("tpu",)).as_text()


def test_a_kernel_counts_by_its_ops_not_the_path_its_file_lies_at():
    here, moved = _lowered_for_tpu(1.0, None), _lowered_for_tpu(1.0, r"^/")
    assert "tpu_custom_call" in here and here != moved  # the kernel bodies differ only in file names
    assert program_fingerprint(here) == program_fingerprint(moved)


def test_a_changed_kernel_changes_the_fingerprint():
    assert program_fingerprint(_lowered_for_tpu(1.0, None)) != program_fingerprint(_lowered_for_tpu(2.0, None))
