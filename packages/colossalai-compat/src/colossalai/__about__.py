"""Version of colossalai-compat (the ``colossalai`` import name it ships)."""

__version__ = "0.1.0"
