"""qllama's version: one place, read by the package, the wheel's metadata and the caches'
stamps (a cell or a built file made by another version is made again)."""

__version__ = "0.1.0"
