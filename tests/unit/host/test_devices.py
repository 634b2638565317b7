"""GPU hosts, decided without a GPU: device discovery through a fake NVML (errors, MIG, the
CUDA_VISIBLE_DEVICES a user or scheduler set), the placement of workers on GPUs, the launcher's
environment for GPU workers, the worker's checks, and the install script's decisions."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gaas.ops import topology
from gaas.host import devices, placement
from gaas.host.devices import GpuInfo, visible_gpus
from gaas.settings.worker import WorkerSettings
from tests.waiting import eventually_async

ROOT = Path(__file__).resolve().parents[3]
GiB = 2**30


# ------------------------------------------------------------------ a fake NVML


class NVMLError(Exception):
    pass


def fake_nvml(gpus: list[dict], *, init_fails: bool = False) -> types.ModuleType:
    """A pynvml stand-in over a list of devices: {uuid, name, total, used, pci, fail, mig: [..],
    procs: [(pid, bytes)], util: %, proc_util: [(pid, %)]}."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = NVMLError
    nv.NVML_DEVICE_MIG_ENABLE = 1
    nv.NVML_FEATURE_ENABLED = 1
    by_uuid = {}
    for g in gpus:
        by_uuid[g["uuid"]] = g
        for m in g.get("mig", []):
            if m is not None:
                by_uuid[m["uuid"]] = m
    nv.calls = {"init": 0, "shutdown": 0}

    def init():
        nv.calls["init"] += 1
        if init_fails:
            raise NVMLError("Driver Not Loaded")

    def handle(i):
        g = gpus[i]
        if g.get("fail"):
            raise NVMLError("Unknown Error")
        return g

    def mig_handle(h, j):
        migs = h.get("mig", [])
        if j >= len(migs) or migs[j] is None:
            raise NVMLError("Not Found")
        return migs[j]

    def unsupported(*_):
        raise NVMLError("Not Supported")

    nv.nvmlInit = init
    nv.nvmlShutdown = lambda: nv.calls.__setitem__("shutdown", nv.calls["shutdown"] + 1)
    nv.nvmlDeviceGetCount = lambda: len(gpus)
    nv.nvmlDeviceGetHandleByIndex = handle
    nv.nvmlDeviceGetHandleByUUID = lambda u: by_uuid[u]
    nv.nvmlDeviceGetName = lambda h: h["name"].encode()
    nv.nvmlDeviceGetUUID = lambda h: h["uuid"]
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=h["total"], used=h.get("used", 0))
    nv.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=h.get("pci", "00000000:00:00.0"))
    nv.nvmlDeviceGetMigMode = lambda h: (1, 1) if "mig" in h else (0, 0)
    nv.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7
    nv.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    nv.nvmlDeviceGetNvLinkState = unsupported
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in h.get("procs", [])]
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=h.get("util", 0))

    def proc_util(h, since):
        if "proc_util" not in h:
            raise NVMLError("Not Found")
        return [types.SimpleNamespace(pid=p, smUtil=u, timeStamp=since + 1) for p, u in h["proc_util"]]

    nv.nvmlDeviceGetProcessUtilization = proc_util
    return nv


def gpu(n: int, **extra) -> dict:
    return {"uuid": f"GPU-{n:04x}aaaa-0000", "name": "NVIDIA H200", "total": 141 * GiB, "pci": f"00000000:{n:02x}:00.0",
            **extra}


@pytest.fixture
def nvml(monkeypatch):
    def install(gpus: list[dict], **kw) -> types.ModuleType:
        nv = fake_nvml(gpus, **kw)
        monkeypatch.setitem(sys.modules, "pynvml", nv)
        return nv

    return install


# ------------------------------------------------------------------ discovery


def test_one_unreadable_gpu_is_skipped_not_every_gpu(nvml):
    nvml([gpu(0), gpu(1, fail=True), gpu(2)])
    assert [g.index for g in devices.list_gpus()] == [0, 2]


