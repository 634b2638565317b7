"""How long a router may hold a request before it is placed while the ingress waits on its decision
(the direct path's external processing, services/router/extproc.py). The ingress's Envoy (1.40)
crashes when a decision answers after about 45 s of waiting (reproduced: a request that waited 50 s
in a router took the ingress down with it; 40 s did not), so while deciding for the ingress a router
holds a request at most DECISION_HOLD_S in its queue, and a request for a model whose pool is
scaling up from zero is passed on to the router's own route, where it waits as long as its tier allows."""

from __future__ import annotations

import contextvars

DECISION_HOLD_S = 30.0

# Set while this router decides for the ingress (the task of one decision call).
deciding_for_ingress: contextvars.ContextVar[bool] = contextvars.ContextVar("deciding_for_ingress", default=False)
