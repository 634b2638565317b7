"""Accelerators: which NVIDIA GPUs this host has and this process may use, and watching one.

The one notion of "a GPU host", asked by the install script, the launcher and the worker alike:
at least one GPU is listed -- by NVML (the nvidia-ml-py package), or by `nvidia-smi` where that
package is not installed yet -- and CUDA_VISIBLE_DEVICES, when set, leaves it visible.

GPUs are named by UUID (GPU-..., or MIG-... for a MIG instance), which CUDA_VISIBLE_DEVICES accepts,
so a worker's GPU is the same device whatever order CUDA numbers them in; the launcher also sets
CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA's indexes are NVML's. One GPU that NVML cannot read is
skipped (and logged); it does not hide the others.

Run as a script it needs nothing beyond the standard library (scripts/install.sh runs it before the
venv exists):  python3 gaas/host/devices.py kind   -> cuda | cpu
               python3 gaas/host/devices.py list   -> one GPU per line
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    # NVML index of the physical GPU (CUDA's index too under CUDA_DEVICE_ORDER=PCI_BUS_ID).
    index: int
    # GPU-... (MIG-... for a MIG instance): what the launcher puts in a worker's CUDA_VISIBLE_DEVICES.
    uuid: str
    name: str
    memory_total: int
    memory_used: int = 0
    pci_bus_id: str = ""
    # The instance's number on its GPU when this is a MIG instance, else None.
    mig: int | None = None

    def describe(self) -> str:
        """'NVIDIA H200 (140 GiB) GPU-1a2b...' as the worker reports its device."""
        return f"{self.name} ({self.memory_total / 2**30:.0f} GiB) {self.uuid}"


def list_gpus() -> list[GpuInfo]:
    """Every GPU this host has (MIG instances in place of a GPU in MIG mode); [] without NVIDIA's
    driver. Ignores CUDA_VISIBLE_DEVICES: visible_gpus() applies it."""
    try:
        import pynvml
    except ImportError:
        return _from_nvidia_smi()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("NVML unavailable (%s): no GPUs", exc)
        return []
    try:
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            log.warning("NVML cannot count the GPUs (%s): treating this host as having none", exc)
            return []
        gpus: list[GpuInfo] = []
        for i in range(count):
            try:
                gpus.extend(_read_gpu(pynvml, i))
            except pynvml.NVMLError as exc:
                log.warning("NVML cannot read GPU %d (%s): skipping it", i, exc)
        return gpus
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _read_gpu(nv, index: int) -> list[GpuInfo]:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    name = _text(nv.nvmlDeviceGetName(h))
    pci = _text(getattr(_try(nv, nv.nvmlDeviceGetPciInfo, h), "busId", ""))
    mode = _try(nv, nv.nvmlDeviceGetMigMode, h)
    if mode is not None and mode[0] == getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1):
        # In MIG mode CUDA computes on the instances, never on the GPU itself.
        out = []
        for j in range(nv.nvmlDeviceGetMaxMigDeviceCount(h)):
            m = _try(nv, nv.nvmlDeviceGetMigDeviceHandleByIndex, h, j)
            if m is None:
                continue  # an empty slot
            mem = nv.nvmlDeviceGetMemoryInfo(m)
            out.append(GpuInfo(index, _text(nv.nvmlDeviceGetUUID(m)), _text(_try(nv, nv.nvmlDeviceGetName, m)) or f"{name} MIG {j}",
                               int(mem.total), int(mem.used), pci, mig=j))
        if not out:
            log.warning("GPU %d (%s) is in MIG mode with no MIG instance: nothing can compute on it", index, name)
        return out
    mem = nv.nvmlDeviceGetMemoryInfo(h)
    return [GpuInfo(index, _text(nv.nvmlDeviceGetUUID(h)), name, int(mem.total), int(mem.used), pci)]


def _from_nvidia_smi() -> list[GpuInfo]:
    """The GPUs as nvidia-smi lists them (before nvidia-ml-py is installed); no MIG detail."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,name,memory.total,memory.used,pci.bus_id",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6 or not parts[0].isdigit():
            continue
        try:
            total, used = int(float(parts[3])) * 2**20, int(float(parts[4])) * 2**20
        except ValueError:
            total = used = 0
        gpus.append(GpuInfo(int(parts[0]), parts[1], parts[2], total, used, parts[5]))
    return gpus


