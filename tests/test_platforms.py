"""The platform registry decides the device, dtype, distributed backend, graphs and kernels."""
import ast
import importlib.util
from pathlib import Path

import pytest
import torch

import dsv4cli.model.model
from dsv4cli import kernels, loading, platforms
from dsv4cli.config import Settings
from dsv4cli.engine.graphs import DecodeGraphs
from dsv4cli.errors import UsageError
from dsv4cli.kernels import cpu as cpu_kernels
from dsv4cli.kernels import reference
from dsv4cli.platforms import Platform
from dsv4cli.platforms.cuda import CudaPlatform


def test_builtin_platforms_and_device_choices():
    assert platforms.names() == ("cpu", "cuda", "npu")
    choices = next(f.metadata["key"].choices for f in Settings.__dataclass_fields__.values() if f.name == "device")
    assert choices == ("auto", "cpu", "cuda", "npu")
    cpu = platforms.for_device(torch.device("cpu"))
    assert (cpu.dist_backend, cpu.default_dtype, cpu.routes_on_host, cpu.graph_api()) == ("gloo", "float32", True, None)
    assert [platforms.get(n).dist_backend for n in ("cuda", "npu")] == ["nccl", "hccl"]
    assert platforms.get("npu").compile_backend == "npu" and cpu.compile_backend == "inductor"
    builtin = [platforms.get(n) for n in platforms.names()]
    assert [(p.name, p.device_type, p.packs_weights, p.routes_on_host) for p in builtin] == [
        ("cpu", "cpu", True, True), ("cuda", "cuda", False, False), ("npu", "npu", False, False)]
    assert all(platforms.for_device(p.device_type) is p for p in builtin)
    assert kernels.module_for(torch.device("cpu")) is cpu_kernels and platforms.get("npu").kernels == "npu"
    assert set(reference.__all__) <= set(vars(cpu_kernels))            # every op of the seam
    assert cpu.free_memory(torch.device("cpu")) > 0
    assert DecodeGraphs.for_device(torch.device("cpu")) is None
    auto = platforms.pick("auto")
    assert auto.is_available() and all(p.priority <= auto.priority for p in map(platforms.get, platforms.names())
                                       if p.is_available())


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed")
def test_an_unusable_device_is_a_usage_error():
    with pytest.raises(UsageError, match="torch_npu is not installed"):
        loading.pick_device("npu")
    with pytest.raises(LookupError, match="unknown device 'tpu'"):
        platforms.pick("tpu")


def test_a_registered_platform_is_picked_and_drives_the_device_choices(monkeypatch):
    """A platform of higher priority, registered here, is what `auto` picks: its device, its dtype,
    its graphs and its distributed backend. (It lives on the meta device, which torch knows.)"""
    class MetaAccelerator(Platform):
        name = "meta"
        device_type = "meta"
        priority = 100
        default_dtype = "float16"
        dist_backend = "gloo"

        def is_available(self):
            return True

        def graph_api(self):
            return torch.cuda.CUDAGraph, torch.cuda.graph       # what a captured platform returns

    monkeypatch.setitem(platforms._REGISTRY, "meta", MetaAccelerator())
    device = loading.pick_device("auto")
    assert device == torch.device("meta") and loading.pick_dtype(Settings(), device) == torch.float16
    assert loading.pick_dtype(Settings(dtype="bfloat16"), device) == torch.bfloat16
    graphs = DecodeGraphs.for_device(device)
    assert graphs.graph_cls is torch.cuda.CUDAGraph
    assert "meta" in platforms.names() and platforms.for_device(device).dist_backend == "gloo"
    assert loading.pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("detected", [True, False])
def test_platforms_sharing_a_device_type_are_told_apart_by_their_detection(monkeypatch, detected):
    """A platform of torch's "cuda" device type detected on its own (as ROCm's would be, by torch.version.hip)
    is a --device choice by its name, and the platform of cuda tensors wherever it is detected."""
    class HipStandIn(CudaPlatform):
        name = "rocm"
        priority = 11                # asked before CUDA, whose detection a ROCm build passes too
        kernels = "reference"

        def is_available(self):
            return detected

    monkeypatch.setitem(platforms._REGISTRY, "rocm", HipStandIn())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)      # a GPU, whichever kind
    assert platforms.names()[-1] == "rocm" and platforms.get("rocm").device() == torch.device("cuda")
    assert type(platforms.for_device(torch.device("cuda", 0))) is (HipStandIn if detected else CudaPlatform)
    assert platforms.for_device("cpu") is platforms.get("cpu")
    if detected:
        assert platforms.pick("rocm").device_type == "cuda"
    else:
        with pytest.raises(LookupError):
            platforms.pick("rocm")


def test_the_reference_lists_every_op_the_model_calls():
    """Every `<module>.ops.<op>` in model.py (the bound kernel module) is an op of the seam, so every
    platform's kernel module (`from .reference import *`) has it."""
    tree = ast.parse(Path(dsv4cli.model.model.__file__).read_text())
    called = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
              and isinstance(node.value, ast.Attribute) and node.value.attr == "ops"}
    assert {"mhc_head", "routed_experts", "unpack_w8a8", "expert_table"} <= called     # the walk finds them
    assert sorted(called - set(reference.__all__)) == []
    assert all(callable(getattr(reference, op)) for op in called)
