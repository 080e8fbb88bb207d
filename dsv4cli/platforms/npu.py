"""Ascend NPUs through torch_npu (imported only when asked about): bf16, HCCL, NPU graphs, the
torch_npu fused-op kernels (`dsv4cli.kernels.npu`), and torch_npu's "npu" torch.compile backend
(registered when torch_npu is imported)."""
import importlib.util

import torch

from . import Platform


class NpuPlatform(Platform):
    name = "npu"
    device_type = "npu"
    priority = 20
    dist_backend = "hccl"
    compile_backend = "npu"
    kernels = "npu"
    reads_release_formats = False

    def is_available(self) -> bool:
        try:
            import torch_npu  # noqa: F401 - registers the npu device and torch.npu
        except ImportError:
            return False
        return torch.npu.is_available()

    def unavailable_reason(self) -> str:
        if importlib.util.find_spec("torch_npu") is None:
            return "--device npu: torch_npu is not installed (pip install -e '.[npu]')"
        return "--device npu: no NPU is available"

    def set_device(self, rank: int, world: int) -> torch.device:
        torch.npu.set_device(rank)
        return self.device(rank)

    def graph_api(self):
        return torch.npu.NPUGraph, torch.npu.graph

    def free_memory(self, device) -> int:
        return torch.npu.mem_get_info(device)[0]

    def synchronize(self, device) -> None:
        torch.npu.synchronize(device)
