"""Envoy's aggregated discovery service (ADS, state of the world), as control serves it: each
Envoy of the mesh (the ingress, the sidecars that reach workers) keeps one stream open and is sent
the endpoints of the clusters it asks for (gaas/envoy/clusters.py's workers_cluster) whenever the
membership (services/control/membership.py) changes, so a worker that registers takes traffic and
one that leaves stops getting it with no Envoy restarted.

The protocol (Envoy's xDS): a request names the resources of one type it wants; the answer carries
them with a version and a nonce; the next request with that nonce accepts it (ACK) or, with
error_detail, rejects it (NACK: logged, the version not sent again). Only endpoints (EDS) are served;
a request for another type is answered with nothing of it. protobuf <-> membership only."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

from google.protobuf import any_pb2

from gaas.v1 import xds_pb2 as pb
from gaas.v1 import xds_pb2_grpc
from services.control.membership import Endpoint, Membership

log = logging.getLogger(__name__)

ENDPOINTS_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def assignment(name: str, endpoints: tuple[Endpoint, ...]) -> pb.ClusterLoadAssignment:
    """One cluster's endpoints as Envoy's ClusterLoadAssignment."""
    return pb.ClusterLoadAssignment(cluster_name=name, endpoints=[pb.LocalityLbEndpoints(lb_endpoints=[
        pb.LbEndpoint(
            endpoint=pb.Endpoint(address=pb.Address(socket_address=pb.SocketAddress(address=e.host, port_value=e.port)),
                                 hostname=e.worker_id),
            # Healthy to Envoy, always: which worker may take what is the routers' call (an override
            # host Envoy thought unhealthy would go to any worker instead).
            health_status=pb.HEALTHY,
        )
        for e in endpoints
    ])])


class AggregatedDiscovery(xds_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, membership: Membership) -> None:
        self._membership = membership
        self._nonces = itertools.count(1)
        self._closing = asyncio.Event()

    async def close(self) -> None:
        """Ends every stream (control is stopping: each Envoy goes on with what it has, and asks
        another replica, or this one once back)."""
        self._closing.set()

    def _response(self, names: list[str]) -> pb.DiscoveryResponse:
        m = self._membership
        resources = []
        for name in names:
            cla = assignment(name, m.resources.get(name, ()))  # an unknown name: no endpoints (yet)
            resources.append(any_pb2.Any(type_url=ENDPOINTS_TYPE, value=cla.SerializeToString()))
        return pb.DiscoveryResponse(version_info=m.version, resources=resources, type_url=ENDPOINTS_TYPE,
                                    nonce=str(next(self._nonces)))

    async def StreamAggregatedResources(self, request_iterator, context):
        requests: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            try:
                async for req in request_iterator:
                    await requests.put(req)
            finally:
                await requests.put(None)

        reader = asyncio.create_task(read(), name="xds-reader")
        node = ""
        names: list[str] | None = None  # what the Envoy asked for (None: nothing yet)
        sent = ""  # the version last sent on this stream
        try:
            while True:
                changed = self._membership.changed()
                if names is not None and sent != self._membership.version:
                    response = self._response(names)
                    sent = response.version_info
                    yield response
                    continue
                get = asyncio.ensure_future(requests.get())
                wake = asyncio.ensure_future(changed.wait())
                closing = asyncio.ensure_future(self._closing.wait())
                done, _ = await asyncio.wait({get, wake, closing}, return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                closing.cancel()
                if self._closing.is_set():
                    get.cancel()
                    return
                if get not in done:
                    get.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await get
                    continue
                req = get.result()
                if req is None:
                    return
                node = req.node.id or node
                if req.type_url != ENDPOINTS_TYPE:
                    log.debug("xds: %s asked for %s, which control does not serve", node, req.type_url)
                    continue
                if req.error_detail.message:
                    log.warning("xds: %s rejected endpoints version %s: %s", node, sent, req.error_detail.message)
                if list(req.resource_names) != names:
                    names = list(req.resource_names)
                    sent = ""  # a new subscription (or the stream's first): send what it asked for now
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
