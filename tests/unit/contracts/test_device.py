"""Placement by device with fake profiles: a requirement read from the file's `device:` (a kind, or
a mapping; anything else refused naming the field and what it takes), and which devices of a host
fit it, with the reason for each that does not."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from gaas.contracts.device import DeviceError, DeviceProfile, DeviceRequirement, choose, misfit

GIB = 2**30
H200 = DeviceProfile("gpu", "NVIDIA H200", 141 * GIB, uuid="GPU-h200", compute_capability="9.0",
                     nvlink_peers=("00000000:19:00.0",))
A100_40 = DeviceProfile("gpu", "NVIDIA A100-SXM4-40GB", 40 * GIB, uuid="GPU-a100", compute_capability="8.0")
L4 = DeviceProfile("gpu", "NVIDIA L4", 23 * GIB, uuid="GPU-l4", compute_capability="8.9")
MIG = DeviceProfile("gpu", "NVIDIA H200 MIG 1g.18gb", 18 * GIB, uuid="MIG-1", compute_capability="9.0")
CPU = DeviceProfile("cpu", "AMD EPYC", 24 * GIB, cpu_cores=2)
GPU_HOST = [H200, A100_40, L4, MIG]


@pytest.mark.parametrize("device, fits", [
    ("any", ["GPU-h200", "GPU-a100", "GPU-l4", "MIG-1"]),
    ({"kind": "gpu", "gpu_memory_gib": 40}, ["GPU-h200", "GPU-a100"]),
    ({"gpu_models": ["H100", "H200"]}, ["GPU-h200", "MIG-1"]),
    ({"gpu_models": ["H200"], "gpu_memory_gib": 80}, ["GPU-h200"]),
    ({"compute_capability": "8.9"}, ["GPU-h200", "GPU-l4", "MIG-1"]),
    ({"interconnect": "nvlink"}, ["GPU-h200"]),
    ("cpu", []),
])
def test_a_requirement_fits_the_gpus_that_offer_it(device, fits):
    c = choose(DeviceRequirement.parse(device), GPU_HOST)
    assert [d.uuid for d in c.fits] == fits
    assert c.placeable == bool(fits)
    assert len(c.refused) == len(GPU_HOST) - len(fits)


def test_each_refused_device_says_why():
    need = DeviceRequirement.parse({"kind": "gpu", "gpu_models": ["H200"], "gpu_memory_gib": 80,
                                    "compute_capability": "9.0"})
    assert misfit(need, A100_40) == "is a NVIDIA A100-SXM4-40GB, not one of H200"
    assert misfit(need, MIG) == "has 18 GiB, the pool needs 80 GiB"
    assert misfit(DeviceRequirement.parse({"compute_capability": "9.0"}), L4) == \
        "has compute capability 8.9, below 9.0"
    assert misfit(need, CPU) == "is a CPU, the pool needs a GPU"
    c = choose(need, [CPU])
    assert c.reason() == ("needs a GPU, H200, >= 80 GiB, compute capability >= 9.0; no device of this host fits: "
                          "CPU AMD EPYC (2 cores, 24 GiB) is a CPU, the pool needs a GPU")


def test_a_cpu_host_by_cores_and_memory():
    assert choose(DeviceRequirement.parse({"cpu_cores": 2, "memory_gib": 16}), [CPU]).placeable
    assert misfit(DeviceRequirement.parse({"cpu_cores": 8}), CPU) == "has 2 cores, the pool needs 8"
    assert misfit(DeviceRequirement.parse({"kind": "cpu", "memory_gib": 64}), CPU) == \
        "has 24 GiB of memory, the pool needs 64 GiB"
    assert choose(DeviceRequirement.parse("cpu"), [CPU]).placeable and not choose(DeviceRequirement.parse("gpu"), [CPU]).placeable


@pytest.mark.parametrize("device, field, said", [
    ("tpu", "", "device must be one of any, cpu, gpu"),
    ({"kind": "fpga"}, "kind", "device.kind must be one of any, cpu, gpu"),
    ({"gpus": 2}, "gpus", "unknown device requirement 'gpus'; device has kind:"),
    ({"gpu_memory_gib": -1}, "gpu_memory_gib", "must be a number of GiB above 0"),
    ({"compute_capability": "nine"}, "compute_capability", "MAJOR.MINOR"),
    ({"interconnect": "pcie"}, "interconnect", "must be one of any, nvlink"),
    ({"kind": "cpu", "gpu_models": ["H200"]}, "gpu_models", "is a GPU's; a pool of kind cpu cannot need it"),
    ({"kind": "gpu", "cpu_cores": 4}, "cpu_cores", "is a CPU host's"),
    ({"gpu_models": []}, "gpu_models", "a list of GPU names"),
])
def test_an_unknown_or_malformed_requirement_names_its_field_and_what_it_takes(device, field, said):
    with pytest.raises(DeviceError) as err:
        DeviceRequirement.parse(device)
    assert err.value.field == field and said in str(err.value)


@given(st.fixed_dictionaries({}, optional={
    "gpu_memory_gib": st.integers(1, 200), "gpu_models": st.lists(st.sampled_from(["H100", "H200", "A100", "L4"]),
                                                                  min_size=1, max_size=3),
    "compute_capability": st.sampled_from(["7.0", "8.0", "8.9", "9.0"]), "interconnect": st.sampled_from(["any", "nvlink"]),
}))
def test_a_requirement_reads_back_as_itself_and_what_fits_fits_each_part(doc):
    need = DeviceRequirement.parse(doc)
    assert DeviceRequirement.parse(need.as_dict()) == need
    for d in choose(need, GPU_HOST).fits:
        assert not need.gpu_memory_gib or d.memory_total >= need.gpu_memory_gib * GIB
        assert not need.gpu_models or any(m in d.name for m in need.gpu_models)
