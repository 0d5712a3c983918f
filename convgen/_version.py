"""convgen's version, in one place: pyproject.toml reads it (setuptools dynamic version), the package re-exports it."""

__version__ = "0.1.0"
