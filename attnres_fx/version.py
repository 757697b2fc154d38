"""The installed attnres_fx version (also in pyproject.toml)."""

__version__ = "0.2.0"
