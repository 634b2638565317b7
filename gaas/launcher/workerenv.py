"""What each process `gaas up` starts is given (gaas.launcher.mesh.Mesh, whose mixin this is): its
environment without the secrets it must not see, its Redis user, the settings the mesh decides for
it (where it listens, its sidecar's sockets, its database), tracing, and for a worker its device:
the GPU it computes on and its share of that GPU's memory, or the core its engine is pinned to.

It reads the Mesh's topo, run_dir, sockets, deploy_file, redis_url, redis_users, trace, gpus,
extra_env and _profiles."""

from __future__ import annotations

import os

from gaas.host import placement
from gaas.launcher.errors import MeshError
from gaas.launcher.secrets import REDIS_CLIENTS, SECRETS, without_secrets
from gaas.ops import redisacl
from gaas.ops.serviceenv import Placement, placed_values
from gaas.ops.topology import Instance, LocalSockets
from gaas.settings import worker as worker_settings
from gaas.settings.env import ConfigError, default_of, env_of, value_from_env, variables
from gaas.settings.services import SETTINGS as SERVICE_SETTINGS


class WorkerEnvironment:
    def service_env(self, inst: Instance) -> dict[str, str]:
        """What a service process gets: this environment without the secrets (each secret only
        where its service needs it: SECRETS), its own Redis user, and the settings the mesh decides
        for it, written as its settings class (gaas.settings) reads them."""
        env = {**without_secrets(dict(os.environ)), "PYTHONUNBUFFERED": "1"}
        for name, services in SECRETS.items():
            if inst.service in services and name in os.environ:
                env[name] = os.environ[name]
        settings = SERVICE_SETTINGS[inst.service]
        has = {v.field: v.name for v in variables(settings)}
        sockets = LocalSockets.of(self.sockets, inst.name)
        # Where it is in the mesh (gaas.ops.serviceenv, as the Kubernetes manifests place it too):
        # service and sidecar meet on Unix sockets only the mesh's owner can reach.
        values = placed_values(inst, Placement(
            instance=inst.name, host=inst.host, advertise=inst.inbound, listen=f"unix:{sockets.service}",
            outbound=f"unix:{sockets.outbound}", spool_dir=str(self.run_dir / "spool"),
            deploy_file=str(self.deploy_file), files_dir=str(self.run_dir / "files")))
        if inst.service in REDIS_CLIENTS:
            user = self.redis_users.get(inst.service)
            values["redis_url"] = redisacl.url_for(self.redis_url, user) if user else self.redis_url
        if "database_url" in has and has["database_url"] not in os.environ:
            # Its database in the run directory, unless the operator named one (a secret, passed above).
            values["database_url"] = f"sqlite:///{self.run_dir / f'{inst.service}.db'}"
        if self.trace is not None:
            # gaas.runtime.telemetry exports there; the W3C context comes from the sidecars.
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.trace.endpoint
            env["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
            # Follow the caller's decision; never start a trace of their own (background calls).
            env["OTEL_TRACES_SAMPLER"] = "parentbased_always_off"
        if inst.service == "worker":
            if self.gpus:
                slot = self._gpu_slot(inst)
                values.update(device="cuda", gpu_memory_utilization=slot.memory_fraction)
                # By UUID: the same GPU whatever order CUDA numbers them in; and CUDA's order is
                # NVML's for anything else that counts them.
                env.update(CUDA_VISIBLE_DEVICES=slot.uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID")
            else:
                values["device"] = "cpu"
                # One worker per core: its engine computes there (see placement.worker_cpus).
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(placement.worker_cpus(inst.index, len(self.topo.of("worker")))[0])
        env.update(env_of(settings, **values))
        env.update(self.extra_env)
        if inst.service == "worker" and not self.gpus:
            # What its engine needs from the start, given at the worker's: the engine's server is
            # then forked from the worker (services/worker/enginefork.py), vLLM imported once.
            try:
                s = worker_settings.WorkerSettings.from_env(env)
            except ConfigError:
                pass  # (the worker says what is wrong as it starts)
            else:
                env.update(placement.cpu_engine_environment(s.executor, s.kv_cache_gib, env))
        return env

    def zygote_env(self) -> dict[str, str]:
        """What the worker zygote starts with (gaas.launcher.zygote): what a CPU worker's environment
        holds (built as service_env builds it) but what is each worker's own (its settings, its cores,
        its cache's size), and the workers' Redis URL, which all share (a worker forked from it shows
        the zygote's environment in /proc)."""
        env = {**without_secrets(dict(os.environ)), "PYTHONUNBUFFERED": "1", **self.extra_env}
        user = self.redis_users.get("worker")
        env["GAAS_REDIS_URL"] = redisacl.url_for(self.redis_url, user) if user else self.redis_url
        # (A worker of another executor, or more cores, differs in its OpenMP threads: not forked.)
        engine = placement.cpu_engine_environment(default_of(worker_settings.WorkerSettings, "executor"),
                                                  default_of(worker_settings.WorkerSettings, "kv_cache_gib"),
                                                  {**env, "VLLM_CPU_OMP_THREADS_BIND": "0"})
        return {**env, **engine}

    def _gpu_slot(self, inst: Instance) -> placement.GpuSlot:
        """The GPU a worker computes on, and its share of the GPU's memory: the workers share the
        GPUs their pools fit in turn (gaas.host.placement.worker_gpus: each on the fitting GPU
        with the fewest workers), those on one GPU splitting its memory budget as the workers
        there now are counted (a worker started later on a GPU other workers hold takes a smaller
        share; give the GPU room, or fewer workers, for a roll-out)."""
        workers = self.topo.of("worker")
        budget = value_from_env(worker_settings.WorkerSettings, "gpu_memory_utilization")
        kv_bytes = max(int(w.options["kv_cache_gib"]) for w in workers) * 2**30
        count = max(len(workers), inst.index + 1)
        by_index = {w.index: w for w in workers}
        fits = [self._fitting_gpus(by_index[i]) if i in by_index else None for i in range(count)]
        try:
            slots = placement.worker_gpus(self.gpus, count, budget=budget, kv_cache_bytes=kv_bytes, fits=fits)
        except placement.PlacementError as exc:
            raise MeshError(str(exc)) from None
        return slots[inst.index]

    def _fitting_gpus(self, inst: Instance) -> set[str] | None:
        """The UUIDs of the GPUs a worker's pool fits (its device requirement; None: any GPU)."""
        from gaas.contracts.device import DeviceRequirement, choose
        from gaas.host.profiles import host_profiles

        o = inst.options
        try:
            need = DeviceRequirement.parse(dict(o.get("device_needs") or {}) or o.get("device", "any"))
        except ValueError:
            return None  # (a pool's requirement was checked when applied)
        if need.simple:
            return None
        if self._profiles is None:
            self._profiles = host_profiles(self.gpus)
        return {d.uuid for d in choose(need, self._profiles).fits if d.uuid}
