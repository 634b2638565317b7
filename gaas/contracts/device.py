"""Placement by device: what a pool's workers need (a model's `device:` in deploy/gaas.yaml) and
what a device offers (its profile: a host's CPU, or one of its GPUs as NVML describes it), and
whether one fits the other, with the reason when it does not. Pure: the launcher asks it of its
host's devices (gaas.host.profiles), `gaas placement` explains each pool's choice, and the tests
give it fake profiles.

`device:` is a kind (any, cpu, gpu) or a mapping:
    device: {kind: gpu, gpu_memory_gib: 40, gpu_models: [H100, H200], compute_capability: "9.0",
             interconnect: nvlink}
    device: {kind: cpu, cpu_cores: 2, memory_gib: 8}
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

KINDS = ("any", "cpu", "gpu")
# device's fields: the file's name -> what it says.
FIELDS = {
    "kind": "any, cpu or gpu: the host its workers need",
    "gpu_memory_gib": "the least memory of each GPU a worker gets, GiB",
    "gpu_models": "GPU names one of which the device's name contains (e.g. [H100, H200])",
    "compute_capability": "the least CUDA compute capability, e.g. \"8.0\"",
    "interconnect": "nvlink: a GPU with NVLink to another; any (the default)",
    "cpu_cores": "the least CPU cores a CPU host has",
    "memory_gib": "the least memory a CPU host has, GiB",
}
INTERCONNECTS = ("any", "nvlink")
CC_RE = re.compile(r"\d+\.\d+")


class DeviceError(ValueError):
    """A device requirement that cannot be read; the message names the field and what it takes.
    field: the field at fault ("" for the whole)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class DeviceRequirement:
    kind: str = "any"
    gpu_memory_gib: float = 0.0
    gpu_models: tuple[str, ...] = ()
    compute_capability: str = ""
    interconnect: str = "any"
    cpu_cores: int = 0
    memory_gib: float = 0.0

    @classmethod
    def parse(cls, doc: object) -> DeviceRequirement:
        """From a deployment file's `device:` (a kind or a mapping); DeviceError naming the field."""
        if doc is None:
            return cls()
        if isinstance(doc, str):
            if doc not in KINDS:
                raise DeviceError(f"device must be one of {', '.join(KINDS)} or a mapping of "
                                  f"{', '.join(FIELDS)}, got {doc!r}")
            return cls(kind=doc)
        if not isinstance(doc, Mapping):
            raise DeviceError(f"device must be one of {', '.join(KINDS)} or a mapping of {', '.join(FIELDS)}")
        for key in doc:
            if key not in FIELDS:
                raise DeviceError(f"unknown device requirement {key!r}; device has "
                                  + "; ".join(f"{k}: {v}" for k, v in FIELDS.items()), str(key))
        kind = str(doc.get("kind", "any"))
        if kind not in KINDS:
            raise DeviceError(f"device.kind must be one of {', '.join(KINDS)}, got {kind!r}", "kind")
        gpu_keys = [k for k in ("gpu_memory_gib", "gpu_models", "compute_capability", "interconnect") if k in doc]
        cpu_keys = [k for k in ("cpu_cores", "memory_gib") if k in doc]
        if kind == "cpu" and gpu_keys:
            raise DeviceError(f"device.{gpu_keys[0]} is a GPU's; a pool of kind cpu cannot need it (kind: gpu?)",
                              gpu_keys[0])
        if kind == "gpu" and cpu_keys:
            raise DeviceError(f"device.{cpu_keys[0]} is a CPU host's; a pool of kind gpu cannot need it", cpu_keys[0])
        if gpu_keys and kind == "any":
            kind = "gpu"
        if cpu_keys and kind == "any":
            kind = "cpu"
        kw: dict = {"kind": kind}
        for key in ("gpu_memory_gib", "memory_gib"):
            if key in doc:
                v = doc[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                    raise DeviceError(f"device.{key} must be a number of GiB above 0, got {v!r}", key)
                kw[key] = float(v)
        if "cpu_cores" in doc:
            v = doc["cpu_cores"]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DeviceError(f"device.cpu_cores must be a whole number of cores, 1 or more, got {v!r}",
                                  "cpu_cores")
            kw["cpu_cores"] = v
        if "gpu_models" in doc:
            v = doc["gpu_models"]
            if isinstance(v, str):
                v = [v]
            if not isinstance(v, list) or not v or not all(isinstance(x, str) and x.strip() for x in v):
                raise DeviceError("device.gpu_models must be a list of GPU names, e.g. [H100, H200]", "gpu_models")
            kw["gpu_models"] = tuple(x.strip() for x in v)
        if "compute_capability" in doc:
            v = str(doc["compute_capability"])
            if not CC_RE.fullmatch(v):
                raise DeviceError(f"device.compute_capability must be MAJOR.MINOR, e.g. \"8.0\", got {v!r}",
                                  "compute_capability")
            kw["compute_capability"] = v
        if "interconnect" in doc:
            v = str(doc["interconnect"])
            if v not in INTERCONNECTS:
                raise DeviceError(f"device.interconnect must be one of {', '.join(INTERCONNECTS)}, got {v!r}",
                                  "interconnect")
            kw["interconnect"] = v
        return cls(**kw)

    def as_dict(self) -> dict:
        """What the file would say (only what differs from needing nothing)."""
        out: dict = {"kind": self.kind}
        for key in ("gpu_memory_gib", "compute_capability", "cpu_cores", "memory_gib"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.gpu_models:
            out["gpu_models"] = list(self.gpu_models)
        if self.interconnect != "any":
            out["interconnect"] = self.interconnect
        return out

    @classmethod
    def from_dict(cls, d: Mapping | str | None) -> DeviceRequirement:
        return cls.parse(d)

    @property
    def simple(self) -> bool:
        """Only a kind (what `device: KIND` says)."""
        return self == DeviceRequirement(kind=self.kind)

    def describe(self) -> str:
        parts = [{"any": "any device", "cpu": "a CPU host", "gpu": "a GPU"}[self.kind]]
        if self.gpu_models:
            parts.append(" or ".join(self.gpu_models))
        if self.gpu_memory_gib:
            parts.append(f">= {self.gpu_memory_gib:g} GiB")
        if self.compute_capability:
            parts.append(f"compute capability >= {self.compute_capability}")
        if self.interconnect == "nvlink":
            parts.append("NVLink")
        if self.cpu_cores:
            parts.append(f">= {self.cpu_cores} cores")
        if self.memory_gib:
            parts.append(f">= {self.memory_gib:g} GiB of memory")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """A device as its host reports it: a GPU (one per GPU or MIG instance), or the host's CPU."""

    kind: str  # cpu or gpu
    name: str
    # The GPU's memory, or the CPU host's, bytes.
    memory_total: int
    # GPU: its UUID (what a worker is given), compute capability, the GPUs it reaches over NVLink.
    uuid: str = ""
    compute_capability: str = ""
    nvlink_peers: tuple[str, ...] = ()
    # CPU host: its cores.
    cpu_cores: int = 0

    @property
    def label(self) -> str:
        gib = f"{self.memory_total / 2**30:.0f} GiB"
        if self.kind == "gpu":
            cc = f", cc {self.compute_capability}" if self.compute_capability else ""
            link = f", NVLink to {len(self.nvlink_peers)}" if self.nvlink_peers else ""
            return f"{self.name} ({gib}{cc}{link}) {self.uuid}".strip()
        return f"CPU {self.name} ({self.cpu_cores} cores, {gib})"


def _cc(v: str) -> tuple[int, int]:
    major, minor = v.split(".")
    return int(major), int(minor)


def misfit(need: DeviceRequirement, device: DeviceProfile) -> str:
    """Why device cannot run a worker that needs need ("" when it can)."""
    if need.kind != "any" and device.kind != need.kind:
        return f"is a {device.kind.upper()}, the pool needs {'a GPU' if need.kind == 'gpu' else 'a CPU host'}"
    gib = device.memory_total / 2**30
    if device.kind == "gpu":
        if need.gpu_models and not any(m.lower() in device.name.lower() for m in need.gpu_models):
            return f"is a {device.name}, not one of {', '.join(need.gpu_models)}"
        if need.gpu_memory_gib and gib < need.gpu_memory_gib:
            return f"has {gib:.0f} GiB, the pool needs {need.gpu_memory_gib:g} GiB"
        if need.compute_capability:
            if not device.compute_capability:
                return "reports no compute capability"
            if _cc(device.compute_capability) < _cc(need.compute_capability):
                return f"has compute capability {device.compute_capability}, below {need.compute_capability}"
        if need.interconnect == "nvlink" and not device.nvlink_peers:
            return "has no NVLink to another GPU"
    else:
        if need.cpu_cores and device.cpu_cores < need.cpu_cores:
            return f"has {device.cpu_cores} cores, the pool needs {need.cpu_cores}"
        if need.memory_gib and gib < need.memory_gib:
            return f"has {gib:.0f} GiB of memory, the pool needs {need.memory_gib:g} GiB"
    return ""


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a pool's workers may go on a host: the devices that fit, and why each other does not."""

    need: DeviceRequirement
    fits: tuple[DeviceProfile, ...]
    refused: Mapping[str, str] = field(default_factory=dict)

    @property
    def placeable(self) -> bool:
        return bool(self.fits)

    def reason(self) -> str:
        """Why none fits ("" when one does), for the pool's halt and `gaas placement`."""
        if self.fits:
            return ""
        if not self.refused:
            return f"needs {self.need.describe()}; this host has no device"
        return (f"needs {self.need.describe()}; no device of this host fits: "
                + "; ".join(f"{name} {why}" for name, why in self.refused.items()))


def choose(need: DeviceRequirement, devices: Iterable[DeviceProfile]) -> Choice:
    fits, refused = [], {}
    for d in devices:
        why = misfit(need, d)
        if why:
            refused[d.label] = why
        else:
            fits.append(d)
    return Choice(need, tuple(fits), refused)
