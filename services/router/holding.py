"""How long a router may hold a request before it is placed while the ingress waits on its decision
(the direct path's external processing, services/router/extproc.py). The ingress's Envoy (1.40)
crashes when a decision answers after about 45 s of waiting, so a request placed for the ingress
(Placer.place_direct) waits at most DECISION_HOLD_S in the router's queue, and one prepared for it
(Preparer.prepare(for_ingress=True)) for a model whose pool is scaling up from zero is passed on to
the router's own route, where it waits as long as its tier allows."""

DECISION_HOLD_S = 30.0
