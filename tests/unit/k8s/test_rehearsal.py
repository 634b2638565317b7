"""The rehearsal's reading of the manifests (gaas/k8s/rehearsal.py): Kubernetes' $(VAR) expansion."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gaas.k8s.rehearsal import expand


def test_a_variable_defined_before_is_expanded_and_an_unknown_one_left_as_written():
    env = {"POD_IP": "10.0.0.7", "POD_NAME": "w-1"}
    assert expand("$(POD_IP):9001", env) == "10.0.0.7:9001"
    assert expand("$(NOPE)/x", env) == "$(NOPE)/x"
    assert expand("$$(POD_IP)", env) == "$(POD_IP)"


@given(st.text(alphabet=st.characters(blacklist_characters="$"), max_size=40))
def test_text_without_a_reference_is_left_alone(text):
    assert expand(text, {"A": "b"}) == text
