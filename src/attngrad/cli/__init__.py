"""The `attngrad` command: one module per command, `main` the entry point."""

from attngrad.cli.app import main

__all__ = ["main"]
