"""What processes agree on: ids, tiers, errors, usage events, limits, the rules of a request. Pure: no I/O."""
