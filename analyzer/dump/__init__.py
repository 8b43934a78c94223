"""Reading dumps: the rank folders, each pass file's header and metadata, tensors as raw bits.

Owns what a dump *is* on disk (see docs/dump-format.md) and every check that a file is whole
and well formed; nothing here compares two dumps.
"""
