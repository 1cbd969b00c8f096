"""ColossalAI's ``colossalai.global_variables``: ``moe_env``, the job's MoE environment."""

from colossal.legacy.context.moe_context import MoeContext, moe_env

__all__ = ["MoeContext", "moe_env"]
