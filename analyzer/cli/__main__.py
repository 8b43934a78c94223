"""`python -m dumpdiff.analyzer.cli ...` runs the `dumpdiff` command."""

from .main import entry

entry()
