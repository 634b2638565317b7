"""A model version's roll-out, as control runs it: the requests' figures over a sliding window
(figures.py), the SLO guard that compares the new version with the stable one (guard.py), and the
state machine that steps its weight up, rolls it back on a breach and records why (machine.py).
Pure: time and figures come in as arguments, so each is tested with a fake clock."""
