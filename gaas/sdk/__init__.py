"""Clients of a running mesh: streaming generation, and the operator's calls."""
