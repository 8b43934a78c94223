"""dumpdiff's analyzer: index two dumps, align their token rows, name the first divergent operator.

Runs anywhere: it reads safetensors, JSON and parquet, and never imports an inference engine.
The only dumper code it shares is the format module (``dumper.format``).
"""
