"""Version of colossal-integrations."""

__version__ = "0.1.0"
