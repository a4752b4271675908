"""Model converters: what `build` (models/spec.py) applies to a model, in order, between building
it on the meta device and materialising it, and after it is initialised.

A converter is one object with `name`, `enabled(cfg)`, `convert(model, cfg)` (on the meta-device
model, before sharding: what it adds is sharded like the rest) and `after_init(model, cfg, seed)`
(on the materialised, maybe sharded model). `CONVERTERS` lists them in the order they apply:
LoRA (adapters on the targeted linears, the base frozen), then fp8 (Float8 linears, and with
fp8.experts Float8 MoE experts), which refuses a layer LoRA adapted. Another conversion (another
quantisation) is one file defining a converter and one line here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torch import nn

if TYPE_CHECKING:
    from titan_tpu.config import Config

__all__ = ["CONVERTERS", "Converter", "enabled_converters"]


class Converter(Protocol):
    name: str

    def enabled(self, cfg: Config) -> bool: ...

    def convert(self, model: nn.Module, cfg: Config) -> None: ...

    def after_init(self, model: nn.Module, cfg: Config, *, seed: int) -> None: ...


class LoRAConverter:
    name = "lora"

    def enabled(self, cfg: Config) -> bool:
        return cfg.lora.enabled

    def convert(self, model: nn.Module, cfg: Config) -> None:
        from titan_tpu.models.lora import add_adapters

        add_adapters(model, cfg.lora)

    def after_init(self, model: nn.Module, cfg: Config, *, seed: int) -> None:
        from titan_tpu.models.lora import freeze_base, init_lora_

        init_lora_(model, seed=seed)  # in the stored (maybe sharded) parameters
        freeze_base(model)


class Float8Converter:
    name = "fp8"

    def enabled(self, cfg: Config) -> bool:
        return cfg.fp8.enabled

    def convert(self, model: nn.Module, cfg: Config) -> None:
        from titan_tpu.models.fp8 import convert_to_float8

        convert_to_float8(model, scaling=cfg.fp8.scaling, target_modules=cfg.fp8.target_modules,
                          emulate=cfg.fp8.emulate, experts=cfg.fp8.experts)

    def after_init(self, model: nn.Module, cfg: Config, *, seed: int) -> None:
        pass


CONVERTERS: list[Converter] = [LoRAConverter(), Float8Converter()]


def enabled_converters(cfg: Config) -> list[Converter]:
    """The converters `cfg` turns on, in the order they apply."""
    return [c for c in CONVERTERS if c.enabled(cfg)]
