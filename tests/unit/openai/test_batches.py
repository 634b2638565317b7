"""The Files and Batch APIs' wire formats: multipart uploads as the openai client sends them, a
batch input file's lines (each error naming its line), the create body, the deployment file's
batches section; open-ended input only ever raises InvalidArgument or yields errors."""

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gaas.contracts import batches as terms
from gaas.contracts.errors import InvalidArgument
from gaas.openai import batches as wire, multipart as uploads

CHAT = "/v1/chat/completions"


def line(custom_id="a", url=CHAT, method="POST", body=None, **extra):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": body if body is not None else {"model": "m", "messages": []}, **extra})


def multipart(files: dict, data: dict) -> tuple[str, bytes]:
    """What httpx (the openai client's transport) sends for files.create."""
    request = httpx.Request("POST", "http://x/v1/files", files=files, data=data)
    return request.headers["content-type"], request.read()


def test_an_upload_as_the_openai_client_sends_it():
    ct, body = multipart({"file": ("in.jsonl", b"{}\n", "application/jsonl")}, {"purpose": "batch"})
    up = uploads.parse_upload(ct, body, 1000)
    assert (up.filename, up.purpose, up.data) == ("in.jsonl", "batch", b"{}\n")


@pytest.mark.parametrize("files, data, param", [
    ({"file": ("a", b"x")}, {}, "purpose"),
    ({"file": ("a", b"x")}, {"purpose": "fine-tune"}, "purpose"),
    ({"other": ("a", b"x")}, {"purpose": "batch"}, "file"),
    ({"file": ("a", b"")}, {"purpose": "batch"}, "file"),
    ({"file": ("a", b"x" * 11)}, {"purpose": "batch"}, "file"),
])
def test_an_upload_missing_what_it_needs_names_the_field(files, data, param):
    ct, body = multipart(files, data)
    with pytest.raises(InvalidArgument) as err:
        uploads.parse_upload(ct, body, 10)
    assert err.value.param == param


def many_parts(count: int) -> tuple[str, bytes]:
    """An upload of count tiny fields, then its file: the body that stalled a router's event loop
    in the standard library's email parser."""
    part = b'--b\r\nContent-Disposition: form-data; name="x"\r\n\r\ny\r\n'
    tail = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n{}\r\n--b--\r\n')
    return "multipart/form-data; boundary=b", part * count + tail


def test_an_upload_of_many_parts_is_refused_at_the_cap_naming_it():
    ct, body = many_parts(82_000)
    with pytest.raises(InvalidArgument, match=f"more than {uploads.MAX_PARTS} parts") as err:
        uploads.parse_upload(ct, body, terms.MAX_UPLOAD_BYTES)
    assert err.value.param == "file"
    ct, body = many_parts(uploads.MAX_PARTS - 2)
    assert uploads.parse_upload(ct, body, 100).data == b"{}"


def test_an_upload_keeps_only_its_file_and_purpose_and_bounds_each():
    ct, body = multipart({"file": ("in.jsonl", b"x" * 10)}, {"purpose": "batch", "note": "n" * 10_000})
    assert uploads.parse_upload(ct, body, 10).data == b"x" * 10
    ct, body = multipart({"file": ("in.jsonl", b"x")}, {"purpose": "b" * 1000})
    with pytest.raises(InvalidArgument) as err:
        uploads.parse_upload(ct, body, 10)
    assert err.value.param == "purpose"
    ct, body = multipart({"file": ("in.jsonl", b"x" * 11)}, {"purpose": "batch"})
    with pytest.raises(InvalidArgument) as err:
        uploads.parse_upload(ct, body, 10)
    assert err.value.reason == "file_too_large"


def test_a_body_that_is_not_multipart_is_refused():
    with pytest.raises(InvalidArgument, match="multipart/form-data"):
        uploads.parse_upload("application/json", b"{}", 10)
    with pytest.raises(InvalidArgument, match="boundary"):
        uploads.parse_upload("multipart/form-data", b"{}", 10)


