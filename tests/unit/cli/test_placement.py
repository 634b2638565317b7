"""`gaas placement` explains each pool's fit on a host's devices (fake profiles): the devices that
fit, why each other does not, and whether any does."""

from __future__ import annotations

from gaas.cli.placement import explain
from gaas.contracts.device import DeviceProfile

GIB = 2**30
H200 = DeviceProfile("gpu", "NVIDIA H200", 141 * GIB, uuid="GPU-h200", compute_capability="9.0")
L4 = DeviceProfile("gpu", "NVIDIA L4", 23 * GIB, uuid="GPU-l4", compute_capability="8.9")


def test_each_pool_says_which_devices_fit_and_why_the_others_do_not():
    rows = explain([
        {"model": "big", "version": "1", "role": "stable", "device": "gpu",
         "device_needs": {"kind": "gpu", "gpu_memory_gib": 80}},
        {"model": "small", "version": "2", "role": "canary", "device": "any", "device_needs": {}},
        {"model": "cpu-only", "version": "1", "device": "cpu"},
    ], [H200, L4])
    big, small, cpu = rows
    assert big["fits"] == [H200.label] and big["refused"] == {L4.label: "has 23 GiB, the pool needs 80 GiB"}
    assert big["needs"] == "a GPU, >= 80 GiB" and big["placeable"]
    assert small["fits"] == [H200.label, L4.label] and small["refused"] == {}
    assert not cpu["placeable"] and set(cpu["refused"].values()) == {"is a GPU, the pool needs a CPU host"}
