"""The step as the JAX path captures it (graph/jax_program.py): one device's step of the run
(tools/device_step.py) with the kernels the target runs, and the inputs the trainer's batches
carry (`trainer_documents`).
"""

from __future__ import annotations

__all__ = ["capture_for_jax", "trainer_documents"]


def capture_for_jax(cfg, platform: str = "tpu", **capture_args):
    """(rank's DeviceStep captured as the JAX path captures it on `platform`, cfg as captured, what
    each op ran as; graph/jax_program.py): a kernel that cannot take the shapes (splash's blocks of
    128, gmm's tiles) is replaced by the op's CPU pick, traced as ATen ops, and the op's entry says
    which and why."""
    import dataclasses

    from titan_tpu.graph.jax_program import capture_context, jax_kernels
    from titan_tpu.kernels import OPS
    from titan_tpu.kernels.registry import KernelShapeError
    from titan_tpu.tools.device_step import capture_device_step

    cfg, used = jax_kernels(cfg, platform)
    while True:
        try:
            with capture_context(platform):
                return capture_device_step(cfg, **capture_args), cfg, used
        except KernelShapeError as e:
            replaced = {}
            for field, op in OPS.items():
                if getattr(cfg.kernels, field) == e.kernel:
                    replaced[field] = op.resolve("auto", "cpu").name
                    used[field] = f"{replaced[field]} (in place of {e.kernel}: {str(e).split(';')[0]})"
            if not replaced:
                raise
            cfg = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, **replaced))


def trainer_documents(cfg) -> bool:
    """Whether the trainer's batches carry document positions: data.document_mask, or chat data
    (always packed with document masks; data/build.py uses_document_mask), read from the config
    alone (no data is opened)."""
    return bool(cfg.data.document_mask or cfg.data.format == "chat"
                or any(getattr(source, "format", "text") == "chat" for source in cfg.data.sources))
