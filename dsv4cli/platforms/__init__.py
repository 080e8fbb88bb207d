"""The device-specific choices, one platform per device type, in a registry.

A platform says whether its device is usable, the dtype a model runs in by default, the
torch.distributed backend, how to capture a step graph, the torch.compile backend and whether it can
compile here, which kernel module runs the ops (`dsv4cli.kernels`), whether routed experts read their
routing on the host, whether the host's thread count is the model's, and how to query free memory and
synchronise. Nothing else in dsv4cli branches on the device type (a test checks): a new accelerator is
a new module here with a `Platform` subclass and one `BUILTIN` entry.

The registry loads without torch (the settings list its names as --device choices, and `dsv4 --help`
and `dsv4 config show` must start fast): the built-in platforms are imported on the first lookup.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Platform:
    """One device type. Subclasses set the class attributes and override what differs."""

    name: str                       # the torch device type, also the --device value
    priority = 0                    # `--device auto` takes the available platform with the highest
    default_dtype = "bfloat16"      # a torch dtype name, the `--dtype auto` choice
    dist_backend = "gloo"
    compile_backend = "inductor"
    kernels = "reference"           # the kernel module in dsv4cli.kernels that runs the ops on this device
    # Whether routed experts read their routing on the host: where tensors live in host memory that
    # costs no device sync, and each expert runs on its own rows with its own (packed) weights;
    # accelerators keep routing on the device and run grouped GEMMs over stacked experts.
    routes_on_host = False
    # Whether the model's ops run on the host's cores: then torch's thread count is the model's
    # (`--threads`), and a second copy of the model (a compiling process's) fits in host memory.
    on_host_cores = False
    # Whether the kernels read the official release's FP8 linears and FP4 experts as stored; where not,
    # `--weights auto` re-quantises a release to W8A8 at load (the NPU's fused ops take int8 weights).
    reads_release_formats = True

    def is_available(self) -> bool:
        raise NotImplementedError

    def unavailable_reason(self) -> str:
        return f"no {self.name} device is available"

    def device(self, index: int | None = None) -> torch.device:
        import torch

        return torch.device(self.name, index)

    def set_device(self, rank: int, world: int) -> torch.device:
        """Make rank `rank` of `world` use its own device; returns that device."""
        return self.device(rank)

    def graph_api(self):
        """(graph class, capture context manager) for step-graph capture, or None to run eagerly."""
        return None

    def compile_unavailable_reason(self) -> str | None:
        """One line saying why torch.compile can't build steps for this device here, or None."""
        return None

    def free_memory(self, device: torch.device) -> int:
        raise NotImplementedError

    def synchronize(self, device: torch.device) -> None:
        pass


_REGISTRY: dict[str, Platform] = {}
# device type -> the class in dsv4cli.platforms.<device type>
BUILTIN = {"cpu": "CpuPlatform", "cuda": "CudaPlatform", "npu": "NpuPlatform"}


def _registry() -> dict[str, Platform]:
    """The registry with every built-in platform in it (imported now if not yet); a platform registered
    for a built-in device type stays."""
    for name, cls in BUILTIN.items():
        if name not in _REGISTRY:
            register(getattr(importlib.import_module(f"{__name__}.{name}"), cls)())
    return _REGISTRY


def register(platform: Platform) -> None:
    """Add a platform, or replace the one registered for its device type."""
    _REGISTRY[platform.name] = platform


def names() -> tuple[str, ...]:
    return tuple(dict.fromkeys([*BUILTIN, *_REGISTRY]))


def get(device_type: str) -> Platform | None:
    return _registry().get(device_type)


def for_device(device: torch.device | str) -> Platform:
    """The platform of a device (one of its tensors' `.device`)."""
    device_type = device if isinstance(device, str) else device.type
    platform = _registry().get(device_type)
    if platform is None:
        raise ValueError(f"no platform is registered for device type {device_type!r} (known: {', '.join(names())})")
    return platform


def pick(name: str) -> Platform:
    """The platform for a --device value: `auto` is the available one of highest priority.
    Raises LookupError with a one-line reason when the named platform is unknown or unusable."""
    if name == "auto":   # asked in priority order: a platform below the first available one is never probed
        return next(p for p in sorted(_registry().values(), key=lambda p: -p.priority) if p.is_available())
    platform = _registry().get(name)
    if platform is None:
        raise LookupError(f"unknown device {name!r} (known: {', '.join(names())})")
    if not platform.is_available():
        raise LookupError(platform.unavailable_reason())
    return platform

