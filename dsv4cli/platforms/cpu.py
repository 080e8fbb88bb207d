"""The host CPU: fp32 by default (bf16 matmuls are slow on most CPUs), gloo, eager steps."""
import os

import torch

from . import Platform


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
    priority = 0
    default_dtype = "float32"
    dist_backend = "gloo"
    routes_on_host = True

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