def visible_gpus(gpus: list[GpuInfo] | None = None, env: Mapping[str, str] | None = None) -> list[GpuInfo]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves to this process, in its order (all when it is unset).

    As CUDA reads it: a comma-separated list of indexes (NVML's, given CUDA_DEVICE_ORDER=PCI_BUS_ID),
    UUIDs or unique UUID prefixes (GPU-..., MIG-...); "" or -1 hides every GPU; enumeration stops at
    the first entry that names no device."""
    gpus = list_gpus() if gpus is None else gpus
    env = os.environ if env is None else env
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return gpus
    out: list[GpuInfo] = []
    for entry in (e.strip() for e in spec.split(",")):
        found = _match(gpus, entry)
        if found is None:
            if entry:
                log.warning("CUDA_VISIBLE_DEVICES=%s: %r names no GPU here; the entries after it are ignored too, "
                            "as CUDA does", spec, entry)
            break
        if found not in out:
            out.append(found)
    return out


def _match(gpus: list[GpuInfo], entry: str) -> GpuInfo | None:
    if entry.isdigit():
        # An index names a whole GPU; MIG instances are named by UUID only.
        return next((g for g in gpus if g.index == int(entry) and g.mig is None), None)
    if entry.startswith(("GPU-", "MIG-")) and len(entry) > 4:
        hits = [g for g in gpus if g.uuid.startswith(entry)]
        return hits[0] if len(hits) == 1 else None
    return None


def host_kind(env: Mapping[str, str] | None = None) -> str:
    """'cuda' when this process may use at least one GPU, else 'cpu' (see the module's docstring)."""
    return "cuda" if visible_gpus(env=env) else "cpu"


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
        self._description = DeviceDescription("cpu", cpu_model(), meminfo().get("MemTotal", 0), cpu_cores=self._cores)

    def describe(self) -> DeviceDescription:
        return self._description

    def sample(self) -> DeviceSample:
        info = meminfo()
        total = info.get("MemTotal", 0)
        used = total - info.get("MemAvailable", total)
        busy = idle = 0
        for core, (b, i) in _cpu_times(self._cores).items():
            pb, pi = self._last.get(core, (b, i))
            busy, idle = busy + b - pb, idle + i - pi
            self._last[core] = (b, i)
        return DeviceSample(used, total, busy / (busy + idle) if busy + idle else 0.0)


class GpuMonitor:
    """The worker's GPU through NVML: initialised once, then sampled (off the event loop: the
    worker's sampler thread calls sample()). Memory and utilisation are the worker's own where NVML
    can attribute them to its processes (it cannot inside some containers, whose process ids it
    does not see): then the device's."""

    def __init__(self, uuid: str, pids=None) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        # The worker's processes (itself and its engine's), asked at each sample.
        self._pids = pids or (lambda: {os.getpid()})
        self._last_seen = 0
        name = _text(pynvml.nvmlDeviceGetName(self._handle))
        mem = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        self._description = DeviceDescription(
            "cuda", name, int(mem.total), uuid=uuid,
            pci_bus_id=_text(getattr(_try(pynvml, pynvml.nvmlDeviceGetPciInfo, self._handle), "busId", "")),
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
        nv, h = self._nvml, self._handle
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        pids = self._pids()
        own = [p for p in (_try(nv, nv.nvmlDeviceGetComputeRunningProcesses, h) or []) if p.pid in pids]
        used = sum(int(p.usedGpuMemory or 0) for p in own) if own else int(mem.used)
        util = None
        samples = _try(nv, nv.nvmlDeviceGetProcessUtilization, h, self._last_seen)
        if samples:
            self._last_seen = max(s.timeStamp for s in samples)
            mine = [s.smUtil for s in samples if s.pid in pids]
            util = max(mine) / 100.0 if mine else 0.0
        if util is None:
            rates = _try(nv, nv.nvmlDeviceGetUtilizationRates, h)
            util = rates.gpu / 100.0 if rates is not None else 0.0
        return DeviceSample(used, int(mem.total), util)


def _try(nv, fn, *args):
    """fn(*args), or None when NVML answers an error (not supported, not found, ...)."""
    try:
        return fn(*args)
    except nv.NVMLError:
        return None


def _text(value) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def meminfo() -> dict[str, int]:
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


def cpu_model() -> str:
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


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="devices: %(message)s")
    what = sys.argv[1] if len(sys.argv) > 1 else "kind"
    if what == "kind":
        print(host_kind())
    elif what == "list":
        for g in visible_gpus():
            print(f"{g.index}\t{g.uuid}\t{g.name}\t{g.memory_total // 2**20} MiB\t{g.pci_bus_id}")
    else:
        sys.exit("usage: devices.py [kind|list]")
