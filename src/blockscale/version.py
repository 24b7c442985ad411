"""The package version, in one place below every layer (pyproject.toml states the same; a test checks)."""
__version__ = "0.1.0"
