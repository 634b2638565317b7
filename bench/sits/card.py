"""The scorecard's shape: one Dimension per SITS2026 dimension, each with its measured figures and its
matrix cell, or the reason a figure could not be measured on this host (and which host would); and
seed 003's three columns, the reference every cell is printed beside (the seed's own words, in
English: its table is a claim about other platforms, not something this host can measure)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The dimensions in the seed's order: key, title, the service that owns it (DESIGN.md).
DIMENSIONS = (
    ("gpu_aware_routing", "GPU-aware routing", "router"),
    ("kv_cache_sharing", "KV-cache sharing granularity", "kvcache"),
    ("dynamic_batching", "Dynamic batching window", "router + worker"),
    ("memory_fragmentation", "Memory fragmentation", "kvcache + worker"),
    ("long_context_switch", "Long-context switching cost (4K -> 32K)", "worker + router sessions"),
    ("heterogeneous_orchestration", "Heterogeneous orchestration", "control + launcher"),
)
TITLES = {key: title for key, title, _ in DIMENSIONS}

# Seed 003's matrix ("SITS2026六维评估结果对比（典型部署场景）"), column by column, row by row.
SEED_COLUMNS = {
    "FastAPI + Triton": {
        "gpu_aware_routing": "no", "kv_cache_sharing": "no", "dynamic_batching": "no",
        "memory_fragmentation": "37%", "long_context_switch": "112 ms", "heterogeneous_orchestration": "no",
    },
    "vLLM + custom router": {
        "gpu_aware_routing": "yes (PCIe-aware)", "kv_cache_sharing": "yes (request level)", "dynamic_batching": "yes",
        "memory_fragmentation": "12%", "long_context_switch": "48 ms",
        "heterogeneous_orchestration": "partly (configured by hand)",
    },
    "SITS2026 certified": {
        "gpu_aware_routing": "yes (NVLink + free memory)", "kv_cache_sharing": "yes (session + layer)",
        "dynamic_batching": "yes (latency feedback loop)", "memory_fragmentation": "4.2%",
        "long_context_switch": "19 ms", "heterogeneous_orchestration": "yes (automatic IR adaptation)",
    },
}


@dataclass(slots=True)
class Unmeasured:
    """A figure this run could not measure: what, why, and the host (or mode) that would."""

    what: str
    why: str
    where: str

    def as_dict(self) -> dict:
        return {"what": self.what, "why": self.why, "where": self.where}


@dataclass(slots=True)
class Dimension:
    key: str
    # The matrix cell: a short summary of the figures ("" when nothing was measured).
    cell: str = ""
    figures: dict = field(default_factory=dict)
    unmeasured: list[Unmeasured] = field(default_factory=list)
    # Why the whole dimension has no figures (it failed, or the target cannot run its workload).
    error: str = ""
    seconds: float = 0.0

    @property
    def title(self) -> str:
        return TITLES[self.key]

    @property
    def status(self) -> str:
        """measured (every figure), partial (some could not be here) or not_measured."""
        if self.error or not self.figures:
            return "not_measured"
        return "partial" if self.unmeasured else "measured"

    def as_dict(self) -> dict:
        return {"key": self.key, "title": self.title, "status": self.status, "cell": self.cell,
                "figures": self.figures, "not_measured": [u.as_dict() for u in self.unmeasured],
                "reason": self.error or None, "seed": {col: cells[self.key] for col, cells in SEED_COLUMNS.items()},
                "seconds": round(self.seconds, 1)}
