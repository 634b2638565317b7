"""This host's devices as placement sees them (gaas.contracts.device.DeviceProfile): each GPU it
may use (NVML's name, memory, compute capability and NVLink peers), or, on a CPU host, its CPU
(model, cores, memory). The launcher places pools on them; `gaas placement` shows them."""

from __future__ import annotations

import os

from gaas.contracts.device import DeviceProfile
from gaas.host.devices import GpuInfo, cpu_model, meminfo, visible_gpus


def host_profiles(gpus: list[GpuInfo] | None = None) -> list[DeviceProfile]:
    gpus = visible_gpus() if gpus is None else gpus
    if not gpus:
        return [DeviceProfile("cpu", cpu_model(), meminfo().get("MemTotal", 0),
                              cpu_cores=len(os.sched_getaffinity(0)))]
    extra = _nvml_extra([g.uuid for g in gpus])
    return [DeviceProfile("gpu", g.name, g.memory_total, uuid=g.uuid, compute_capability=extra.get(g.uuid, ("", ()))[0],
                          nvlink_peers=extra.get(g.uuid, ("", ()))[1]) for g in gpus]


def _nvml_extra(uuids: list[str]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """uuid -> (compute capability, NVLink peers' PCI bus ids), what NVML can tell ({} without it)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML: profiles without these
        return {}
    out = {}
    try:
        for uuid in uuids:
            try:
                h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            except pynvml.NVMLError:
                continue
            peers = set()
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                        bus = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
                        peers.add(bus.decode() if isinstance(bus, bytes) else str(bus))
                except pynvml.NVMLError:
                    break
            out[uuid] = (f"{major}.{minor}", tuple(sorted(peers)))
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return out
