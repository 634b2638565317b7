"""A generation's finish reason, one mapping for every process (gaas.contracts.finish): every wire value
has one name, the engine's words map onto them, and the OpenAI API sees a reason only on a last chunk."""

import pytest

from gaas.contracts import finish
from gaas.v1 import common_pb2


@pytest.mark.parametrize("value", common_pb2.FinishReason.values())
def test_every_wire_value_is_labelled_by_its_enum_name(value):
    assert finish.label(value) == common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def test_the_wire_and_our_reasons_map_both_ways():
    assert set(finish.TO_PB) == {finish.STOP, finish.LENGTH, finish.ABORT, finish.ERROR}
    assert set(finish.FROM_PB) == set(common_pb2.FinishReason.values()) - {common_pb2.FINISH_REASON_UNSPECIFIED}
    for reason, value in finish.TO_PB.items():
        assert finish.FROM_PB[value] == reason == finish.openai(value)


def test_the_openai_api_sees_no_reason_until_the_last_chunk():
    assert finish.openai(common_pb2.FINISH_REASON_UNSPECIFIED) is None
    assert finish.label(common_pb2.FINISH_REASON_UNSPECIFIED) == "unspecified"


@pytest.mark.parametrize("engine, ours", [
    (None, None), ("stop", "stop"), ("length", "length"), ("abort", "abort"), ("error", "error"),
    ("something new", "error"),
])
def test_the_engines_reasons_become_ours_and_an_unknown_one_is_an_error(engine, ours):
    assert finish.from_engine(engine) == ours
