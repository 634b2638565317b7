"""Service bootstrap: a grpc.aio server with health, reflection, metadata interceptor, tracing,
/metrics, and graceful shutdown on SIGTERM or SIGINT.

Shutdown order: health goes NOT_SERVING (Envoy's health checks and new callers see it), the
service's own stop hooks run (e.g. a worker deregisters), the drain period passes, then
server.stop(grace) lets running calls finish before cancelling them, and last the after-stop
hooks release what those calls needed (e.g. a worker's engine).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gaas.runtime import telemetry
from gaas.runtime.interceptors import ServerContextInterceptor, client_context_interceptors
from gaas.runtime.metrics import MetricsServer, ServiceMetrics

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


@dataclass(frozen=True, slots=True)
class ServerOptions:
    # Service kind ("router", "worker", ...): names metrics and logs.
    service: str
    # This replica's name ("worker-0").
    instance: str
    host: str = "127.0.0.1"
    # gRPC port; 0 picks a free one (tests).
    port: int = 0
    # unix:/path: serve gRPC on that Unix socket instead (host then only binds /metrics).
    listen: str = ""
    # /metrics port; None serves no metrics, 0 picks a free one.
    metrics_port: int | None = None
    # Seconds running calls get to finish once shutdown starts.
    grace_seconds: float = 10.0
    # Seconds between NOT_SERVING and closing the port, so health checkers notice first.
    drain_seconds: float = 1.0
    # Whether this is the mesh's edge (the router): it believes no x-gaas-* metadata from callers.
    edge: bool = False
    # The largest request message it takes (grpc answers RESOURCE_EXHAUSTED past it, unread).
    max_request_bytes: int = 64 << 20
    # A worker's own address (its sidecar's inbound host:port): a call whose x-gaas-worker names
    # other workers only is refused untaken (ServerContextInterceptor). "": any call is taken.
    named_as: str = ""


def check_socket_free(path: Path) -> None:
    """gRPC replaces a socket file it finds at its address (what kill -9 leaves behind), even one a
    live process still listens on: refuse to take that one over (OSError)."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return  # nobody listens: a leftover, gRPC replaces it
    finally:
        probe.close()
    raise OSError(f"cannot listen on unix:{path}: it is in use (is another instance running?)")


# Connections a plain server's listener holds before it accepts them (the kernel caps it at
# net.core.somaxconn). asyncio's default of 100 overflowed under a flood of keyless requests, each of
# whose decision calls the router's sidecar makes on a new connection (a refused call is not
# finished, so its connection is not kept): the sidecar's connects were refused, its 503s ejected
# the router at the ingress, and a real request failed.
PLAIN_BACKLOG = 4096


async def listen_plain(factory: Callable[[], asyncio.Protocol], listen: str) -> asyncio.AbstractServer:
    """A plain asyncio server of this service beside its gRPC one (an HTTP/1.1 front), at listen:
    unix:/path (a leftover socket file replaced, a live one refused; only the owner may connect)
    or host:port."""
    loop = asyncio.get_running_loop()
    if listen.startswith("unix:"):
        path = Path(listen.removeprefix("unix:"))
        check_socket_free(path)
        path.unlink(missing_ok=True)  # what kill -9 left: asyncio, unlike gRPC, does not replace it
        server = await loop.create_unix_server(factory, str(path), backlog=PLAIN_BACKLOG)
        path.chmod(0o600)
        return server
    host, _, port = listen.rpartition(":")
    return await loop.create_server(factory, host, int(port), reuse_address=True, backlog=PLAIN_BACKLOG)


def options_for(service: str, cfg, **extra) -> ServerOptions:
    """ServerOptions from a service's settings (each carries gaas/settings/common.py's fields)."""
    return ServerOptions(
        service=service,
        instance=cfg.instance,
        host=cfg.host,
        port=cfg.port,
        listen=cfg.listen,
        metrics_port=None if cfg.metrics_port < 0 else cfg.metrics_port,
        grace_seconds=cfg.grace_seconds,
        **extra,
    )


