"""The workers' endpoints as control serves them to Envoys (xDS): what a stream is sent first, after a
change of the registry, after an ACK or a NACK, and when control stops."""

import asyncio

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gaas.contracts.ids import WorkerId
from gaas.v1 import xds_pb2 as pb
from gaas.v1 import xds_pb2_grpc
from services.control.membership import ALL_WORKERS, Membership, resources_of, version_of
from services.control.registry import DRAINING, WorkerRecord
from services.control.xds import ENDPOINTS_TYPE, AggregatedDiscovery


def record(n: int, state: str = "serving", address: str | None = None) -> WorkerRecord:
    return WorkerRecord(WorkerId(f"worker-{n}"), address or f"127.0.0.1:{20041 + 10 * n}", "gaas-tiny", "1.0.0",
                        "vllm-cpu", "cpu", 32, 2048, state=state)


@given(st.permutations([record(0), record(1), record(2, DRAINING)]))
def test_the_version_names_the_set_whatever_order_the_registry_lists_it(records):
    # Two control replicas reading the same registry give an Envoy the same version.
    assert version_of(resources_of(records)) == version_of(resources_of([record(0), record(1), record(2, DRAINING)]))


def test_every_registered_worker_is_an_endpoint_draining_ones_too_and_bad_addresses_none():
    endpoints = resources_of([record(1), record(0, DRAINING), record(3, address="no-port")])[ALL_WORKERS]
    assert [(e.host, e.port, e.worker_id) for e in endpoints] == [
        ("127.0.0.1", 20041, "worker-0"), ("127.0.0.1", 20051, "worker-1")]


class Fleet:
    def __init__(self) -> None:
        self.records: list[WorkerRecord] = []

    async def list(self) -> list[WorkerRecord]:
        return list(self.records)


@pytest.fixture
async def ads():
    fleet = Fleet()
    membership = Membership(fleet.list)
    discovery = AggregatedDiscovery(membership)
    server = grpc.aio.server()
    xds_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(discovery, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield fleet, membership, discovery, xds_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
    await channel.close()
    await server.stop(0)


def endpoints_of(response: pb.DiscoveryResponse) -> dict[str, list[tuple[str, int, str]]]:
    assert response.type_url == ENDPOINTS_TYPE
    out = {}
    for res in response.resources:
        assert res.type_url == ENDPOINTS_TYPE
        cla = pb.ClusterLoadAssignment.FromString(res.value)
        out[cla.cluster_name] = [(e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value,
                                  e.endpoint.hostname) for loc in cla.endpoints for e in loc.lb_endpoints]
        assert all(e.health_status == pb.HEALTHY for loc in cla.endpoints for e in loc.lb_endpoints)
    return out


class Stream:
    """One Envoy's stream; its answers read into a queue (a read given up on would cancel the call)."""

    def __init__(self, stub) -> None:
        self.call = stub.StreamAggregatedResources()
        self.answers: asyncio.Queue = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while (msg := await self.call.read()) is not grpc.aio.EOF:
            await self.answers.put(msg)
        await self.answers.put(grpc.aio.EOF)

    async def write(self, req: pb.DiscoveryRequest) -> None:
        await self.call.write(req)

    async def next(self, timeout: float = 2.0):
        return await asyncio.wait_for(self.answers.get(), timeout)

    def cancel(self) -> None:
        self.call.cancel()
        self._reader.cancel()


async def test_an_envoy_is_sent_the_workers_it_asks_for_and_each_change_after(ads):
    fleet, membership, _, stub = ads
    fleet.records = [record(0)]
    await membership.refresh()
    stream = Stream(stub)
    await stream.write(pb.DiscoveryRequest(node=pb.Node(id="ingress-0"), type_url=ENDPOINTS_TYPE,
                                           resource_names=[ALL_WORKERS]))
    first = await stream.next()
    assert endpoints_of(first) == {ALL_WORKERS: [("127.0.0.1", 20041, "worker-0")]}
    # Its ACK is not answered again.
    await stream.write(pb.DiscoveryRequest(type_url=ENDPOINTS_TYPE, resource_names=[ALL_WORKERS],
                                           version_info=first.version_info, response_nonce=first.nonce))
    with pytest.raises(asyncio.TimeoutError):
        await stream.next(0.3)
    # A worker joins: the Envoy is told without asking.
    fleet.records = [record(0), record(1)]
    assert await membership.refresh()
    joined = await stream.next()
    assert joined.version_info != first.version_info and joined.nonce != first.nonce
    assert [w for _, _, w in endpoints_of(joined)[ALL_WORKERS]] == ["worker-0", "worker-1"]
    # One leaves (its lease lapsed, or it deregistered).
    fleet.records = [record(1)]
    await membership.refresh()
    assert [w for _, _, w in endpoints_of(await stream.next())[ALL_WORKERS]] == ["worker-1"]
    stream.cancel()


async def test_a_name_control_does_not_know_yet_gets_no_endpoints_not_silence(ads):
    # An Envoy that starts before any worker registers warms its cluster at once, empty.
    fleet, membership, _, stub = ads
    await membership.refresh()
    stream = Stream(stub)
    await stream.write(pb.DiscoveryRequest(type_url=ENDPOINTS_TYPE, resource_names=[ALL_WORKERS, "elsewhere"]))
    assert endpoints_of(await stream.next()) == {ALL_WORKERS: [], "elsewhere": []}
    stream.cancel()


async def test_a_rejected_version_is_not_sent_again_and_other_types_get_nothing(ads, caplog):
    fleet, membership, _, stub = ads
    fleet.records = [record(0)]
    await membership.refresh()
    stream = Stream(stub)
    await stream.write(pb.DiscoveryRequest(type_url=ENDPOINTS_TYPE, resource_names=[ALL_WORKERS]))
    first = await stream.next()
    await stream.write(pb.DiscoveryRequest(type_url=ENDPOINTS_TYPE, resource_names=[ALL_WORKERS], version_info="",
                                           response_nonce=first.nonce, error_detail=pb.Status(code=3, message="bad")))
    await stream.write(pb.DiscoveryRequest(type_url="type.googleapis.com/envoy.config.cluster.v3.Cluster"))
    with pytest.raises(asyncio.TimeoutError):
        await stream.next(0.3)
    assert "rejected endpoints version" in caplog.text and "bad" in caplog.text
    # The next change is sent.
    fleet.records = [record(0), record(1)]
    await membership.refresh()
    assert len(endpoints_of(await stream.next())[ALL_WORKERS]) == 2
    stream.cancel()


async def test_control_stopping_ends_every_stream(ads):
    fleet, membership, discovery, stub = ads
    await membership.refresh()
    stream = Stream(stub)
    await stream.write(pb.DiscoveryRequest(type_url=ENDPOINTS_TYPE, resource_names=[ALL_WORKERS]))
    await stream.next()
    await discovery.close()
    assert await stream.next() is grpc.aio.EOF
    assert await stream.call.code() == grpc.StatusCode.OK
