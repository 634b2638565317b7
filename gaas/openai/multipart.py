"""A multipart/form-data upload (the openai client's files.create), read with python-multipart's
streaming parser (the one Starlette uses): its "file" part and its "purpose" field, nothing else
kept. The work is bounded by the body's size and a cap on its parts and their headers, so no
body can cost more than one pass over its bytes. Pure, no I/O; failures are InvalidArgument.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from gaas.contracts.errors import InvalidArgument, quote

# The parser logs each fault of a body at WARNING: a client's malformed uploads must not fill the logs.
logging.getLogger("python_multipart").setLevel(logging.ERROR)

# Files are kept for this purpose only.
PURPOSES = ("batch",)
MAX_FILENAME = 255
# An upload is a "file" and a "purpose"; a client may add a few fields of its own.
MAX_PARTS = 16
# Per part: its headers (Content-Disposition, Content-Type) and the purpose field's length.
MAX_HEADERS = 8
MAX_HEADER_BYTES = 4096
MAX_FIELD_BYTES = 256


@dataclass(frozen=True, slots=True)
class Upload:
    filename: str
    purpose: str
    data: bytes


class _Reader:
    """The parser's callbacks: each part's name and filename from its Content-Disposition, the
    bytes of the "file" and "purpose" parts (other parts' bytes are skipped as they come)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.parts = 0
        self.file: bytearray | None = None
        self.filename = ""
        self.purpose: bytearray | None = None
        self._field = bytearray()
        self._value = bytearray()
        self._disposition = b""
        self._into: bytearray | None = None
        self._limit = 0

    def callbacks(self) -> dict:
        return {"on_part_begin": self.part_begin, "on_header_field": self.header_field,
                "on_header_value": self.header_value, "on_header_end": self.header_end,
                "on_headers_finished": self.headers_finished, "on_part_data": self.part_data}

    def part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise InvalidArgument(f"the upload has more than {MAX_PARTS} parts; send the 'file' part and the "
                                  "'purpose' field", param="file")
        self._disposition = b""
        self._into = None

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def header_end(self) -> None:
        if self._field.strip().lower() == b"content-disposition":
            self._disposition = bytes(self._value)
        self._field.clear()
        self._value.clear()

    def headers_finished(self) -> None:
        _, params = parse_options_header(self._disposition)
        name = params.get(b"name")
        if name == b"file":
            self.file = self._into = bytearray()
            self._limit = self.max_bytes
            self.filename = params.get(b"filename", b"").decode("utf-8", "replace")
        elif name == b"purpose":
            self.purpose = self._into = bytearray()
            self._limit = MAX_FIELD_BYTES

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self._into is None:
            return
        if len(self._into) + end - start > self._limit:
            if self._into is self.file:
                raise InvalidArgument(f"the file is over {self.max_bytes} bytes, the most a batch input file can be",
                                      param="file", reason="file_too_large")
            raise InvalidArgument(f"the 'purpose' field is over {MAX_FIELD_BYTES} bytes: set it to \"batch\"",
                                  param="purpose")
        self._into += data[start:end]


def parse_upload(content_type: str, body: bytes, max_bytes: int) -> Upload:
    """The upload's "file" part (at most max_bytes) and its "purpose" field."""
    ctype, params = parse_options_header((content_type or "").encode("latin-1", "replace"))
    if ctype != b"multipart/form-data":
        raise InvalidArgument("upload the file as multipart/form-data, with a 'file' part and a 'purpose' field "
                              f"(got content type {quote(content_type or 'none')})", param="file")
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidArgument("the multipart/form-data content type has no boundary", param="file")
    reader = _Reader(max_bytes)
    try:
        parser = MultipartParser(boundary, reader.callbacks(), max_header_count=MAX_HEADERS,
                                 max_header_size=MAX_HEADER_BYTES)
        parser.write(body)
        parser.finalize()
    except (MultipartParseError, ValueError) as exc:
        raise InvalidArgument(f"the upload's multipart body cannot be read ({exc})", param="file") from None
    return _upload(reader, max_bytes)


def _upload(reader: _Reader, max_bytes: int) -> Upload:
    if reader.file is None:
        raise InvalidArgument("the upload has no 'file' part", param="file")
    if reader.purpose is None:
        raise InvalidArgument("the upload has no 'purpose' field: set it to \"batch\"", param="purpose")
    purpose = reader.purpose.decode("utf-8", "replace").strip()
    if purpose not in PURPOSES:
        raise InvalidArgument(f"purpose {quote(purpose)} is not kept here: GaaS keeps files for batches "
                              "(purpose \"batch\")", param="purpose")
    if not reader.file:
        raise InvalidArgument("the uploaded file is empty", param="file")
    filename = "".join(c for c in reader.filename[:MAX_FILENAME] if c.isprintable())
    return Upload(filename or "upload.jsonl", purpose, bytes(reader.file))
