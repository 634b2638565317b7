"""The `gaas` command."""
