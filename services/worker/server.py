"""Worker service: one vLLM engine behind gaas.v1.Worker.

On the CPU imports vLLM and starts its engine's server first (enginefork), then listens NOT_SERVING,
builds the engine (~5 s on a CPU), then reports SERVING and registers with
the control plane through its sidecar, renewing the lease while alive. On SIGTERM: NOT_SERVING,
deregister, let running streams finish (grace; routers' streams still running after
GAAS_HANDOVER_SECONDS end, and each router carries its own on at another worker), stop the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from gaas.host import placement
from gaas.host.placement import parse_cpu_list
from gaas.metering.meter import Meter
from gaas.runtime import redisconn
from gaas.runtime.server import ServiceRuntime, options_for, run_service
from gaas.settings.docs import help_epilog
from gaas.settings.worker import WorkerSettings
from gaas.v1 import control_pb2, control_pb2_grpc, worker_pb2_grpc
from services.worker import enginefork
from services.worker.carryon import CarryOn, CarryOnMetrics
from services.worker.direct import NATIVE_SERVICE, DirectServicer, add_native_to_server
from services.worker.http import HttpFront
from services.worker.vllm_engine import KV_TOPIC, VllmEngine
from services.worker.kvevents import KVEventRelay, ZmqEventSource
from services.worker.lease import LeaseKeeper
from services.worker.warmup import prime, warm_up
from services.worker.servicer import WorkerServicer

log = logging.getLogger("gaas.worker")

# What else of the environment it reads, besides its settings (gaas.settings.worker).
HELP_MORE = """  VLLM_CPU_OMP_THREADS_BIND    the core(s) a CPU worker is pinned to (`gaas up` sets one per worker)
"""


# The exit status of a worker whose engine died (gaas up restarts it).
ENGINE_DIED_EXIT = 3


def device_monitor(engine: VllmEngine):
    """What reports the worker's device: its GPU through NVML (the memory and time of this worker's
    own processes where NVML can tell them), else its CPU cores and the RAM."""
    from gaas.host.devices import CpuMonitor, GpuMonitor
    from gaas.host.placement import descendants

    if engine.gpu_uuid is not None:
        me = os.getpid()
        try:
            return GpuMonitor(engine.gpu_uuid, pids=lambda: {me, *descendants(me)})
        except Exception as exc:  # noqa: BLE001 - NVML errors: report the CPU instead of failing
            log.warning("NVML cannot describe GPU %s (%s); reporting the CPU instead", engine.gpu_uuid, exc)
    return CpuMonitor(parse_cpu_list(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")))


# How often the device is sampled for load reports (off the event loop: NVML calls block).
DEVICE_SAMPLE_SECONDS = 1.0


async def sample_device(servicer: WorkerServicer) -> None:
    """Keep servicer.device_sample fresh; load reports read it without touching NVML or /proc."""
    failures = 0
    while True:
        try:
            servicer.device_sample = await asyncio.to_thread(servicer.monitor.sample)
            failures = 0
        except Exception as exc:  # noqa: BLE001 - a failed read keeps the last sample
            failures += 1
            if failures in (1, 60):
                log.warning("cannot sample the device (%s: %s); load reports keep the last sample",
                            type(exc).__name__, exc)
        await asyncio.sleep(DEVICE_SAMPLE_SECONDS)


# What a worker imports before it listens on the CPU (vLLM's front end and its engine's modules):
# what `gaas up`'s worker zygote holds imported for the workers it forks (gaas.launcher.zygote).
ZYGOTE_PRELOAD = ("vllm.v1.engine.async_llm", *enginefork.ENGINE_MODULES)


def start_engine_server(cfg: WorkerSettings) -> None:
    """Before anything else (no thread runs yet): on the CPU, the server vLLM's engine process is
    forked from (enginefork), from this process once it has imported vLLM where `gaas up` started
    it so, else from a new interpreter importing on the other core while this one does."""
    if cfg.device == "cpu":
        enginefork.start_server(placement.cpu_engine_environment(cfg.executor, cfg.kv_cache_gib),
                                parse_cpu_list(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")),
                                ZYGOTE_PRELOAD)


async def serve(cfg: WorkerSettings) -> None:
    # What Envoy sends here that names another worker (it had not heard of that one yet) is refused untaken.
    rt = ServiceRuntime(options_for("worker", cfg, named_as=cfg.advertise))
    rt.install_signal_handlers()
    # SIGUSR1 (gaas up: the worker's pool needs it no more): leave, and let every stream finish here.
    retired = asyncio.Event()

    def retire() -> None:
        retired.set()
        rt.request_stop("retired: its pool needs it no more; the streams it has finish here",
                        grace_seconds=cfg.retire_grace_seconds)

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, retire)
    # The engine's KV-event sockets live in a directory only this worker's user can enter.
    events_dir = tempfile.mkdtemp(prefix=f"gaas-{cfg.instance}-kv-") if cfg.kv_events else None
    engine_task = asyncio.create_task(VllmEngine.start(cfg, kv_events_dir=events_dir))
    servicer = WorkerServicer(cfg.instance, max_waiting=cfg.max_waiting)
    rt.add_service(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "gaas.v1.Worker")
    # Generations the ingress sends here straight, as a router decided them (ingress.path: direct).
    meter = redis = None
    if cfg.redis_url:
        redis = redisconn.connect(cfg.redis_url, timeout=1.0)
        meter = Meter(redis, Path(cfg.spool_dir) / cfg.instance, streams_direct=True)
        spool = asyncio.create_task(meter.run_spool(), name="usage-spool")

        async def stop_meter() -> None:
            await _cancel(spool)
            await meter.close()
            await meter.drain_spool()
            await redis.aclose()

        rt.after_stop(stop_meter)
    # Its sidecar's outbound: control (the lease), and the other workers (streams carried on there).
    channel = rt.channel(cfg.outbound) if cfg.outbound else None
    carry_on = CarryOn(servicer, worker_pb2_grpc.WorkerStub(channel) if channel is not None else None, cfg.advertise,
                       CarryOnMetrics(
                           moves=rt.metrics.counter(
                               "stream_moves_total", "Streams whose engine stopped after their first token, carried on "
                               "by another worker (moved) or not (failed)", ("outcome",)),
                           moved_prefill_tokens=rt.metrics.counter(
                               "stream_moved_prefill_tokens_total", "Prompt tokens recomputed by the workers that "
                               "carried this worker's streams on (the mesh's cost, not billed)")))
    direct = DirectServicer(servicer, meter, redis, carry_on)
    progress = asyncio.create_task(direct.run_progress(), name="stream-progress")
    rt.after_stop(lambda: _cancel(progress))
    rt.add_service(add_native_to_server, direct, NATIVE_SERVICE, listed=False)
    # The OpenAI generations stream over HTTP/1.1, each chunk one write (http.py).
    front = HttpFront(direct.http_routes(), rt.metrics, named_as=cfg.advertise, tracer_provider=rt.tracer_provider)
    rt.stop_with_server(front.stop)
    # The port is open (and NOT_SERVING) while the engine loads, so health checks get an answer.
    await rt.start()
    await front.start(cfg.http_listen)
    log.info("loading %s from %s", cfg.model, cfg.model_path)
    stop_wait = asyncio.create_task(rt.wait_stop_requested())
    await asyncio.wait({engine_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if not engine_task.done():
        # The engine is built in a thread that cannot be interrupted; exit once it is up.
        log.info("stop requested while the engine loads; exiting when it is up")
    stop_wait.cancel()
    try:
        engine = await engine_task
    except Exception as exc:
        log.error("the engine failed to start: %s: %s", type(exc).__name__, exc, exc_info=True)
        if channel is not None:
            # Control halts a roll-out of this version with the reason (the stable one keeps serving).
            await report_start_failure(control_pb2_grpc.ControlStub(channel), cfg, exc)
        await rt.shutdown()
        raise SystemExit(1) from None
    # The engine's KV events followed from its first (the warm-up's, the primed public prefixes'), so
    # the snapshot a KV directory takes when it watches this worker holds every block it caches.
    relay_task = None
    if engine.info.kv_events_endpoint:
        source = ZmqEventSource(engine.info.kv_events_endpoint, engine.info.kv_replay_endpoint, KV_TOPIC)
        servicer.relay = KVEventRelay(cfg.instance, source, engine.reset_prefix_cache)
        relay_task = asyncio.create_task(servicer.relay.run(), name="kv-events")

        async def stop_relay() -> None:
            servicer.relay.close()  # the directories' watches end now, not at the grace's end
            relay_task.cancel()
            await asyncio.gather(relay_task, return_exceptions=True)
            source.close()

        rt.on_stop(stop_relay)
    # A few requests through the engine before any router can send it one (it registers after).
    try:
        await warm_up(engine, cfg.warmup_requests)
        if channel is not None and cfg.warmup_requests:
            await prime(engine, await public_prefixes(control_pb2_grpc.ControlStub(channel), cfg.model))
    except Exception as exc:  # noqa: BLE001 - its own requests will say what is wrong, if anything is
        log.warning("the warm-up failed (%s: %s); serving all the same", type(exc).__name__, exc)
    servicer.engine = engine
    # The engine stops after the server has (streams in flight finish first), its sockets after it.
    if events_dir:
        rt.after_stop(lambda: asyncio.to_thread(shutil.rmtree, events_dir, True))
    rt.after_stop(engine.shutdown)
    watch = asyncio.create_task(watch_engine(engine, rt), name="engine-watch")
    servicer.monitor = await asyncio.to_thread(device_monitor, engine)
    sampler = asyncio.create_task(sample_device(servicer), name="device-sampler")
    rt.on_stop(lambda: _cancel(sampler))
    if channel is not None:
        info = engine.info
        keeper = LeaseKeeper(
            control_pb2_grpc.ControlStub(channel),
            control_pb2.WorkerInfo(
                worker_id=cfg.instance,
                address=cfg.advertise,
                model=info.model,
                model_version=info.model_version,
                backend=info.backend,
                device=info.device,
                block_size=info.block_size,
                max_model_len=info.max_model_len,
                engine_version=info.engine_version,
            ),
            cfg.lease_renew_seconds,
            load=servicer.load_report,
            adapters=engine.retain_adapters if info.adapter_slots else None,
        )
        rt.on_stop(keeper.stop)  # runs first: routers stop picking this worker
    if cfg.handover_seconds >= 0:
        async def hand_over_unless_retired() -> None:
            if not retired.is_set():
                await hand_over_later(servicer, cfg.handover_seconds)

        rt.on_stop(hand_over_unless_retired)
    if rt.stopping:
        await rt.shutdown()
        return
    await rt.set_serving(True)
    if channel is not None:
        keeper.start()
    try:
        await rt.run_until_stopped()
    finally:
        watch.cancel()
        if channel is not None:
            await channel.close()
    # Everything that matters has stopped (the engine too). vLLM can leave threads behind (its
    # output handler, a blocked executor call) that hold an interpreter's exit for minutes, and
    # `gaas up` restarts a worker only once its process is gone: leave at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rt.exit_code)


async def report_start_failure(control: control_pb2_grpc.ControlStub, cfg: WorkerSettings, exc: BaseException,
                               timeout: float = 3.0) -> None:
    """Tell control why this worker's engine could not start (the exception and its causes)."""
    reasons, seen = [], exc
    while seen is not None and len(reasons) < 4:
        reasons.append(f"{type(seen).__name__}: {seen}".strip())
        seen = seen.__cause__ or seen.__context__
    try:
        await control.ReportPoolFailure(control_pb2.ReportPoolFailureRequest(
            model=cfg.model, version=cfg.model_version, worker_id=cfg.instance,
            reason="the engine failed to start: " + "; caused by ".join(reasons)), timeout=timeout)
    except Exception as report_exc:  # control away: the roll-out's start timeout halts it instead
        log.warning("could not tell control why the engine failed: %s", report_exc)


