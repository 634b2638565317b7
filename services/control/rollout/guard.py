"""The SLO guard: is the new version as good as the stable one over the window? Three figures,
each judged only on enough requests (gaas.contracts.rollout.GuardPolicy says how many, and how
much worse the new version may be):

- TTFT p95 per tier: a breach when the new version's p95 passes the tier's target and is worse than
  the stable version's by more than the tolerance (when both miss the target alike, the load is to
  blame, not the version; when the stable one took too few of the tier to compare, the target
  alone judges).
- Error rate: a breach when the new version's passes the stable one's by more than the margin.
- Tokens per second of decoding: a breach when the new version's falls below the stable one's by
  more than the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

from gaas.contracts.rollout import GuardPolicy
from services.control.rollout.figures import Figures

__all__ = ["GuardPolicy", "Verdict", "judge"]


@dataclass(frozen=True, slots=True)
class Verdict:
    # A breach's reason ("" when none), and whether every figure had enough requests to judge.
    breach: str = ""
    judged: bool = False

    @property
    def healthy(self) -> bool:
        """Judged on enough requests, and no breach."""
        return self.judged and not self.breach


def judge(policy: GuardPolicy, new: Figures, stable: Figures | None, version: str = "the new version") -> Verdict:
    """new's figures against stable's (None: no stable version takes requests, e.g. after a
    blue-green switch; the targets alone judge)."""
    judged = True
    for tier, (p95, n) in sorted(new.ttft_p95.items()):
        target = policy.ttft_targets_ms.get(tier)
        if target is None:
            continue
        if n < policy.min_ttft_samples:
            judged = False
            continue
        if p95 <= target:
            continue
        base = stable.ttft_p95.get(tier) if stable else None
        if base and base[1] >= policy.min_ttft_samples:
            if p95 <= base[0] * (1 + policy.ttft_tolerance):
                continue  # the stable version is as slow: the load, not the version
            return Verdict(f"{version}'s TTFT p95 for {tier} is {p95:.0f} ms over {n} requests, past the tier's "
                           f"{target:.0f} ms target (the stable version's: {base[0]:.0f} ms)", judged=True)
        return Verdict(f"{version}'s TTFT p95 for {tier} is {p95:.0f} ms over {n} requests, past the tier's "
                       f"{target:.0f} ms target", judged=True)
    if not new.ttft_p95:
        judged = False
    if new.requests < policy.min_requests:
        return Verdict(judged=False)
    base_errors = stable.error_rate if stable and stable.requests >= policy.min_requests else 0.0
    if new.error_rate > base_errors + policy.error_margin:
        return Verdict(f"{version}'s error rate is {new.error_rate:.1%} over {new.requests} requests "
                       f"(the stable version's: {base_errors:.1%})", judged=True)
    if stable and stable.requests >= policy.min_requests and stable.tokens_per_s and new.tokens_per_s:
        floor = stable.tokens_per_s * (1 - policy.throughput_tolerance)
        if new.tokens_per_s < floor:
            return Verdict(f"{version} decodes {new.tokens_per_s:.0f} tokens/s, below the stable version's "
                           f"{stable.tokens_per_s:.0f}", judged=True)
    return Verdict(judged=judged)
