"""Workers whose engine's context holds the prompt and the tokens to generate."""

from services.router.scheduling.registry import plugin
from services.router.scheduling.types import Candidate, Filter, RequestContext


@plugin("filter")
class ContextFitFilter(Filter):
    name = "context_fit"

    def keep(self, ctx: RequestContext, c: Candidate) -> bool:
        return not c.max_model_len or ctx.prompt_tokens + ctx.max_tokens <= c.max_model_len

    def why(self, ctx: RequestContext) -> str:
        return (f"no worker's context holds {ctx.prompt_tokens} prompt + {ctx.max_tokens} completion tokens; "
                "shorten the prompt or lower max_tokens")
