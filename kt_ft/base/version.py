"""kt-ft's version: one place, read by the build (pyproject) and the package."""

__version__ = "0.1.0"
