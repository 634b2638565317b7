"""The metering contract: prices and what a request costs, the usage event's wire form, months
and the time bounds a usage query accepts."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gaas.contracts import errors, pricing, usage as metering
from gaas.contracts.usage import UsageEvent

prices = st.builds(
    pricing.Price,
    input=st.floats(0, 100, allow_nan=False), cached_input=st.floats(0, 100, allow_nan=False),
    output=st.floats(0, 100, allow_nan=False),
)


def event(**kw) -> UsageEvent:
    base = dict(request_id="r1", tenant="acme", key_id="key_1", tier="gold", model="m", model_version="1",
                prompt_tokens=10, cached_tokens=4, completion_tokens=5, cost_input_micros=36, cost_cached_micros=1,
                cost_output_micros=100, outcome="finished", worker="worker-0", finished_ms=1_764_000_000_000)
    return UsageEvent(**{**base, **kw})


@given(prices, st.integers(0, 200_000), st.integers(0, 200_000), st.integers(0, 100_000), st.data())
def test_a_request_never_costs_more_than_its_estimate(price, prompt, cached, max_tokens, data):
    completion = data.draw(st.integers(0, max_tokens))
    assert pricing.cost_micros(price, prompt, cached, completion) <= pricing.estimate_micros(price, prompt, max_tokens)


@given(prices, st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6))
def test_cost_parts_price_each_kind_of_token_per_million(price, prompt, cached, completion):
    c_in, c_cached, c_out = pricing.cost_parts(price, prompt, cached, completion)
    hit = min(cached, prompt)
    assert math.isclose(c_in, (prompt - hit) * price.input, abs_tol=0.5 + 1e-6)
    assert math.isclose(c_cached, hit * price.cached_input, abs_tol=0.5 + 1e-6)
    assert math.isclose(c_out, completion * price.output, abs_tol=0.5 + 1e-6)


def test_a_models_own_price_wins_over_the_tiers_default():
    table = pricing.parse_table({"gold": {"*": {"input": 1, "output": 2}, "big": {"input": 5, "output": 9}}})
    assert pricing.price_for(table, "gold", "big") == pricing.Price(5, 0, 9)
    assert pricing.price_for(table, "gold", "small") == pricing.Price(1, 0, 2)
    assert pricing.price_for(table, "bronze", "small") == pricing.FREE


@pytest.mark.parametrize("doc, message", [
    ({"platinum": {}}, "unknown tier 'platinum'"),
    ({"gold": {"*": {"input": -1}}}, "cannot be negative"),
    ({"gold": {"*": {"inputs": 1}}}, "{input, cached_input, output}"),
    ({"gold": {"*": {"input": "cheap"}}}, "must be numbers"),
    ([], "must map tiers"),
])
def test_a_malformed_price_table_is_refused_naming_the_entry(doc, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        pricing.parse_table(doc)


names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@given(st.builds(
    event, request_id=names.filter(bool), tenant=names, key_id=names, model=names, worker=names,
    client_request_id=names, prompt_tokens=st.integers(0, 10**7), cached_tokens=st.integers(0, 10**7),
    completion_tokens=st.integers(0, 10**7), outcome=st.sampled_from(metering.OUTCOMES),
    ttft_ms=st.floats(0, 1e6, allow_nan=False), finished_ms=st.integers(0, 2**42),
))
def test_a_usage_event_reads_back_as_written(e):
    raw = {k.encode(): v.encode() for k, v in e.to_fields().items()}  # as a stream entry comes back
    assert UsageEvent.from_fields(raw) == e
    assert e.cost_micros == e.cost_input_micros + e.cost_cached_micros + e.cost_output_micros


@pytest.mark.parametrize("change", [
    {"outcome": "exploded"}, {"prompt_tokens": -1}, {"completion_tokens": "many"}, {"tenant": None},
    {"cached_tokens": 1.5}, {"tenant": 7},
])
def test_an_event_that_is_not_a_usage_event_is_refused(change):
    values = json.loads(event().to_fields()["event"])
    for k, v in change.items():
        if v is None:
            del values[k]
        else:
            values[k] = v
    with pytest.raises(ValueError):
        UsageEvent.from_fields({"v": "1", "event": json.dumps(values)})


@pytest.mark.parametrize("raw", [{}, {"event": "{not json"}, {"event": "[1, 2]"}, {b"request_id": b"r1"}])
def test_a_stream_entry_that_is_not_an_event_is_refused(raw):
    with pytest.raises(ValueError):
        UsageEvent.from_fields(raw)


def test_months_are_utc_and_bound_their_milliseconds():
    assert metering.month_of(1_764_547_199_999) == "202511"  # 2025-11-30T23:59:59.999Z
    assert metering.month_of(1_764_547_200_000) == "202512"
    start, end = metering.month_bounds("202512")
    assert (start, metering.month_of(end - 1), metering.month_of(end)) == (1_764_547_200_000, "202512", "202601")


@pytest.mark.parametrize("text, expected", [
    ("", 0),
    ("2026-11-01", 1_793_491_200_000),
    ("2026-11-01T12:00:00Z", 1_793_534_400_000),
    ("2026-11-01T13:00:00+01:00", 1_793_534_400_000),
    ("1793491200", 1_793_491_200_000),
    ("7d", 1_800_000_000_000 - 7 * 86_400_000),
    ("30m", 1_800_000_000_000 - 1_800_000),
])
def test_usage_times_read_as_dates_unix_seconds_or_durations_back(text, expected):
    assert metering.parse_time(text, "since", now=1_800_000_000_000) == expected


@pytest.mark.parametrize("text", ["yesterday", "7 days", "2026-13-01", "-5d", "²", "²d", "१२", "７d",
                                  "9" * 30, "9" * 30 + "d"])
def test_a_time_that_means_nothing_is_an_invalid_argument_naming_the_parameter(text):
    with pytest.raises(errors.InvalidArgument) as info:
        metering.parse_time(text, "since")
    assert info.value.param == "since" and "ISO 8601" in info.value.message
