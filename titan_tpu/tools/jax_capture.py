"""The step as the JAX path captures it (graph/jax_program.py): one device's step of the run
(tools/device_step.py) with the kernels the target runs, and the inputs the trainer's batches
carry (`trainer_documents`, `trainer_example_data`).
"""

from __future__ import annotations

__all__ = ["capture_for_jax", "trainer_documents", "trainer_example_data"]


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


def trainer_example_data(cfg, *, world_size: int, platform: str = "tpu"):
    """The kind's data parts (kinds/record.py DataParts) where the trainer captures its step with
    the data's own batch: a vision-language model on chat rows, whose batches carry images (the
    first row repeated, components/make_step.py), opened from the run's rows and model directory as
    the trainer opens them, with its document masking (none: one conversation a row). None where
    the trainer captures with its objective's example (token rows, which the capture builds)."""
    from pathlib import Path

    from titan_tpu.files import default_cache_dir
    from titan_tpu.graph.jax_program import kernel_device_type
    from titan_tpu.kinds import kind_of
    from titan_tpu.kinds.record import DataRequest
    from titan_tpu.run_setup import RunSetup
    from titan_tpu.tools.device_step import parallel_dims

    setup = RunSetup.resolved(cfg)
    image_dir = setup.spec.image_model_dir()
    if image_dir is None or not any(source.format == "chat" for source in setup.sources):
        return None
    split = parallel_dims(cfg, world_size).batch_split()  # rank 0's rows of the data-parallel ranks'
    request = DataRequest(cfg=cfg, sources=setup.sources, tokenizer_path=setup.tokenizer_path,
                          vocab_size=setup.spec.args.vocab_size,
                          cache_dir=Path(cfg.data.cache_dir or default_cache_dir()), data_rank=0,
                          data_size=split.dp_size, kernel_device=kernel_device_type(platform),
                          log=lambda message: None, image_model_dir=image_dir)
    return kind_of(cfg).data(request)
