"""Envoy configs for the ingress and every sidecar, from the topology."""