class ServiceRuntime:
    """Owns a service's server, health, metrics and tracing, and their shutdown."""

    def __init__(self, opts: ServerOptions) -> None:
        self.opts = opts
        self.metrics = ServiceMetrics(opts.service)
        self.tracer_provider = telemetry.make_tracer_provider(opts.service, opts.instance)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            interceptors=[
                ServerContextInterceptor(self.metrics, edge=opts.edge, named_as=opts.named_as),
                *telemetry.server_interceptors(self.tracer_provider),
            ],
            # Without this, a second server silently shares a port already in use.
            options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0),
                     ("grpc.max_receive_message_length", opts.max_request_bytes)],
        )
        self.port = 0
        self._names: list[str] = []
        self._unlisted: set[str] = set()
        self._stop_hooks: list[Callable[[], Awaitable[None]]] = []
        self._after_stop_hooks: list[Callable[[], Awaitable[None]]] = []
        # Servers besides the gRPC one (a worker's HTTP front), stopped with it, with its grace.
        self._also: list[Callable[[float], Awaitable[None]]] = []
        self._stopping = asyncio.Event()
        # What request_stop asked of the shutdown: the running calls' grace (None: the options'),
        # and whether to wait drain_seconds before the port closes.
        self._grace: float | None = None
        self._drain = True
        # The process's exit status once stopped (request_stop can set a failure).
        self.exit_code = 0
        self._metrics_server: MetricsServer | None = None

    def add_service(self, add_to_server: Callable, servicer: object, full_name: str, *, listed: bool = True) -> None:
        """Register a servicer (e.g. worker_pb2_grpc.add_WorkerServicer_to_server) under its full name;
        listed=False keeps it out of server reflection (an internal API of a service the ingress exposes)."""
        add_to_server(servicer, self.server)
        self._names.append(full_name)
        if not listed:
            self._unlisted.add(full_name)

    def on_stop(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run hook during shutdown, after NOT_SERVING and before the port closes (last added runs first)."""
        self._stop_hooks.append(hook)

    def stop_with_server(self, stop: Callable[[float], Awaitable[None]]) -> None:
        """Another server of this service, stopped when the gRPC one stops and as it stops:
        stop(grace) closes its listener, lets its running requests finish for grace seconds, then
        cancels them."""
        self._also.append(stop)

    def after_stop(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run hook once the server has stopped (running calls finished or cancelled); last added runs first."""
        self._after_stop_hooks.append(hook)

    def channel(self, target: str) -> grpc.aio.Channel:
        """A client channel carrying request context and trace headers (to a sidecar's outbound port)."""
        return grpc.aio.insecure_channel(
            target,
            options=CHANNEL_OPTIONS,
            interceptors=[*client_context_interceptors(), *telemetry.client_interceptors(self.tracer_provider)],
        )

    async def start(self) -> int:
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*(n for n in self._names if n not in self._unlisted), health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        where = self.opts.listen or f"{self.opts.host}:{self.opts.port}"
        if self.opts.listen:
            check_socket_free(Path(self.opts.listen.removeprefix("unix:")))
        try:
            self.port = self.server.add_insecure_port(where)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {where}: it is in use (is another instance running?)") from exc
        await self.server.start()
        if self.opts.metrics_port is not None:
            try:
                self._metrics_server = MetricsServer([self.metrics.registry], self.opts.host, self.opts.metrics_port)
            except OSError as exc:
                await self.server.stop(None)
                raise OSError(f"cannot serve metrics on {self.opts.host}:{self.opts.metrics_port}: {exc.strerror} "
                              "(is another instance running, or is the port in the ephemeral range? "
                              "see --port-base)") from exc
            self._metrics_server.start()
        log.info("%s listening on %s (NOT_SERVING until ready)", self.opts.instance,
                 self.opts.listen or f"{self.opts.host}:{self.port}")
        return self.port

    async def set_serving(self, serving: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._set_all(status)
        log.info("health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(status))

    async def _set_all(self, status) -> None:
        for name in ("", *self._names):
            await self.health.set(name, status)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)

    def request_stop(self, why: str = "requested", exit_code: int = 0, grace_seconds: float | None = None,
                     drain: bool = True) -> None:
        """Shut down gracefully; a non-zero exit_code makes the process exit with it (a supervisor
        then knows it failed); grace_seconds: how long calls running then get to finish (the
        settings' grace when None); drain=False: close the port without waiting drain_seconds for
        health checkers to notice (nothing sent here could be served anyway)."""
        if not self._stopping.is_set():
            (log.error if exit_code else log.info)("shutting down (%s)", why)
            self.exit_code = exit_code
            if grace_seconds is not None:
                self._grace = grace_seconds
            self._drain = drain
            self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def wait_stop_requested(self) -> None:
        await self._stopping.wait()

    async def run_until_stopped(self) -> None:
        """Serve until a signal or request_stop(), then shut down gracefully."""
        await self._stopping.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        """NOT_SERVING, the stop hooks, the drain, the servers' stop (running calls get the grace),
        the after-stop hooks; what each step took is logged, naming a hook that took over a second
        (a supervisor waits on all of it before it can start a replacement)."""
        self._stopping.set()
        started = time.monotonic()
        await self.health.enter_graceful_shutdown()
        await self._run_hooks("stop hook", self._stop_hooks)
        hooks_done = time.monotonic()
        if self.opts.drain_seconds > 0 and self._drain:
            await asyncio.sleep(self.opts.drain_seconds)
        grace = self._grace or self.opts.grace_seconds
        drained = time.monotonic()
        await asyncio.gather(self.server.stop(grace), *(stop(grace) for stop in self._also))
        calls_done = time.monotonic()
        await self._run_hooks("after-stop hook", self._after_stop_hooks)
        if self._metrics_server:
            self._metrics_server.stop()
        telemetry.shutdown(self.tracer_provider)
        ended = time.monotonic()
        log.info("%s stopped in %.1f s (stop hooks %.1f s, drain %.1f s, running calls %.1f s, after-stop %.1f s)",
                 self.opts.instance, ended - started, hooks_done - started, drained - hooks_done,
                 calls_done - drained, ended - calls_done)

    async def _run_hooks(self, kind: str, hooks: list[Callable[[], Awaitable[None]]]) -> None:
        """Each of hooks, last added first, each within the grace; a failure is logged, not raised."""
        for hook in reversed(hooks):
            name = getattr(hook, "__qualname__", repr(hook))
            began = time.monotonic()
            try:
                await asyncio.wait_for(hook(), timeout=self.opts.grace_seconds)
            except Exception:
                log.exception("%s %s failed", kind, name)
            if (took := time.monotonic() - began) > 1.0:
                log.warning("%s %s took %.1f s", kind, name, took)


def run_service(service: str, load_config: Callable[[], object], serve: Callable[[object], Awaitable[None]],
                before: Callable[[object], None] | None = None) -> None:
    """A service's main(): read its config, set up logs, run before (what must happen while the
    process has one thread), serve; start-up failures exit with a one-line reason instead of a
    traceback."""
    import sys

    from gaas.settings.deployspec import SpecError
    from gaas.settings.env import ConfigError
    from gaas.runtime.logs import setup_logging
    from gaas.runtime.redisconn import RedisUnavailable

    try:
        cfg = load_config()
    except ConfigError as exc:
        print(f"gaas {service}: bad configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    setup_logging(service, getattr(cfg, "instance", service))
    try:
        if before is not None:
            before(cfg)
        asyncio.run(serve(cfg))
    except (RedisUnavailable, SpecError, ConfigError, OSError) as exc:
        log.error("%s cannot start: %s", service, exc)
        sys.exit(1)
