"""A model's tokenizer and chat template, as vLLM applies them, without transformers.

The router tokenizes every prompt once (and answers /tokenize and /detokenize) with this; the
worker renders chat conversations with it too, so both sides agree token for token. It reads the
Hugging Face files of a model directory: tokenizer.json (run by the `tokenizers` library, which
is what transformers' fast tokenizers run) and the chat template (chat_template.jinja, or
tokenizer_config.json's "chat_template"), rendered in the same sandboxed Jinja environment that
transformers' apply_chat_template builds. About 30 MB resident, against ~400 MB for transformers
(which imports torch).
"""

from __future__ import annotations

import json
import threading
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from gaas.contracts import errors, jsonbody

log = logging.getLogger(__name__)

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TokenizerError(errors.InvalidArgument):
    """The prompt cannot be tokenized as asked (the chat template refused it, ...)."""


def _special_tokens(config: dict) -> dict[str, str]:
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):  # {"content": "<s>", ...} in older files
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class GenerationTag(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %} (transformers marks assistant spans with it): a no-op."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    # An assistant's calls: (id, function name, arguments as JSON text).
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    # A tool's message: the call it answers, and the function's name.
    tool_call_id: str = ""
    name: str = ""

    @classmethod
    def of(cls, m) -> "ChatMessage":
        """From a gaas.v1 ChatMessage (or anything with its fields)."""
        calls = tuple((c.id, c.name, c.arguments) for c in m.tool_calls)
        return cls(m.role, m.content, calls, m.tool_call_id, m.name)

    def as_template_dict(self) -> dict:
        """The message as chat templates read it (transformers' conventions: a call's arguments as
        an object when they are one)."""
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": _arguments(args)}}
                                 for cid, name, args in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


def _arguments(text: str):
    try:
        # (a client's text, held to a body's limits before the template walks it)
        value = jsonbody.loads(text, "arguments")
    except errors.InvalidArgument:
        return text
    return value if isinstance(value, dict) else text


def template_tools(tools) -> list[dict] | None:
    """A request's tools (gaas.v1 Tool) as chat templates read them (None: none)."""
    if not tools:
        return None
    out = []
    for t in tools:
        fn: dict = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        fn["parameters"] = json.loads(t.parameters) if t.parameters else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


@dataclass(slots=True)
class PromptPrefix:
    """The token ids of a prompt's beginning, kept to tokenize a longer prompt that starts with it
    (a session's next turn) without tokenizing that part again. It ends just after a special token:
    the tokenizer splits on those before anything else, so nothing merges across one and the ids
    of the beginning plus those of the rest are the ids of the whole (checked once per tokenizer)."""

    text: str = ""
    ids: list[int] = field(default_factory=list)


class Tokenizer:
    """One model's tokenizer. Thread-safe (the router tokenizes long prompts off its event loop)."""

    def __init__(self, backend, chat_template: str | None, special_tokens: dict[str, str]) -> None:
        self._tok = backend
        self._template = _compile(chat_template) if chat_template else None
        self.special_tokens = special_tokens
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        # Whether tokenizing at a special token gives the ids of the whole (None: not checked yet).
        self._splits_cleanly: bool | None = None

    @classmethod
    def load(cls, model_dir: str | Path) -> "Tokenizer":
        """The tokenizer of a Hugging Face model directory; FileNotFoundError names what is missing."""
        from tokenizers import Tokenizer as Backend

        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: the model directory has no fast tokenizer")
        config_path = d / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = None
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        return cls(Backend.from_file(str(path)), template, _special_tokens(config))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_continuing(self, text: str, prefix: PromptPrefix) -> list[int]:
        """encode(text, add_special_tokens=False), reusing prefix's ids when text begins with it;
        prefix then holds text up to its last special token, for the next, longer prompt."""
        start, head = 0, prefix.ids
        if prefix.text and self._splits_cleanly is not False and text.startswith(prefix.text):
            start = len(prefix.text)
        enc = self._tok.encode(text[start:], add_special_tokens=False)
        ids = (head + enc.ids) if start else enc.ids
        if start and self._splits_cleanly is None:
            self._splits_cleanly = ids == self.encode(text, False)
            if not self._splits_cleanly:
                log.warning("this tokenizer does not split cleanly at special tokens: session prompts are tokenized "
                            "whole every turn")
                return self.encode(text, False)
        for j in range(len(enc.ids) - 1, -1, -1):
            if enc.ids[j] in self._special_ids:
                prefix.text = text[: start + enc.offsets[j][1]]
                prefix.ids = ids[: (len(head) if start else 0) + j + 1]
                break
        return ids

    def continued_chars(self, text: str, prefix: PromptPrefix) -> int:
        """Characters of text that encode_continuing would tokenize anew."""
        return len(text) - len(prefix.text) if prefix.text and text.startswith(prefix.text) else len(text)

    def render_chat(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> str:
        """The conversation as the chat template writes it (transformers' apply_chat_template,
        tokenize=False); tools: the functions the model may call (template_tools)."""
        if self._template is None:
            raise TokenizerError("this model has no chat template: use /v1/completions with a prompt instead")
        if continue_final_message and add_generation_prompt:
            raise TokenizerError("set at most one of continue_final_message and add_generation_prompt")
        chat = [m.as_template_dict() for m in messages]
        final = ""
        if continue_final_message:
            if not chat:
                raise TokenizerError("continue_final_message needs a final message to continue")
            final = chat[-1]["content"]
            chat[-1]["content"] = final + _CONTINUE_TAG
        import jinja2

        try:
            text = self._template.render(
                messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"the model's chat template refused the messages: {errors.cap(str(exc), 200)}") from None
        if continue_final_message:
            at = text.rfind(_CONTINUE_TAG.strip())
            if at < 0 or final.strip() not in text:
                raise TokenizerError("continue_final_message: the chat template drops the final message's text")
            text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text

    def encode_chat(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, continue_final_message: bool = False,
        add_special_tokens: bool = False, tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation (the template adds BOS; vLLM's default adds nothing more)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, continue_final_message, tools),
                           add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


class TokenizerCache:
    """Tokenizers by model directory, loaded once on first use."""

    def __init__(self) -> None:
        self._loaded: dict[str, Tokenizer] = {}
        self._lock = threading.Lock()

    def get(self, model_dir: str) -> Tokenizer:
        tok = self._loaded.get(model_dir)
        if tok is None:
            with self._lock:
                tok = self._loaded.get(model_dir)
                if tok is None:
                    tok = self._loaded[model_dir] = Tokenizer.load(model_dir)
        return tok
