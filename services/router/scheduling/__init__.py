"""The router's scheduler, in the shape of the Gateway API Inference Extension's: filters, weighted
scorers clamped to [0, 1], and a picker, one plugin per file, assembled into named profiles
(round_robin, least_load, kv_aware). The directory lookup happens once, before scheduling; the
scheduling itself is pure and synchronous."""

from services.router.scheduling.profiles import PROFILES, make_scheduler
from services.router.scheduling.scheduler import Decision, Scheduler
from services.router.scheduling.types import Candidate, Load, RequestContext, WorkerId

__all__ = ["PROFILES", "Candidate", "Decision", "Load", "RequestContext", "Scheduler", "WorkerId", "make_scheduler"]
