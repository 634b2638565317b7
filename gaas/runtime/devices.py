"""Accelerator discovery through NVML (the nvidia-ml-py package); empty on hosts without NVIDIA's driver."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    # NVML index (as CUDA_VISIBLE_DEVICES numbers them, in PCI order).
    index: int
    name: str
    memory_total: int
    memory_used: int


def list_gpus() -> list[GpuInfo]:
    """GPUs NVML can see; [] when NVML (or the driver) is missing."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("NVML unavailable (%s): no GPUs", exc)
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(GpuInfo(i, name.decode() if isinstance(name, bytes) else name, int(mem.total), int(mem.used)))
        return gpus
    except pynvml.NVMLError as exc:
        log.warning("NVML query failed: %s", exc)
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def gpu_memory(index: int) -> tuple[int, int]:
    """(used, total) bytes of one GPU, (0, 0) when unknown."""
    for g in list_gpus():
        if g.index == index:
            return g.memory_used, g.memory_total
    return 0, 0