async def public_prefixes(control: control_pb2_grpc.ControlStub, model: str,
                          timeout: float = 3.0) -> list[tuple[str, str]]:
    """(id, text) of the model's public prefixes, to prime (none when control does not answer)."""
    try:
        resp = await control.ListPublicPrefixes(control_pb2.ListPublicPrefixesRequest(model=model), timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - priming is an optimisation
        log.warning("cannot read the public prefixes to prime (%s); their first requests compute them", exc)
        return []
    return [(p.prefix_id, p.text) for p in resp.prefixes]


async def watch_engine(engine: VllmEngine, rt: ServiceRuntime, every_seconds: float = 0.5) -> None:
    """A worker whose engine died is no worker: leave the registry (NOT_SERVING, deregistered) and
    exit with ENGINE_DIED_EXIT, so `gaas up` (or any supervisor) starts a fresh one: at once, with
    no drain (whatever is sent here meanwhile fails before its first token and goes to its second
    choice); the streams already carried on elsewhere get the grace to finish."""
    while not rt.stopping:
        if engine.dead:
            rt.request_stop("the engine died; exiting so that a fresh worker is started", ENGINE_DIED_EXIT,
                            drain=False)
            return
        await asyncio.sleep(every_seconds)


async def hand_over_later(servicer: WorkerServicer, after_s: float) -> None:
    """Stopping: after after_s, the streams still running end (UNAVAILABLE) at their next token and
    whoever is in each carries it on at another worker: a router its own, this worker's front end
    the ingress's (services/worker/carryon.py), so that no long stream holds the engine."""

    def hand_over() -> None:
        log.info("stopping: the streams still running here are handed over to other workers")
        servicer.handing_over = True

    asyncio.get_running_loop().call_later(after_s, hand_over)


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, epilog=help_epilog("worker", HELP_MORE), formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    # vLLM would fork its engine process on CUDA, from a process already running gRPC's threads
    # and sockets; spawn starts it clean (vLLM's default on the CPU already). And CUDA numbers the
    # GPUs as NVML does.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    run_service("worker", WorkerSettings.from_env, serve, before=start_engine_server)


if __name__ == "__main__":
    main()
