"""Version of colossal-zero."""

__version__ = "0.1.0"
