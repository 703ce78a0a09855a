"""The package's version: exported by the package root and written into every checkpoint's provenance."""

__version__ = "0.1.0.dev0"
