"""NVIDIA GPUs through torch.cuda: bf16, NCCL, CUDA graphs; the CUDA kernel module (`kernels/cuda.py`:
the indexer's scan in Triton, the reference's ops otherwise)."""
import torch

from . import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    priority = 10
    dist_backend = "nccl"
    kernels = "cuda"

    def is_available(self) -> bool:
        return torch.cuda.is_available()        # a ROCm build's HIP devices too, while no ROCm platform is registered

    def unavailable_reason(self) -> str:
        return "--device cuda: no CUDA device is available"

    def set_device(self, rank: int, world: int) -> torch.device:
        torch.cuda.set_device(rank)
        return self.device(rank)

    def graph_api(self):
        return torch.cuda.CUDAGraph, torch.cuda.graph

    def free_memory(self, device) -> int:
        return torch.cuda.mem_get_info(device)[0]

    def synchronize(self, device) -> None:
        torch.cuda.synchronize(device)
