"""The kernel seam: every op the model runs that a platform may run its own way.

`reference.py` is the oracle: plain torch, no device branch, runs anywhere. A platform names its kernel
module (`Platform.kernels`: `cpu.py`, `cuda.py`, `npu.py`, or the reference), which takes the reference's
ops and replaces what it runs faster; `Transformer.prepare` binds it once to every module of the model
(`module_for`). docs/decisions.md has the op table (op, reference, NPU op, CUDA path).
"""
import importlib
from types import ModuleType

import torch

from dsv4cli import platforms


def module_for(device: torch.device) -> ModuleType:
    """The kernel module of the device's platform, imported on first use (torch_npu only where an NPU is used)."""
    return importlib.import_module(f"{__name__}.{platforms.for_device(device).kernels}")
