"""Version of colossal-pipeline (read by hatchling)."""

__version__ = "0.1.0"
