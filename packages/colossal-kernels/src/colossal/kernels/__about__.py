"""Version of colossal-kernels."""

__version__ = "0.1.0"
