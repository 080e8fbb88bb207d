"""The host CPU: fp32 by default (bf16 matmuls are slow on most CPUs), gloo, eager steps, the CPU kernel
module (`kernels/cpu.py`: packed few-row GEMMs, the native indexer scan, experts routed on the host)."""
import ctypes
import functools
import os
import platform
import shutil

import torch

from . import Platform

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return libc


def weight_buffer(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor for a weight the kernels read, asked onto 2 MiB pages (madvise, before anything is
    written, so its pages fault in huge where Linux's transparent huge pages allow): a 1-row GEMM through experts
    chosen at random reads faster (the TLB's reach, and the hardware prefetchers stop at each page's end;
    docs/decisions.md: Packed weights on 2 MiB pages). Nothing changes where Linux says no."""
    out = torch.empty(*shape, dtype=dtype)
    start = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE          # the whole huge pages inside the buffer
    end = (out.data_ptr() + out.numel() * out.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end > start and (libc := _libc()) is not None:
        libc.madvise(start, end - start, MADV_HUGEPAGE)            # a refusal (THP off) leaves 4 KiB pages
    return out


def _available_bytes() -> int:
    """MemAvailable from /proc/meminfo where there is one, else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 0
    default_dtype = "float32"
    dist_backend = "gloo"
    kernels = "cpu"
    packs_weights = True
    routes_on_host = True
    on_host_cores = True

    def is_available(self) -> bool:
        return True

    def device(self, index=None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, rank: int, world: int) -> torch.device:
        # ranks share the cores instead of each starting a thread per core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        return self.device()

    def free_memory(self, device) -> int:
        return _available_bytes()

    def weight_copy(self, t, device):
        """On 2 MiB pages where Linux allows, as the packed weights are: a step reads experts chosen at random
        (docs/decisions.md, Packed weights on 2 MiB pages; a mapped file's pages are the page cache's)."""
        out = weight_buffer(*t.shape, dtype=t.dtype)
        out.view(torch.uint8).copy_(t.view(torch.uint8))
        return out

    def compile_unavailable_reason(self) -> str | None:
        compilers = (os.environ.get("CXX"), "g++", "c++", "clang++")      # inductor's C++ code needs one
        if not any(c and shutil.which(c) for c in compilers):
            return "compile: no C++ compiler found (install g++ or set CXX); running eager"
        return None
