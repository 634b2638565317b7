"""Accelerator discovery through NVML (the nvidia-ml-py package); empty on hosts without NVIDIA's driver."""

from __future__ import annotations

import logging
import os
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


@dataclass(frozen=True, slots=True)
class DeviceDescription:
    """What a worker computes on (reported with its load)."""

    # "cuda" or "cpu".
    kind: str
    name: str
    # Device memory (RAM for a CPU worker), bytes.
    memory_total: int
    uuid: str = ""
    pci_bus_id: str = ""
    # PCI bus ids of the GPUs it reaches over NVLink.
    nvlink_peers: tuple[str, ...] = ()
    cpu_cores: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class DeviceSample:
    memory_used: int
    memory_total: int
    # Busy share of the device, 0..1.
    utilization: float


class CpuMonitor:
    """A CPU worker's cores and the machine's RAM, read from /proc."""

    def __init__(self, cores: set[int]) -> None:
        self._cores = tuple(sorted(cores)) or tuple(sorted(os.sched_getaffinity(0)))
        self._last: dict[int, tuple[int, int]] = {}
        self._description = DeviceDescription("cpu", _cpu_model(), _meminfo().get("MemTotal", 0), cpu_cores=self._cores)

    def describe(self) -> DeviceDescription:
        return self._description

    def sample(self) -> DeviceSample:
        info = _meminfo()
        total = info.get("MemTotal", 0)
        used = total - info.get("MemAvailable", total)
        busy = idle = 0
        for core, (b, i) in _cpu_times(self._cores).items():
            pb, pi = self._last.get(core, (b, i))
            busy, idle = busy + b - pb, idle + i - pi
            self._last[core] = (b, i)
        return DeviceSample(used, total, busy / (busy + idle) if busy + idle else 0.0)


class GpuMonitor:
    """One GPU through NVML, initialised once."""

    def __init__(self, index: int) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(self._handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        self._description = DeviceDescription(
            "cuda", name.decode() if isinstance(name, bytes) else name, int(mem.total),
            uuid=_text(_try(pynvml.nvmlDeviceGetUUID, self._handle)),
            pci_bus_id=_text(getattr(_try(pynvml.nvmlDeviceGetPciInfo, self._handle), "busId", "")),
            nvlink_peers=tuple(self._nvlink_peers()),
        )

    def _nvlink_peers(self) -> list[str]:
        nv, peers = self._nvml, []
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if nv.nvmlDeviceGetNvLinkState(self._handle, link) != nv.NVML_FEATURE_ENABLED:
                    continue
                peers.append(_text(nv.nvmlDeviceGetNvLinkRemotePciInfo(self._handle, link).busId))
            except nv.NVMLError:
                break
        return sorted(set(peers))

    def describe(self) -> DeviceDescription:
        return self._description

    def sample(self) -> DeviceSample:
        mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        util = _try(self._nvml.nvmlDeviceGetUtilizationRates, self._handle)
        return DeviceSample(int(mem.used), int(mem.total), (util.gpu / 100.0) if util is not None else 0.0)


def _try(fn, *args):
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _text(value) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "cpu"


def _cpu_times(cores: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """(busy, idle) jiffies of each core."""
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                core = int(name[3:])
                if core in cores:
                    values = [int(v) for v in fields[:8]]
                    idle = values[3] + values[4]
                    out[core] = (sum(values) - idle, idle)
    except (OSError, ValueError):
        pass
    return out
