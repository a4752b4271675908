"""The kernel registry: each hot op has a plain-PyTorch reference and per-backend variants.

An `Op` (attention, the output-projection + cross-entropy loss, ...) holds named `Impl`s. Model
and step code call the op through the implementation chosen for the run (`Op.resolve`), never a
backend's kernel directly, so one model runs on CPU, CUDA and TPU and a new kernel is one more
registration. Each op's reference is the definition: every other implementation is tested
against it, forward and gradients (tests/test_kernels.py).

Choosing: `"auto"` takes the first implementation in the op's preference list for the device
type that can run here and supports what the call needs (e.g. document masks); a name picks that
implementation, and one that cannot run here is a one-line error naming those that can.

`device_type_as` / `kernel_device_type`: the device type whose kernels model code gets (a step
captured on CPU for the JAX lowering asks for "jax"); here so that kernel modules can read it
without importing the package that imports them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = ["Impl", "KernelShapeError", "Op", "device_type_as", "kernel_device_type"]


class KernelShapeError(ValueError):
    """A kernel cannot take the shapes of this call (e.g. splash's blocks of 128). kernel: the
    implementation's name; `titan-tpu compile` then lowers the op's CPU pick instead and says so."""

    def __init__(self, kernel: str, message: str):
        super().__init__(message)
        self.kernel = kernel


@dataclass(frozen=True)
class Impl:
    """One implementation of an op.

    devices: device types it runs on ("cpu", "cuda", "tpu").
    jax_form: for the device type "jax" (a step captured on CPU and lowered to JAX by
    `titan-tpu compile`, kernels/jax_traced.py): () -> None when the implementation enters the
    lowered program as its own JAX function (the TPU's Pallas kernels) and can here, else the
    reason; None for an implementation with no JAX form, which takes part in a JAX-traced step
    as the ATen ops it runs on CPU, if it runs on CPU.
    unavailable: () -> None when it can run in this process, else the reason (e.g. a package is
    missing); checked lazily, so registering never imports a backend.
    features: what it supports beyond the op's basic form (e.g. {"documents"}).
    """

    name: str
    fn: Callable
    devices: tuple[str, ...]
    description: str
    features: frozenset[str] = frozenset()
    unavailable: Callable[[], str | None] = lambda: None
    jax_form: Callable[[], str | None] | None = None

    def why_not(self, device_type: str, needs: frozenset[str] = frozenset(), *,
                installed: bool = False) -> str | None:
        """None when it runs on `device_type` with `needs`; else a short reason. installed: answer
        for a machine of that device type with every package the implementation needs (a TPU VM
        with torch-tpu, jax and tokamax), not for this process."""
        if device_type == "jax" and self.jax_form is not None:
            missing = needs - self.features
            if missing:
                return f"does not support {', '.join(sorted(missing))}"
            return None if installed else self.jax_form()
        if device_type == "jax":  # traced as the ATen ops it runs on CPU
            reason = self.why_not("cpu", needs, installed=installed)
            return None if reason is None else f"has no JAX form and {reason}"
        if device_type not in self.devices:
            return f"runs on {'/'.join(self.devices)}, not {device_type}"
        missing = needs - self.features
        if missing:
            return f"does not support {', '.join(sorted(missing))}"
        return None if installed else self.unavailable()


@dataclass(eq=False)  # compared and hashed by identity: one object per op
class Op:
    """An op with its implementations and, per device type, the order `auto` tries them in."""

    name: str
    config_key: str  # the config field that selects it, e.g. "kernels.attention"
    impls: dict[str, Impl] = field(default_factory=dict)
    preference: dict[str, list[str]] = field(default_factory=dict)

    def register(self, impl: Impl) -> Impl:
        assert impl.name not in self.impls and impl.name != "auto", impl.name
        self.impls[impl.name] = impl
        return impl

    def check_name(self, choice: str) -> None:
        """Config-time check: the name exists (whether it runs here is checked by `resolve`)."""
        if choice != "auto" and choice not in self.impls:
            raise ValueError(f"{self.config_key} = {choice!r} is not a known implementation; "
                             f"use auto or one of {', '.join(self.impls)}")

    def resolve(self, choice: str, device_type: str, needs: frozenset[str] = frozenset(), *,
                installed: bool = False) -> Impl:
        """The implementation to run for `choice` ("auto" or a name) on `device_type`. For auto
        the preference list is the one for "<device>+<needs>" when there is one (e.g.
        "cuda+documents"), else the device's. installed: pick as a machine of that device type
        with every package installed would (`Impl.why_not`)."""
        self.check_name(choice)
        if choice != "auto":
            impl = self.impls[choice]
            reason = impl.why_not(device_type, needs, installed=installed)
            if reason is not None:
                raise ValueError(f"{self.config_key} = {choice} cannot run here ({reason}); "
                                 f"available on {device_type}: {', '.join(self.available(device_type, needs))}")
            return impl
        specific = f"{device_type}+{'+'.join(sorted(needs))}"
        for name in self.preference.get(specific, self.preference.get(device_type, [])):
            if self.impls[name].why_not(device_type, needs, installed=installed) is None:
                return self.impls[name]
        raise ValueError(f"{self.config_key}: no implementation runs on {device_type}"
                         + (f" with {', '.join(sorted(needs))}" if needs else ""))

    def available(self, device_type: str, needs: frozenset[str] = frozenset()) -> list[str]:
        return [name for name, impl in self.impls.items() if impl.why_not(device_type, needs) is None]


_DEVICE_TYPE_AS: dict[str, str] = {}


@contextlib.contextmanager
def device_type_as(device_type: str, as_type: str) -> Iterator[None]:
    """Inside the block, model code asking for the kernels of `device_type` (its tensors' device)
    gets those of `as_type`: a step captured on CPU for the JAX lowering asks for "jax"
    (kernels/jax_traced.py)."""
    previous = _DEVICE_TYPE_AS.get(device_type)
    _DEVICE_TYPE_AS[device_type] = as_type
    try:
        yield
    finally:
        if previous is None:
            del _DEVICE_TYPE_AS[device_type]
        else:
            _DEVICE_TYPE_AS[device_type] = previous


def kernel_device_type(device_type: str) -> str:
    """The device type whose kernels model code on `device_type` gets: "jax" for "cpu" inside
    `device_type_as("cpu", "jax")` (a step captured for the JAX lowering), else `device_type`."""
    return _DEVICE_TYPE_AS.get(device_type, device_type)
