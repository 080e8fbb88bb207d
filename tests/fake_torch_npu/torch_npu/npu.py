"""torch_npu.npu: the chip query the backend reads (torch_npu.npu.get_soc_version, from
torch_npu/npu/_backends.py). The stand-in models an Atlas A2 (Ascend910B1) unless a test sets
SOC_VERSION; the wheel's meta registrations treat 260 and above as Ascend 950."""
SOC_VERSION = 220


def get_soc_version() -> int:
    return SOC_VERSION
