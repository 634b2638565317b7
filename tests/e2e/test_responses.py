"""OpenAI's Responses API at the ingress, with the official `openai` client unmodified: plain,
streamed (events in OpenAI's order), continued with previous_response_id, stored per tenant (never
another's), structured and with function calls. Uses the shared mesh of the session."""

from __future__ import annotations

from functools import partial
import json

import openai
import pydantic
import pytest

from tests.meshutil import gaas, openai_client
from tests.waiting import eventually

pytestmark = pytest.mark.mesh

MODEL = "gaas-tiny"


client = partial(openai_client, timeout=120)


@pytest.fixture(scope="module")
def other_key(mesh):
    r = gaas(mesh, "tenant", "create", "resp-other", "--tier", "silver", "--json")
    assert r.returncode == 0 or "already exists" in r.stderr, r.stderr
    r = gaas(mesh, "key", "create", "resp-other", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["api_key"]


def test_create_retrieve_continue_and_delete(mesh):
    c = client(mesh)
    first = c.responses.create(model=MODEL, input="Tell me a story", instructions="Be brief.", max_output_tokens=8,
                               extra_body={"temperature": 0})
    assert first.object == "response" and first.id.startswith("resp_") and first.model == MODEL
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.output_text and first.usage.output_tokens == 8
    assert first.usage.total_tokens == first.usage.input_tokens + 8
    assert c.responses.retrieve(first.id).output_text == first.output_text
    # The next one continues the stored conversation: its prompt holds the first's input and output.
    second = c.responses.create(model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + 8
    items = c.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "And then?"
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"


def test_streamed_events_in_openais_order(mesh):
    with client(mesh).responses.stream(model=MODEL, input="Stream me", max_output_tokens=5, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert final.usage.output_tokens == 5 and final.output_text


def test_a_stored_response_is_its_tenants_alone(mesh, other_key):
    mine = client(mesh).responses.create(model=MODEL, input="secret", max_output_tokens=3)
    theirs = client(mesh, other_key)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.create(model=MODEL, input="x", previous_response_id=mine.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(mine.id)
    assert client(mesh).responses.retrieve(mine.id).id == mine.id
    unstored = client(mesh).responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client(mesh).responses.retrieve(unstored.id)


class Answer(pydantic.BaseModel):
    ok: bool
    n: int = pydantic.Field(ge=0, le=9)


def test_structured_and_function_calls(mesh):
    c = client(mesh)
    parsed = c.responses.parse(model=MODEL, input="json please", text_format=Answer, max_output_tokens=50)
    assert isinstance(parsed.output_parsed, Answer)
    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}}}
    r = c.responses.create(model=MODEL, input="weather?", tools=[tool], max_output_tokens=60,
                           tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments)["unit"] in "cf"
    # The function's result sent back as an item continues the conversation.
    after = c.responses.create(model=MODEL, previous_response_id=r.id, tools=[tool], max_output_tokens=4, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}])
    assert after.status in ("completed", "incomplete") and after.usage.input_tokens > r.usage.input_tokens


def test_bad_requests_are_400s(mesh):
    c = client(mesh)
    for kwargs, message in [
        (dict(input=[{"type": "image", "url": "x"}]), "not supported"),
        (dict(input="x", tools=[{"type": "web_search"}]), "must be \"function\""),
        (dict(input="x", background=True, store=False), "needs \"store\": true"),
        (dict(input=[]), "'input' is required"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model=MODEL, max_output_tokens=2, **kwargs)
        assert message in err.value.message, (kwargs, err.value.message)
    r = c.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(r.id)


def test_background_response_runs_after_the_answer_and_can_be_cancelled(mesh):
    import time

    c = client(mesh)
    r = c.responses.create(model=MODEL, input="Count slowly", max_output_tokens=6, background=True, temperature=0)
    assert r.status in ("queued", "in_progress") and r.background
    got = eventually(lambda: (x := c.responses.retrieve(r.id)).status not in ("queued", "in_progress") and x, 60,
                     what="the background response finished")
    assert got.status in ("completed", "incomplete") and got.usage.output_tokens <= 6 and got.output_text
    # A long one, cancelled while it runs: it stops, stays cancelled, and keeps what it had made.
    long = c.responses.create(model=MODEL, input="Go on and on", max_output_tokens=1800, background=True)
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(2.5)
    assert c.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(r.id)  # (finished: nothing to cancel)
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=MODEL, input="x", background=True, stream=True, max_output_tokens=2)
    assert "background" in err.value.message
