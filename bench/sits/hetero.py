"""Dimension 6, heterogeneous orchestration (control's pools, the launcher's placement): the device
profiles placement handles and how it decides. Every pool declares what its workers need (a kind,
or GPU memory, models, compute capability, NVLink; CPU cores and memory); placement
(gaas.contracts.device.choose, what `gaas up` and `gaas placement` run) matches each need against
each device of the host and says why every device it refuses does not fit. On a GPU host the
profiles are the host's own (NVML's names, memory, compute capability, NVLink peers); on a CPU host
they are its CPU plus example GPU profiles (marked as such), so the decisions can be shown. The
needs are the target's pools' and a few a deployment file would declare; the workers' backends are
what the running workers report."""

from __future__ import annotations

import time

from bench.sits.card import Dimension, Unmeasured
from bench.sits.target import Target

GiB = 2**30
# Needs a deployment file would declare (deploy/gaas.yaml's `device:`), besides the target's pools'.
EXAMPLE_NEEDS = {
    "a 70B model on linked GPUs": {"kind": "gpu", "gpu_memory_gib": 80, "interconnect": "nvlink"},
    "FP8 kernels (Ada or newer)": {"kind": "gpu", "compute_capability": "8.9"},
    "Hopper only": {"kind": "gpu", "gpu_models": ["H100", "H200"]},
    "a CPU pool": {"kind": "cpu", "cpu_cores": 8, "memory_gib": 32},
}


def example_profiles():
    """GPU profiles as NVML would describe them, for a CPU host (labelled as examples)."""
    from gaas.contracts.device import DeviceProfile

    peers = ("00000000:07:00.0", "00000000:0F:00.0")
    return [
        DeviceProfile("gpu", "NVIDIA A100-SXM4-40GB (example)", 40 * GiB, uuid="GPU-example-a100",
                      compute_capability="8.0", nvlink_peers=peers),
        DeviceProfile("gpu", "NVIDIA H100 80GB HBM3 (example)", 80 * GiB, uuid="GPU-example-h100",
                      compute_capability="9.0", nvlink_peers=peers),
        DeviceProfile("gpu", "NVIDIA L4 (example)", 23 * GiB, uuid="GPU-example-l4", compute_capability="8.9"),
    ]


def measure(t: Target, say, quick: bool = False) -> Dimension:
    from gaas.contracts.device import DeviceRequirement, choose
    from gaas.host.profiles import host_profiles

    d = Dimension("heterogeneous_orchestration")
    real = host_profiles()
    on_gpu = any(p.kind == "gpu" for p in real)
    profiles = real if on_gpu else [*real, *example_profiles()]
    if not on_gpu:
        d.unmeasured.append(Unmeasured("real GPU profiles", "NVML lists no NVIDIA GPU on this host: the GPU "
                                       "profiles are examples", "a GPU host (make gpu-check)"))
    with t.admin() as a:
        pools = a.pools()
    needs = {f"{p['model']} {p['version']} (pool)": p.get("device_needs") or p.get("device") or "any" for p in pools}
    needs.update(EXAMPLE_NEEDS)
    decisions = []
    for label, doc in needs.items():
        need = DeviceRequirement.parse(doc)
        c = choose(need, profiles)
        decisions.append({"need": label, "requires": need.describe(), "fits": [p.label for p in c.fits],
                          "refused": dict(c.refused)})
    parsed = [DeviceRequirement.parse(doc) for doc in needs.values()]
    n = 2000
    started = time.perf_counter()
    for i in range(n):
        choose(parsed[i % len(parsed)], profiles)
    per_decision_us = (time.perf_counter() - started) / n * 1e6
    workers = [{"worker": w["worker_id"], "model": f"{w['model']} {w['model_version']}", "backend": w["backend"],
                "device": w["device"], "engine": w.get("engine_version", "")} for w in t.workers()]
    d.figures = {"profiles": [{"label": p.label, "kind": p.kind, "example": not on_gpu and p.kind == "gpu"}
                              for p in profiles],
                 "decisions": decisions, "decision_us": round(per_decision_us, 2), "workers": workers,
                 "backends": sorted({f"{w['backend']} on {w['device']}" for w in workers})}
    placed = sum(1 for x in decisions if x["fits"])
    d.cell = (f"yes (declared needs, automatic placement): {len(profiles)} device profiles"
              + ("" if on_gpu else " (GPUs: examples)") + f", {placed}/{len(decisions)} needs placed, each refusal "
              f"with its reason, {per_decision_us:.0f} us a decision; serving: {', '.join(d.figures['backends'])}")
    return d
