"""The machine under a service: its devices and where each process computes."""
