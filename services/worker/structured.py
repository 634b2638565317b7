"""How the worker's engine constrains output to a schema, regex, choice or grammar (vLLM's
structured outputs): the one place that picks the grammar backend and its options.

The backend is guidance (llguidance), not xgrammar. xgrammar 0.2.8 (vLLM 0.32's default) lets the
model write byte sequences that are not UTF-8 inside a string: UTF-16 surrogates (ED A0..BF xx) in
every string, and, in a pattern such as the one gaas.contracts.tools.for_engine gives a
length-bounded string, overlong forms too (E0 80..9F xx, F0 80..8F xx xx). Each counts as one
character to the grammar but decodes to three or four U+FFFD, so a `maxLength: 12` string came
back 14 characters long (about 1 answer in 200 of the tiny model at temperature 1). llguidance
matches UTF-8 exactly, in JSON strings, regexes and grammars alike, and keeps control characters
out of JSON strings.
"""

from __future__ import annotations

# vLLM's name for the grammar backend the worker's engine uses.
BACKEND = "guidance"


def structured_outputs_config():
    """vLLM's StructuredOutputsConfig for the worker's engine (an engine argument, not per request).

    JSON decodes without free whitespace: compact, and no model spends its tokens on blanks between
    the fields. An object schema that does not say whether other properties are allowed allows
    none (what xgrammar's strict mode did, and what a schema's author expects of decoding: a random
    or weak model otherwise writes extra keys until it runs out of tokens)."""
    from vllm.config import StructuredOutputsConfig

    return StructuredOutputsConfig(backend=BACKEND, disable_any_whitespace=True, disable_additional_properties=True)