def test_no_driver_means_no_gpus_and_nvml_is_shut_down_after_counting(nvml):
    nv = nvml([], init_fails=True)
    assert devices.list_gpus() == []
    nv = nvml([gpu(0)])
    devices.list_gpus()
    assert nv.calls == {"init": 1, "shutdown": 1}


def test_a_gpu_in_mig_mode_is_listed_as_its_instances(nvml):
    migs = [{"uuid": "MIG-11111111-aaaa", "name": "NVIDIA H200 MIG 3g.71gb", "total": 70 * GiB}, None,
            {"uuid": "MIG-22222222-bbbb", "name": "NVIDIA H200 MIG 3g.71gb", "total": 70 * GiB}]
    nvml([gpu(0), gpu(1, mig=migs)])
    found = devices.list_gpus()
    assert [(g.index, g.uuid, g.mig) for g in found] == [
        (0, "GPU-0000aaaa-0000", None), (1, "MIG-11111111-aaaa", 0), (1, "MIG-22222222-bbbb", 2)]


GPUS = [GpuInfo(i, f"GPU-{i}{i}{i}-uuid", "NVIDIA H200", 141 * GiB) for i in range(4)] + [
    GpuInfo(4, "MIG-abc-1", "NVIDIA H200 MIG 1g.18gb", 18 * GiB, mig=0)]


@pytest.mark.parametrize("spec, expect", [
    (None, [0, 1, 2, 3, 4]),
    ("2,0", [2, 0]),  # CUDA's order is the variable's
    ("GPU-333-uuid", [3]),
    ("GPU-11", [1]),  # a unique prefix, as CUDA accepts
    ("GPU-", []),  # not unique: no device, and enumeration stops
    ("MIG-abc-1,0", [4, 0]),
    ("", []),
    ("-1", []),
    ("1,7,2", [1]),  # stops at the first entry that names no device, as CUDA does
    ("1, 3", [1, 3]),
    ("4", []),  # an index never names a MIG instance
    ("0,0", [0]),
])
def test_cuda_visible_devices_is_honoured_as_cuda_reads_it(spec, expect):
    env = {} if spec is None else {"CUDA_VISIBLE_DEVICES": spec}
    got = visible_gpus(GPUS, env)
    assert [GPUS.index(g) for g in got] == expect


