"""A session's turn at its end, for whoever streams it: the router on its own route, or the worker
the ingress sent the turn to straight (gaas.contracts.sessions has the model and the scripts)."""
