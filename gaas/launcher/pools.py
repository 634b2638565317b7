"""The deployment's workers on one machine, the part of `gaas up` (gaas.launcher.mesh.Mesh, whose
mixin this is) that follows control's pools: which pools to run (control's ListPools), whether
this host can run a pool (its device needs, its weights: a preset's built when missing), then
starting and draining workers to match (fleet.reconcile decides; this does it), each worker with
its sidecar, certificate and sockets; a pool that cannot run here is reported to control.

It reads and changes the Mesh's state: topo, children, run_dir, gpus, _authority, _retiring,
_refused, _builds, _build_errors, _profiles, _control, _zygote, and spawns through its _spawn_service
and _spawn_envoy; and it starts the worker zygote CPU workers are forked from."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from gaas.envoy import config as envoyconf
from gaas.launcher import fleet
from gaas.launcher.children import become_subreaper, signal_group
from gaas.launcher.errors import MeshError
from gaas.launcher.rundir import port_in_use
from gaas.launcher.zygote import Zygote
from gaas.model.build import build_model, check_source, is_built, refresh_chat_template
from gaas.ops import pki
from gaas.ops.topology import LocalSockets, TopologyError, with_workers


class PoolWorkers:
    def _control_stub(self):
        from gaas.v1 import control_pb2_grpc

        if self._control is None:
            channel = pki.operator_channel(self.topo.of("control")[0].inbound, self.run_dir)
            self._control = (channel, control_pb2_grpc.ControlStub(channel))
        return self._control[1]

    def _close_control(self) -> None:
        """Close the channel to control. A child forked while a gRPC channel is open can abort
        before it execs (gRPC's fork handlers): every start of a child closes it first."""
        if self._control is not None:
            self._control[0].close()
            self._control = None

    def _fetch_pools(self, timeout: float) -> list[fleet.PoolSpec]:
        """The pools control says the mesh runs (MeshError when it does not answer)."""
        import grpc

        from gaas.v1 import control_pb2

        try:
            resp = self._control_stub().ListPools(control_pb2.ListPoolsRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise MeshError(f"control did not say which workers to run: {exc.code().name}") from None
        return [fleet.PoolSpec.from_pb(p) for p in resp.pools]

    def _report_failure(self, pool: fleet.PoolSpec, reason: str) -> None:
        """Tell control why a pool's workers cannot run here (a roll-out of it halts)."""
        from gaas.v1 import control_pb2

        self.progress(f"{pool.model} {pool.version}: {reason}")
        try:
            self._control_stub().ReportPoolFailure(control_pb2.ReportPoolFailureRequest(
                model=pool.model, version=pool.version, reason=reason), timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - said above; control hears of it at its next report
            self.progress(f"could not tell control: {exc}")

    def _placeable(self, pool: fleet.PoolSpec) -> bool:
        """Whether this host can run the pool's workers (said to control once when not)."""
        wrong = (self._placement(pool).reason() or self._build_errors.get(pool.source)
                 or check_source(pool.model, pool.version, pool.source, pool.preset))
        if wrong and pool.key not in self._refused:
            self._refused.add(pool.key)
            self._report_failure(pool, wrong)
        return not wrong

    def _placement(self, pool: fleet.PoolSpec):
        """Which of this host's devices the pool's workers may run on (gaas.contracts.device)."""
        from gaas.contracts.device import choose
        from gaas.host.profiles import host_profiles

        if self._profiles is None:
            self._profiles = host_profiles(self.gpus)
        return choose(pool.requirement, self._profiles)

    def _model_ready(self, pool: fleet.PoolSpec, wait: bool) -> bool:
        """Whether the pool's weights are there: a preset's are built when missing (wait: here and
        now; else in the background, the pool's workers started at a later look)."""
        if not pool.preset or not pool.source.startswith("/"):
            return True
        if is_built(Path(pool.source)):
            if refresh_chat_template(Path(pool.source)):
                self.progress(f"model {pool.model} {pool.version}: its chat template now renders tools")
            return True
        building = self._builds.get(pool.source)
        if building is not None and building.is_alive():
            return False

        def build() -> None:
            self.progress(f"building model {pool.model} {pool.version} ({pool.preset} preset, seed {pool.seed}) "
                          f"into {pool.source}")
            try:
                build_model(pool.preset, Path(pool.source), seed=pool.seed, progress=lambda m: self.progress(f"  {m}"))
            except Exception as exc:  # noqa: BLE001 - said to control: its roll-out halts with it
                self._build_errors[pool.source] = f"building {pool.source} failed: {type(exc).__name__}: {exc}"

        if wait:
            build()
            return pool.source not in self._build_errors
        self._builds[pool.source] = threading.Thread(target=build, name=f"build {pool.model}", daemon=True)
        self._builds[pool.source].start()
        return False

    def _reconcile(self, pools: list[fleet.PoolSpec], initial: bool = False,
                   report: Callable[[str], None] | None = None) -> bool:
        """Start and stop workers so they match pools; True when the mesh changed."""
        report = report or self.progress
        running = [fleet.Running(w.index, fleet.key_of(w.options), w.name in self._retiring)
                   for w in self.topo.of("worker")]
        actions = fleet.reconcile(pools, running, self.topo.auto_workers, self._placeable)
        for index in actions.stop:
            self._retire(f"worker-{index}", report)
        for index, pool in actions.start:
            if not self._model_ready(pool, wait=initial) or not self._placeable(pool):
                continue
            self._spawn_worker(index, pool, report, quiet=initial)
        return bool(actions)

    def _start_zygote(self, python: str, module: str) -> None:
        """Start the process CPU workers are forked from (gaas.launcher.zygote): it imports vLLM once,
        meanwhile; its first worker waits for that. gaas up adopts the workers it forks (a subreaper)."""
        if not become_subreaper():
            return  # (the workers it forks would be init's, not gaas up's: each starts afresh instead)
        env = self.zygote_env()
        self._zygote = Zygote(self.sockets / "zygote.sock", env, module)
        self._spawn("zygote", "zygote", [python, "-m", "gaas.launcher.zygote", str(self._zygote.path), module], env)

    def _spawn_worker(self, index: int, pool: fleet.PoolSpec, report: Callable[[str], None], quiet: bool) -> None:
        try:
            inst = self.topo.worker(index, pool.options())
        except TopologyError as exc:
            if pool.key not in self._refused:
                self._refused.add(pool.key)
                self._report_failure(pool, str(exc))
            return
        busy = [p for p in (inst.inbound_port, inst.metrics_port, inst.envoy_stats_port) if port_in_use(inst.host, p)]
        if busy:
            report(f"cannot start {inst.name} for {pool.model} {pool.version}: port(s) {', '.join(map(str, busy))} "
                   f"on {inst.host} are in use; trying again shortly")
            return
        sockets = LocalSockets.of(self.sockets, inst.name).dir
        sockets.mkdir(parents=True, exist_ok=True)
        os.chmod(sockets, 0o700)
        self._authority.issue("worker", inst.name, sidecar=inst.inbound)
        self.topo = with_workers(self.topo, [*self.topo.of("worker"), inst])
        config = envoyconf.sidecar_config(self.topo, inst, self.log_dir, self._authority, self.sockets, self.trace)
        path = self.run_dir / "envoy" / f"sidecar-{inst.name}.yaml"
        path.write_text(envoyconf.config_text(config))
        self._spawn_service(inst)
        self._spawn_envoy(f"sidecar-{inst.name}", path)
        if not quiet:
            report(f"started {inst.name} for {pool.model} {pool.version} ({pool.role})")

    def _retire(self, name: str, report: Callable[[str], None]) -> None:
        """Drain a worker whose pool shrank or went: SIGUSR1 (it deregisters, takes no new request
        and lets its streams finish: no other worker of its version may be left to carry them on);
        its sidecar stops once it has left (_retire_finished)."""
        self._retiring.add(name)
        child = next((c for c in self.children if c.name == name), None)
        if child is not None and child.proc.poll() is None:
            try:
                child.proc.send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                pass
        report(f"{name} drains: its pool ({fleet.key_of(self.topo.instance(name).options)[0]} "
               f"{fleet.key_of(self.topo.instance(name).options)[1]}) needs it no more")

    def _retired(self, name: str) -> bool:
        """A retiring worker, or its sidecar (never restarted)."""
        return name in self._retiring or name.removeprefix("sidecar-") in self._retiring

    def _retire_finished(self, report: Callable[[str], None]) -> bool:
        """The retiring workers that have left: their sidecars stopped, then both forgotten."""
        changed = False
        for name in sorted(self._retiring):
            worker = next((c for c in self.children if c.name == name), None)
            sidecar = next((c for c in self.children if c.name == f"sidecar-{name}"), None)
            if worker is not None and worker.proc.poll() is None:
                continue
            if sidecar is not None and sidecar.proc.poll() is None:
                sidecar.proc.send_signal(signal.SIGTERM)
                continue
            for c in (worker, sidecar):
                if c is not None:
                    signal_group(c.proc.pid, signal.SIGKILL)  # what its engine left
                    self.children.remove(c)
            self._retiring.discard(name)
            self.topo = with_workers(self.topo, [w for w in self.topo.of("worker") if w.name != name])
            shutil.rmtree(LocalSockets.of(self.sockets, name).dir, ignore_errors=True)
            report(f"{name} has left")
            changed = True
        return changed
