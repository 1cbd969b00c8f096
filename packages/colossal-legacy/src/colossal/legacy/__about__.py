"""Version of colossal-legacy."""

__version__ = "0.1.0"
