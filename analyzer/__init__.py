"""dumpdiff's analyzer: index two dumps, align their token rows, name the first divergent operator.

Runs anywhere: it reads safetensors, JSON and parquet, and never imports an inference engine.
The only dumper code it uses is ``dumper.format`` and ``dumper.rowprint`` (the row fingerprint).
"""

import os as _os

# The analyzer does no matrix work in numpy; numpy's BLAS would otherwise start a thread per core
# at import, a visible part of a verdict's start-up on a many-core host. A user's setting wins.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
