"""The package's version: its one source (pyproject.toml reads it for the metadata; ``__init__`` and the
CLI's ``--version`` import it). A module of its own, at the bottom of the layers, so any layer may."""

__version__ = "0.1.0"
