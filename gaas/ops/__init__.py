"""The operator's model of a mesh: its topology, its CA, Redis's users, probes, traces."""
