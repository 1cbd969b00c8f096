"""Version of colossal-gemini."""

__version__ = "0.1.0"