def test_lines_become_requests_and_bad_lines_errors_naming_them():
    data = "\n".join([line("a"), "", line("b"), "[1]", line("a"), line("c", method="GET"), line("d", url="/v1/x"),
                      line("e", body={"messages": []}), line("f", body={"model": "m", "stream": True}),
                      line("g", extra=1)]).encode()
    items, errors = wire.parse_lines(data, CHAT, 100)
    assert [i.custom_id for i in items] == ["a", "b"]
    assert [(e.line, e.code) for e in errors] == [
        (4, "invalid_json_line"), (5, "duplicate_custom_id"), (6, "invalid_method"), (7, "mismatched_endpoint"),
        (8, "missing_required_parameter"), (9, "invalid_request"), (10, "invalid_request")]


def test_an_empty_file_or_too_many_requests_is_one_error():
    assert wire.parse_lines(b"\n\n", CHAT, 10)[1][0].code == "empty_file"
    data = "\n".join(line(str(i)) for i in range(11)).encode()
    items, errors = wire.parse_lines(data, CHAT, 10)
    assert items == [] and errors[0].code == "too_many_requests"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.lists(st.dictionaries(
    st.sampled_from(["custom_id", "method", "url", "body", "x"]),
    st.none() | st.integers() | st.text(max_size=5) | st.sampled_from(["POST", CHAT]) |
    st.dictionaries(st.sampled_from(["model", "stream"]), st.text(max_size=3) | st.booleans())),
    max_size=5).map(lambda docs: "\n".join(json.dumps(d) for d in docs).encode()))
def test_any_file_gives_requests_or_errors_never_an_exception(data):
    items, errors = wire.parse_lines(data, CHAT, 1000)
    assert items or errors
    assert len({i.custom_id for i in items}) == len(items)
    for i in items:
        assert isinstance(json.loads(i.body)["model"], str)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60) | st.just("multipart/form-data; boundary=b"),
       st.binary(max_size=200) | st.lists(st.sampled_from([
           b"--b\r\n", b"--b--\r\n", b"\r\n", b'Content-Disposition: form-data; name="file"; filename="a"\r\n',
           b'Content-Disposition: form-data; name="purpose"\r\n', b"batch", b"{}", b"X: y\r\n"]),
           max_size=30).map(b"".join))
def test_any_upload_parses_or_is_invalid_argument(content_type, body):
    try:
        uploads.parse_upload(content_type, body, 100)
    except InvalidArgument:
        pass


def test_the_create_body_is_checked_field_by_field():
    ok = wire.parse_create({"input_file_id": "file-1", "endpoint": CHAT, "completion_window": "24h",
                            "metadata": {"k": "v"}})
    assert (ok.input_file_id, ok.endpoint, ok.metadata) == ("file-1", CHAT, {"k": "v"})
    for body, param in [({"endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
                        ({"input_file_id": "f", "endpoint": "/v1/moderations", "completion_window": "24h"}, "endpoint"),
                        ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "1h"}, "completion_window"),
                        ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h", "metadata": {"k": 1}},
                         "metadata"),
                        ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h", "x": 1}, "x")]:
        with pytest.raises(InvalidArgument) as err:
            wire.parse_create(body)
        assert err.value.param == param


def test_the_deployment_files_batches_section():
    p = terms.parse_policy({"price_factor": {"gold": 0.8}, "max_items": 10})
    assert p.factor("gold") == 0.8 and p.factor("bronze") == 0.5 and p.max_items == 10
    for doc in ({"price_factor": {"platinum": 1}}, {"price_factor": {"gold": 2}}, {"max_items": 0},
                {"max_file_bytes": terms.MAX_UPLOAD_BYTES + 1}, {"other": 1}, [1]):
        with pytest.raises(ValueError):
            terms.parse_policy(doc)
