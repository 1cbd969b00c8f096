"""Version of the colossal meta-package."""

__version__ = "0.1.0"
