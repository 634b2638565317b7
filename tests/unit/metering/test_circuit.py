"""RedisCircuit: after a failure Redis is not asked for retry_seconds, then by one request at a
time until one succeeds; a success closes it at once."""

from gaas.metering.circuit import RedisCircuit
from tests.fakeclock import FakeClock


def test_a_closed_circuit_asks_redis_every_time():
    circuit = RedisCircuit(0.5, FakeClock())
    assert all(circuit.allows() for _ in range(3)) and not circuit.is_open


def test_after_a_failure_redis_is_not_asked_until_the_retry_time_then_by_one_request():
    clock = FakeClock()
    circuit = RedisCircuit(0.5, clock)
    assert circuit.allows()
    circuit.failed()
    assert circuit.is_open and not circuit.allows()
    clock.advance(0.49)
    assert not circuit.allows()
    clock.advance(0.01)
    assert circuit.allows(), "one request tries Redis again"
    assert not circuit.allows(), "the others keep to the fallback while it is out"
    circuit.failed()
    assert not circuit.allows()
    clock.advance(0.5)
    assert circuit.allows()
    circuit.succeeded()
    assert not circuit.is_open and circuit.allows() and circuit.allows()


def test_a_try_that_ended_without_an_answer_lets_another_request_try():
    clock = FakeClock()
    circuit = RedisCircuit(0.5, clock)
    circuit.failed()
    clock.advance(0.5)
    assert circuit.allows()
    circuit.abandoned()  # (its request was cancelled)
    assert circuit.allows()


def test_any_answer_of_redis_closes_the_circuit():
    circuit = RedisCircuit(0.5, FakeClock())
    circuit.failed()
    circuit.succeeded()  # (a usage event appended, say)
    assert circuit.allows() and not circuit.is_open
