"""Router service: the mesh's edge behind the Envoy ingress. Picks a worker for each request and
streams the generation from it through the sidecars.

Settings come from GAAS_* variables (see --help); `gaas up` sets them from the topology.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from gaas.contracts import qos
from gaas.settings import deployspec
from gaas.contracts import edge as edge_limits
from gaas.metering.local import LocalQuotas
from gaas.metering.meter import Meter
from gaas.metering.peers import Peers
from gaas.runtime import redisconn
from gaas.runtime.metrics import DECOMPOSITION_BUCKETS, FAST_BUCKETS
from gaas.runtime.server import ServiceRuntime, options_for, run_service
from gaas.settings.docs import help_epilog
from gaas.settings.env import ConfigError
from gaas.settings.router import RouterSettings
from gaas.contracts.sessions import SessionPolicy
from gaas.model.tokenizer import TokenizerCache
from gaas.contracts.services import AUTHZ_SERVICE
from gaas.v1 import (
    billing_pb2_grpc, control_pb2_grpc, ext_authz_pb2_grpc, inference_pb2_grpc, kvcache_pb2_grpc, openai_pb2_grpc, router_pb2_grpc,
    worker_pb2_grpc,
)
from services.router.auth import Authenticator, SharedKeys
from services.router.batches import BatchFront, BatchRunner
from services.router.billingclient import usage_reader
from services.router.coalescing import Coalescing
from services.router.controlclient import control_fetcher, key_lookup
from services.router import registry_changes
from services.router.directory import DirectoryCollector, MeshDirectory
from services.router.stages import RouterMetrics, Stages
from services.router.edgeauth import EdgeAuthorizer
from services.router.extproc import ExternalProcessor
from services.router.extproc_http import ExtProcFront
from services.router.flow import Flow, FlowCollector, FlowSettings
from services.router.flowstatus import RouterServicer
from services.router.kvclient import KVDirectoryClient
from services.router.kvreplica import Follower
from services.router.openai_servicer import OpenAIServicer
from services.router.responses import ResponseStore
from services.router.demand import Demand
from services.router.outcomes import RolloutReporter
from services.router.pipeline import Pipeline
from services.router.scheduling import make_scheduler
from services.router.servicer import InferenceServicer
from services.router.sessions import SESSION_OUTCOMES, SessionMetrics, SessionStore

log = logging.getLogger("gaas.router")


async def serve(cfg: RouterSettings) -> None:
    # The edge: tenant metadata from outside is never believed.
    rt = ServiceRuntime(options_for("router", cfg, edge=True, max_request_bytes=max(
        edge_limits.MAX_GRPC_REQUEST_BYTES, cfg.max_body_bytes + 64 * edge_limits.KIB)))
    rt.install_signal_handlers()
    channel = rt.channel(cfg.outbound)
    control = control_pb2_grpc.ControlStub(channel)
    tokenizers = TokenizerCache()
    spec = deployspec.load(Path(cfg.deploy_file)) if cfg.deploy_file else None
    policies = spec.qos if spec else dict(qos.DEFAULT_POLICIES)
    session_policy = spec.sessions if spec else SessionPolicy()
    flow = Flow(policies, FlowSettings(
        enabled=cfg.qos, max_waiting=cfg.max_waiting, window_initial=cfg.window_initial, window_min=cfg.window_min,
        window_max=cfg.window_max, breaker_cooldown_seconds=cfg.breaker_cooldown_seconds,
    ))
    directory = MeshDirectory(
        control_fetcher(control), cfg.registry_refresh_seconds, cfg.max_stale_seconds,
        on_refresh=lambda snap: flow.forget([w.worker_id for w in snap.workers]),
    )
    rt.metrics.registry.register(FlowCollector(flow))
    rt.metrics.registry.register(DirectoryCollector(directory))
    log.info("flow control %s: targets %s", "on" if cfg.qos else "OFF",
             ", ".join(f"{t} TTFT {p.ttft_target_ms:g} ms, queue {p.queue_timeout_s:g} s" for t, p in policies.items()))
    plugin_seconds = rt.metrics.histogram(
        "scheduler_plugin_seconds", "Time each scheduling plugin took per request", ("plugin",), buckets=FAST_BUCKETS
    )
    try:
        scheduler = make_scheduler(cfg.policy, cfg.weights, lambda plugin, s: plugin_seconds.labels(plugin).observe(s),
                                   weights_from="GAAS_ROUTER_WEIGHTS")
    except ValueError as exc:  # a scorer or plugin nobody registered: a start-up failure of one line
        raise ConfigError(str(exc)) from None
    kv = KVDirectoryClient(kvcache_pb2_grpc.KVCacheStub(channel))
    follower = Follower(kv.replica, kv.follow, staleness=rt.metrics.histogram(
        "kv_replica_staleness_seconds", "From an engine's KV event to its change in this router's replica of the "
        "KV directory (the oldest event of each change applied)", buckets=DECOMPOSITION_BUCKETS).observe)
    redis = redisconn.connect(cfg.redis_url, timeout=1.0)
    # The outcomes of requests of models under a roll-out, for control's SLO guard.
    reporter = RolloutReporter(redis)
    stages = Stages(
        directory,
        scheduler,
        worker_pb2_grpc.WorkerStub(channel),
        lambda model: tokenizers.get(model.source),
        retries=cfg.retries,
        moves=cfg.moves,
        max_stream_seconds=cfg.max_stream_seconds,
        kv=kv,
        flow=flow,
        coalescing=Coalescing(cfg.coalesce_per_step, max(1, cfg.coalesce_max)),
        reporter=reporter,
        demand=Demand(redis, awaiting=rt.metrics.gauge(
            "requests_awaiting_workers", "Requests held while no worker of their (autoscaled) model serves",
            ("model",))),
        metrics=RouterMetrics(
            routed=rt.metrics.counter("routed_total", "Requests sent to each worker, by policy", ("policy", "worker")),
            prediction_misses=rt.metrics.counter(
                "prefix_prediction_misses_total",
                "Requests whose engine served fewer cached tokens than the KV directory said it held",
            ),
            lookup_seconds=rt.metrics.histogram("kv_lookup_seconds", "KV directory lookups", buckets=FAST_BUCKETS),
            latency_seconds=rt.metrics.histogram(
                "request_latency_seconds",
                "Each request's latency by part (tenant, router, queue, prefill, decode, net; total), by tier",
                ("part", "tier"), buckets=DECOMPOSITION_BUCKETS,
            ),
            requests=rt.metrics.counter(
                "requests_total", "Generation requests by model, tier and outcome (finish reason, status, cancelled)",
                ("model", "tier", "outcome"),
            ),
            moves=rt.metrics.counter(
                "stream_moves_total", "Streams whose worker failed after their first token, carried on by another "
                "worker (outcome moved) or not (failed)", ("model", "outcome"),
            ),
            moved_prefill_tokens=rt.metrics.counter(
                "stream_moved_prefill_tokens_total", "Prompt tokens recomputed by the workers that carried moved "
                "streams on (the mesh's cost; not billed)", ("model",),
            ),
            tokens=rt.metrics.counter(
                "tokens_total", "Tokens by model, tier and kind (prompt, completion, cached: of the prompt, from the "
                "prefix cache)", ("model", "tier", "kind"),
            ),
            ttft_seconds=rt.metrics.histogram(
                "time_to_first_token_seconds", "The ingress's arrival to the first token", ("model", "tier"),
                buckets=DECOMPOSITION_BUCKETS,
            ),
            tpot_seconds=rt.metrics.histogram(
                "time_per_output_token_seconds", "After the first token, per output token", ("model", "tier"),
                buckets=DECOMPOSITION_BUCKETS,
            ),
        ),
    )
    log.info("routing with the %s policy (scorers: %s)", scheduler.name,
             ", ".join(f"{s.name}={w:g}" for s, w in scheduler.scorers) or "none")
    auth = Authenticator(key_lookup(control), cfg.auth_cache_seconds, stale_seconds=cfg.max_stale_seconds,
                         shared=SharedKeys(redis, cfg.max_stale_seconds))
    # Its own count of what it admitted: cheap refusals before parsing, and admission while Redis is
    # away (each tenant's quotas shared among the live routers). Its own client, whose calls fail at
    # once while Redis is away (a connection a restarted Redis closed is tried again once): the
    # fallback admits instead of waiting.
    meter_redis = redisconn.connect(cfg.redis_url, timeout=1.0, retries=1)
    peers = Peers(meter_redis, cfg.instance)
    meter = Meter(meter_redis, Path(cfg.spool_dir) / cfg.instance, local=LocalQuotas(routers=peers.routers))
    sessions = SessionStore(redis, session_policy, metrics=SessionMetrics(
        turns=rt.metrics.counter("session_turns_total", "Session turns by outcome: committed, busy (another turn held "
                                 "the session), changed (its version moved), released (no reply), unavailable",
                                 ("outcome",)),
        reloads=rt.metrics.counter("session_reloads_total", "Session contexts read again: this router's copy was older"),
        dropped_turns=rt.metrics.counter("session_dropped_turns_total",
                                         "Turns dropped from session contexts to fit a model's window"),
    ))
    for outcome in SESSION_OUTCOMES:  # every outcome exported from the start, at 0
        sessions.metrics.turns.labels(outcome)
    log.info("sessions kept %d s after their last turn; context past a model's window: %s (reply reserve %d tokens)",
             session_policy.ttl_seconds, session_policy.truncation, session_policy.reply_reserve_tokens)
    billing = billing_pb2_grpc.BillingStub(channel)
    read_usage = usage_reader(billing)
    # One request pipeline; each API below is an adapter of it.
    pipeline = Pipeline(stages, auth, meter, sessions)
    rt.add_service(
        inference_pb2_grpc.add_InferenceServicer_to_server, InferenceServicer(pipeline, read_usage), "gaas.v1.Inference",
    )
    rt.add_service(
        openai_pb2_grpc.add_OpenAIServicer_to_server,
        OpenAIServicer(pipeline, cfg.max_body_bytes, rt.metrics.registry, ResponseStore(redis, session_policy),
                       BatchFront(billing)),
        "gaas.v1.OpenAI"
    )
    # The ingress's key check on each request's headers, before it reads the body.
    rt.add_service(ext_authz_pb2_grpc.add_AuthorizationServicer_to_server, EdgeAuthorizer(auth), AUTHZ_SERVICE,
                   listed=False)
    # The ingress's decision call when the router is out of the token stream (ingress.path: direct).
    # Its sidecar forwards them over HTTP/1.1 (extproc_http.py): grpc.aio's machinery per call and
    # message cost three times what the decision's calls need.
    extproc = ExternalProcessor(pipeline, cfg.max_body_bytes, cfg.instance, cfg.moves, cfg.max_stream_seconds)
    front = ExtProcFront(extproc, rt.metrics, rt.opts.max_request_bytes, tracer_provider=rt.tracer_provider)
    rt.stop_with_server(front.stop)
    rt.add_service(router_pb2_grpc.add_RouterServicer_to_server, RouterServicer(cfg.instance, flow, stages.activity, sessions), "gaas.v1.Router",
                   listed=False)  # reached through the router's sidecar only, never the ingress
    await rt.start()
    await front.start(cfg.http_listen)
    refresher = asyncio.create_task(directory.run(), name="mesh-view")
    following = asyncio.create_task(follower.run(), name="kv-replica")
    spool = asyncio.create_task(meter.run_spool(), name="usage-spool")
    membership = asyncio.create_task(peers.run(), name="router-peers")
    reports = asyncio.create_task(extproc.run_reports(cfg.redis_url), name="direct-reports")
    sweep = asyncio.create_task(extproc.sweep(redis), name="direct-sweep")
    reporting = asyncio.create_task(reporter.run(), name="rollout-outcomes")
    changes = asyncio.create_task(registry_changes.follow(cfg.redis_url, directory.refresh), name="registry-changes")
    # Batch items, while this router has room for them (none while an interactive request waits).
    runner = BatchRunner(pipeline, billing, cfg.instance, cfg.batch_concurrency, cfg.max_body_bytes,
                         busy=lambda: flow.queue.ahead(qos.band(qos.BATCH) - 1),
                         owners=Authenticator(key_lookup(control, by="key_id"), cfg.auth_cache_seconds,
                                              stale_seconds=cfg.max_stale_seconds))
    batches = asyncio.create_task(runner.run(), name="batch-runner") if cfg.batch_concurrency else None

    async def stop_refreshing() -> None:
        await runner.drain(cfg.grace_seconds / 2)
        tasks = (refresher, following, spool, membership, reports, sweep, reporting, changes, *([batches] if batches else []))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await reporter.flush()
        await kv.close()
        await sessions.close()
        await meter.close()
        await meter.drain_spool()
        await peers.leave()
        await meter_redis.aclose()
        await redis.aclose()

    rt.on_stop(stop_refreshing)
    # SERVING once it sees the mesh: a router restarted while control is away takes no request it
    # could only refuse (the ingress's other routers take them).
    viewed = asyncio.create_task(directory.first_view())
    stopping = asyncio.create_task(rt.wait_stop_requested())
    await asyncio.wait({viewed, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if viewed.done():
        await rt.set_serving(True)
    else:
        log.warning("stopping before the first view of the mesh was read")
    for task in (viewed, stopping):
        task.cancel()
    try:
        await rt.run_until_stopped()
    finally:
        await channel.close()


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, epilog=help_epilog("router"), formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    run_service("router", RouterSettings.from_env, serve)


if __name__ == "__main__":
    main()
