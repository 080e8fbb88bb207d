"""The device-specific choices, one platform per kind of device, in a registry keyed by the platform's name.

A platform says whether its device is usable here, the dtype a model runs in by default, the
torch.distributed backend, how to capture a step graph, the torch.compile backend and whether it can
compile here, which kernel module runs the ops (`dsv4cli.kernels`), whether the loader packs weights for
those kernels, whether routed experts read their routing on the host, whether the host's thread count is
the model's, and how to query free memory and synchronise. Nothing else in dsv4cli branches on the device
type (a test checks).

A platform's name (the --device value) is apart from its torch device type: ROCm's HIP devices are torch's
"cuda" too. Platforms sharing a device type are told apart by their own detection (`is_available`):
`for_device` gives the available one of highest priority among them.

Adding a platform takes three files: its module here, `<name>.py`, with a `Platform` subclass (`name`,
`device_type`, `is_available`, and what differs from the defaults; `kernels = "reference"` until it has a
kernel module of its own); its registration, one `BUILTIN` entry (which also makes it a --device choice);
and its tests in tests/test_platforms.py. A ROCm platform would be `name = "rocm"`, `device_type = "cuda"`,
available where `torch.version.hip` is set, with a priority above CUDA's (whose detection a ROCm build
passes too).

The registry loads without torch (the settings list its names as --device choices, and `dsv4 --help`
and `dsv4 config show` must start fast): the built-in platforms are imported on the first lookup.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Platform:
    """One kind of device. Subclasses set the class attributes and override what differs."""

    name: str                       # the --device value and the registry's key
    device_type: str                # torch's type of its devices ("cuda" for ROCm's too)
    priority = 0                    # `--device auto` takes the available platform with the highest
    default_dtype = "bfloat16"      # a torch dtype name, the `--dtype auto` choice
    dist_backend = "gloo"
    compile_backend = "inductor"
    kernels = "reference"           # the kernel module in dsv4cli.kernels that runs the ops on this device
    # Whether the loader packs the big weights into the kernel module's own layouts (`pack_w8a8`,
    # `pack_linear_fp32`) as it reads them; elsewhere weights are held plain (a packed one is unpacked).
    packs_weights = False
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
        """Whether this platform's device is usable here (its own detection)."""
        raise NotImplementedError

    def unavailable_reason(self) -> str:
        return f"no {self.name} device is available"

    def device(self, index: int | None = None) -> torch.device:
        import torch

        return torch.device(self.device_type, index)

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

    def weight_copy(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of a weight read as stored (`--no-mmap`, or a device apart from the host) on `device`."""
        return t.to(device, copy=True)

    def synchronize(self, device: torch.device) -> None:
        pass


_REGISTRY: dict[str, Platform] = {}
# platform name -> its class in dsv4cli.platforms.<name>
BUILTIN = {"cpu": "CpuPlatform", "cuda": "CudaPlatform", "npu": "NpuPlatform"}


def _registry() -> dict[str, Platform]:
    """The registry with every built-in platform in it (imported now if not yet); a platform registered
    under a built-in's name stays."""
    for name, cls in BUILTIN.items():
        if name not in _REGISTRY:
            register(getattr(importlib.import_module(f"{__name__}.{name}"), cls)())
    return _REGISTRY


def register(platform: Platform) -> None:
    """Add a platform, or replace the one registered under its name."""
    _REGISTRY[platform.name] = platform


def names() -> tuple[str, ...]:
    return tuple(dict.fromkeys([*BUILTIN, *_REGISTRY]))


def get(name: str) -> Platform | None:
    return _registry().get(name)


def for_device(device: torch.device | str) -> Platform:
    """The platform of a device (one of its tensors' `.device`, or a torch device type): the one registered
    for its type, or of several sharing it, the available one of highest priority (else the highest)."""
    device_type = device if isinstance(device, str) else device.type
    sharing = sorted((p for p in _registry().values() if p.device_type == device_type), key=lambda p: -p.priority)
    if not sharing:
        raise ValueError(f"no platform is registered for device type {device_type!r} (known: {', '.join(names())})")
    if len(sharing) == 1:       # detection asked only where it decides
        return sharing[0]
    return next((p for p in sharing if p.is_available()), sharing[0])


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