def test_host_kind_is_the_one_notion_of_a_gpu_host(nvml, monkeypatch):
    nvml([gpu(0), gpu(1)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.host_kind() == "cuda"
    assert devices.host_kind({"CUDA_VISIBLE_DEVICES": ""}) == "cpu"
    nvml([gpu(0, fail=True)])
    assert devices.host_kind() == "cpu"


def test_gpu_monitor_reports_the_workers_own_memory_and_time(nvml):
    dev = gpu(0, used=90 * GiB, procs=[(10, 3 * GiB), (11, 4 * GiB), (99, 80 * GiB)], util=97,
              proc_util=[(11, 40), (99, 57)])
    nvml([dev])
    mon = devices.GpuMonitor(dev["uuid"], pids=lambda: {10, 11})
    d = mon.describe()
    assert (d.kind, d.uuid, d.name, d.memory_total) == ("cuda", dev["uuid"], "NVIDIA H200", 141 * GiB)
    s = mon.sample()
    assert (s.memory_used, s.memory_total, s.utilization) == (7 * GiB, 141 * GiB, 0.40)


def test_gpu_monitor_falls_back_to_the_device_when_nvml_cannot_attribute(nvml):
    # In a container NVML may list no process of ours (other pid namespace) and no per-process time.
    dev = gpu(0, used=12 * GiB, procs=[(12345, 11 * GiB)], util=63)
    nvml([dev])
    s = devices.GpuMonitor(dev["uuid"], pids=lambda: {10}).sample()
    assert (s.memory_used, s.utilization) == (12 * GiB, 0.63)


def test_the_device_script_needs_no_dependencies_and_reads_nvidia_smi(tmp_path):
    """scripts/install.sh asks `python3 gaas/host/devices.py kind` before the venv exists."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '0, GPU-aaaa, NVIDIA H200, 143771, 0, 00000000:19:00.0'\n"
                    "echo '1, GPU-bbbb, NVIDIA H200, 143771, 0, 00000000:3B:00.0'\n")
    fake.chmod(0o755)
    script = ROOT / "gaas" / "host" / "devices.py"
    # -S: no site-packages, so no pynvml: the nvidia-smi path.
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    run = lambda *a, **e: subprocess.run([sys.executable, "-S", str(script), *a], env={**env, **e},  # noqa: E731
                                         capture_output=True, text=True, timeout=30)
    assert run("kind").stdout.strip() == "cuda"
    assert run("kind", CUDA_VISIBLE_DEVICES="GPU-bbbb").stdout.strip() == "cuda"
    assert run("kind", CUDA_VISIBLE_DEVICES="").stdout.strip() == "cpu"
    listed = run("list", CUDA_VISIBLE_DEVICES="1").stdout.split("\t")
    assert listed[:2] == ["1", "GPU-bbbb"]
    assert subprocess.run([sys.executable, "-S", str(script), "kind"], env={"PATH": "/nonexistent"},
                          capture_output=True, text=True, timeout=30).stdout.strip() == "cpu"


def test_install_refuses_a_driver_too_old_for_the_cuda_build(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *driver_version*) echo 550.54.15;; "
                    "*) echo '0, GPU-aaaa, NVIDIA H100, 81559, 0, 00000000:19:00.0';; esac\n")
    fake.chmod(0o755)
    python = tmp_path / "python"  # without site-packages (no pynvml): the host as nvidia-smi shows it
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    out = subprocess.run(["bash", "scripts/install.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "VENV": str(tmp_path / "venv"),
                              "PYTHON": str(python)})
    assert out.returncode == 1
    assert "driver 550.54.15 is too old" in out.stderr and "580" in out.stderr
    assert not (tmp_path / "venv").exists()


# ------------------------------------------------------------------ placement


def test_one_worker_per_gpu_each_with_the_whole_budget():
    slots = placement.worker_gpus(GPUS[:4], 4)
    assert [s.uuid for s in slots] == [g.uuid for g in GPUS[:4]]
    assert {s.memory_fraction for s in slots} == {placement.GPU_MEMORY_BUDGET}


def test_workers_sharing_a_gpu_split_its_memory():
    slots = placement.worker_gpus(GPUS[:2], 3, budget=0.9)
    assert [(s.uuid, s.shared_by, s.memory_fraction) for s in slots] == [
        (GPUS[0].uuid, 2, 0.45), (GPUS[1].uuid, 1, 0.9), (GPUS[0].uuid, 2, 0.45)]


def test_workers_that_cannot_fit_are_refused_with_what_to_change():
    small = [GpuInfo(0, "MIG-x", "NVIDIA H200 MIG 1g.18gb", 18 * GiB, mig=0)]
    with pytest.raises(placement.PlacementError, match=r"3 workers share .*--workers"):
        placement.worker_gpus(small, 3, kv_cache_bytes=8 * GiB)


def test_a_pool_that_fits_only_some_gpus_gets_only_those_and_the_others_share_the_rest():
    """Four GPUs, a pool needing the first two (its device requirement) with three workers, and
    another pool fitting any GPU with two: the first pool's workers take GPUs 0 and 1 in turn, the
    other's the GPUs with the fewest workers."""
    gpus = GPUS[:4]
    first_two = {gpus[0].uuid, gpus[1].uuid}
    slots = placement.worker_gpus(gpus, 5, fits=[first_two, first_two, first_two, None, None])
    assert [s.uuid for s in slots[:3]] == [gpus[0].uuid, gpus[1].uuid, gpus[0].uuid]
    assert [s.uuid for s in slots[3:]] == [gpus[2].uuid, gpus[3].uuid]
    assert slots[0].shared_by == 2 and slots[3].shared_by == 1
    with pytest.raises(placement.PlacementError, match="fits none"):
        placement.worker_gpus(gpus, 1, fits=[{"GPU-nothing"}])


@given(st.integers(1, 8), st.integers(1, 24), st.floats(0.05, 1.0))
def test_placement_balances_and_never_overcommits(n_gpus, workers, budget):
    gpus = [GpuInfo(i, f"GPU-{i}", "g", 80 * GiB) for i in range(n_gpus)]
    slots = placement.worker_gpus(gpus, workers, budget=budget)
    per_gpu = {g.uuid: [s for s in slots if s.uuid == g.uuid] for g in gpus}
    counts = [len(v) for v in per_gpu.values()]
    assert len(slots) == workers and max(counts) - min(counts) <= 1
    for v in per_gpu.values():
        assert sum(s.memory_fraction for s in v) <= budget + 1e-9
        assert all(s.shared_by == len(v) for s in v)


# ------------------------------------------------------------------ the launcher and the topology


def test_worker_replicas_default_to_one_per_gpu():
    t = topology.load(ROOT / "deploy" / "topology.yaml", env={}, auto_workers=8)
    assert len(t.of("worker")) == 8
    assert len(topology.load(ROOT / "deploy" / "topology.yaml", env={}).of("worker")) == 1
    assert len(topology.load(ROOT / "deploy" / "topology.yaml", env={"GAAS_WORKERS": "3"}, auto_workers=8).of("worker")) == 3
    assert len(topology.load(ROOT / "deploy" / "topology.yaml", env={"GAAS_WORKERS": "auto"}, auto_workers=2).of("worker")) == 2
    with pytest.raises(topology.TopologyError, match="a number or auto"):
        topology.load(ROOT / "deploy" / "topology.yaml", env={"GAAS_WORKERS": "many"})


def _mesh(tmp_path, monkeypatch, gpus, workers, **worker_options):
    """A mesh of `workers` workers of the deployment's default model (as its pool's replicas:
    auto start them), not started."""
    from gaas.launcher import mesh as mesh_mod
    from gaas.launcher.fleet import PoolSpec

    monkeypatch.setattr(mesh_mod, "visible_gpus", lambda: list(gpus))
    t = topology.load(ROOT / "deploy" / "topology.yaml", env={}, port_base=47000, workers=workers)
    if worker_options:
        t = topology.with_worker_options(t, **worker_options)
    m = mesh_mod.Mesh(t, run_dir=tmp_path, deploy_file=ROOT / "deploy" / "gaas.yaml", redis_url="redis://127.0.0.1:1/0")
    pool = PoolSpec.from_model(m.spec.default_model)
    m.topo = topology.with_workers(m.topo, [m.topo.worker(i, pool.options()) for i in range(m.topo.auto_workers)])
    return m


def test_gpu_workers_get_their_gpu_by_uuid_and_settings_for_it(tmp_path, monkeypatch):
    monkeypatch.delenv("GAAS_GPU_MEMORY_UTILIZATION", raising=False)
    m = _mesh(tmp_path, monkeypatch, GPUS[:4], 4)
    envs = [m.service_env(w) for w in m.topo.of("worker")]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [g.uuid for g in GPUS[:4]]
    for e in envs:
        assert e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and e["GAAS_DEVICE"] == "cuda"
        assert e["GAAS_GPU_MEMORY_UTILIZATION"] == str(placement.GPU_MEMORY_BUDGET)
        assert e["GAAS_ENFORCE_EAGER"] == "auto" and "VLLM_CPU_OMP_THREADS_BIND" not in e


def test_workers_of_a_pool_that_needs_some_gpus_go_only_to_those(tmp_path, monkeypatch):
    """A host of two H200s and two L4s; the pool needs an H200 (device: {kind: gpu, gpu_models:
    [H200]}): its three workers share the two H200s, none on an L4."""
    from dataclasses import replace

    from gaas.launcher.fleet import PoolSpec

    monkeypatch.delenv("GAAS_GPU_MEMORY_UTILIZATION", raising=False)
    gpus = GPUS[:2] + [GpuInfo(2 + i, f"GPU-L4-{i}", "NVIDIA L4", 24 * GiB) for i in range(2)]
    m = _mesh(tmp_path, monkeypatch, gpus, 3)
    pool = replace(PoolSpec.from_model(m.spec.default_model), device="gpu",
                   device_needs={"kind": "gpu", "gpu_models": ["H200"]})
    m.topo = topology.with_workers(m.topo, [m.topo.worker(i, pool.options()) for i in range(3)])
    on = [m.service_env(w)["CUDA_VISIBLE_DEVICES"] for w in m.topo.of("worker")]
    assert on == [GPUS[0].uuid, GPUS[1].uuid, GPUS[0].uuid]


def test_more_workers_than_gpus_share_with_split_memory_or_are_refused(tmp_path, monkeypatch):
    from gaas.launcher.errors import MeshError

    monkeypatch.setenv("GAAS_GPU_MEMORY_UTILIZATION", "0.8")
    m = _mesh(tmp_path, monkeypatch, GPUS[:1], 2)
    assert [m.service_env(w)["GAAS_GPU_MEMORY_UTILIZATION"] for w in m.topo.of("worker")] == ["0.4", "0.4"]
    crowded = _mesh(tmp_path, monkeypatch, GPUS[4:], 2, kv_cache_gib=8)
    with pytest.raises(MeshError, match="smaller kv_cache_gib"):
        crowded.service_env(crowded.topo.of("worker")[0])


def test_cpu_workers_stay_pinned_and_say_so(tmp_path, monkeypatch):
    m = _mesh(tmp_path, monkeypatch, [], 1)
    e = m.service_env(m.topo.of("worker")[0])
    assert e["GAAS_DEVICE"] == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" in e and "CUDA_VISIBLE_DEVICES" not in e
    assert e["GAAS_EXECUTOR"] == "uni"  # the topology's executor reaches the worker
    # What its engine needs from its start, the worker has from its own (its engine's server is
    # forked from it): exactly what the worker would set for its engine.
    s = WorkerSettings.from_env(e)
    assert e["OMP_NUM_THREADS"] == "1" and e["VLLM_CPU_KVCACHE_SPACE"] == str(s.kv_cache_gib)
    assert placement.cpu_engine_environment(s.executor, s.kv_cache_gib, e).items() <= e.items()


@pytest.mark.parametrize("executor, on_gpu, bind, backend, env", [
    # On the CPU in process: named by class (vLLM turns "uni" into "mp"), one OpenMP thread per core.
    ("uni", False, "0", placement.IN_PROCESS_EXECUTOR, {"OMP_NUM_THREADS": "1"}),
    ("uni", False, "2-5", placement.IN_PROCESS_EXECUTOR, {"OMP_NUM_THREADS": "4"}),
    # Cores vLLM picks itself: it cannot size the engine core's threads, so a process of its own.
    ("uni", False, "auto", "mp", {}),
    # A GPU runs one device's model in process already: vLLM's own choice.
    ("uni", True, "", None, {}),
    ("mp", False, "0", "mp", {}),
    ("mp", True, "", "mp", {}),
])
def test_where_the_model_runs_by_executor_and_device(executor, on_gpu, bind, backend, env):
    assert placement.engine_executor(executor, on_gpu, bind) == (backend, env)


def test_an_unknown_executor_is_refused():
    with pytest.raises(placement.PlacementError, match="uni, mp"):
        placement.engine_executor("ray", False, "0")


# ------------------------------------------------------------------ the worker


def test_worker_settings_by_device():
    from gaas.settings.env import ConfigError
    from gaas.settings.worker import WorkerSettings

    base = {"GAAS_MODEL": "m", "GAAS_MODEL_PATH": "/m"}
    assert WorkerSettings.from_env(base).enforce_eager is None  # auto: decided by the device
    assert WorkerSettings.from_env({**base, "GAAS_ENFORCE_EAGER": "false"}).enforce_eager is False
    with pytest.raises(ConfigError, match="GAAS_DEVICE"):
        WorkerSettings.from_env({**base, "GAAS_DEVICE": "tpu"})
    with pytest.raises(ConfigError, match="GAAS_GPU_MEMORY_UTILIZATION"):
        WorkerSettings.from_env({**base, "GAAS_GPU_MEMORY_UTILIZATION": "1.5"})
    assert WorkerSettings.from_env(base).executor == "uni"
    with pytest.raises(ConfigError, match="GAAS_EXECUTOR must be one of uni, mp"):
        WorkerSettings.from_env({**base, "GAAS_EXECUTOR": "ray"})


def test_a_worker_refuses_a_vllm_build_for_the_other_device():
    from services.worker.vllmfaults import check_build

    check_build("cuda", "cuda")
    check_build("cpu", "")
    with pytest.raises(RuntimeError, match="CPU build.*make install"):
        check_build("cpu", "cuda")
    with pytest.raises(RuntimeError, match="given no GPU"):
        check_build("cuda", "cpu")


async def test_load_reports_read_the_device_sample_without_touching_the_device():
    """GetLoad runs on the event loop: it reads the sampler's last sample, never NVML itself."""
    from services.worker.server import sample_device
    from services.worker.servicer import WorkerServicer
    import asyncio

    calls = []

    class Monitor:
        def describe(self):
            return devices.DeviceDescription("cuda", "NVIDIA H200", 141 * GiB, uuid="GPU-1")

        def sample(self):
            import threading

            calls.append(threading.current_thread() is threading.main_thread())
            return devices.DeviceSample(3 * GiB, 141 * GiB, 0.5)

    class Engine:
        info = types.SimpleNamespace(kv_cache_blocks=10, adapter_slots=0)

        def load(self):
            return types.SimpleNamespace(running=1, waiting=0, kv_cache_usage=0.1, adapters=(), preemptions=0)

    s = WorkerServicer("worker-0", engine=Engine(), monitor=Monitor())
    assert s.load_report().device_memory_used == 0  # no sample yet: nothing read on the loop
    task = asyncio.create_task(sample_device(s))
    await eventually_async(lambda: s.device_sample, 5, every=0.01, what="the device sampled off the loop")
    task.cancel()
    report = s.load_report()
    assert (report.device_memory_used, report.device_utilization, report.device.uuid) == (3 * GiB, 0.5, "GPU-1")
    assert calls and not any(calls)  # sampled in a worker thread


def test_the_engine_reads_its_load_from_older_vllms_too():
    """vLLM 0.26 (the last built for torch 2.11, what the GPU check ran on) has no
    AsyncLLM.get_num_unfinished_requests: the load report must not depend on it."""
    from services.worker.vllm_engine import VllmEngine, _LoadTracker

    old = types.SimpleNamespace(output_processor=types.SimpleNamespace(get_num_unfinished_requests=lambda: 3))
    new = types.SimpleNamespace(get_num_unfinished_requests=lambda: 5)
    for llm, count in ((old, 3), (new, 5)):
        load = VllmEngine(llm, None, _LoadTracker(), None, None).load()
        assert load.running + load.waiting == count


def test_the_engines_preemptions_are_counted_into_its_load_report():
    """Each engine step's preempted requests (vLLM's KV-cache allocation failures) add up in the
    load report, the scorecard's fragmentation figure reads them there."""
    from services.worker.vllm_engine import VllmEngine, _LoadTracker

    tracker = _LoadTracker()
    logger = tracker.factory(None)
    for preempted in (0, 2, 1):
        logger.record(types.SimpleNamespace(num_waiting_reqs=0, kv_cache_usage=0.9),
                      types.SimpleNamespace(num_preempted_reqs=preempted))
    logger.record(None, None)
    llm = types.SimpleNamespace(get_num_unfinished_requests=lambda: 0)
    assert VllmEngine(llm, None, tracker, None, None).load().preemptions == 3
