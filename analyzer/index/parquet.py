"""A saved index table read from bytes in memory by pyarrow's parquet reader itself.

``pyarrow.parquet`` imports pyarrow's file systems on the way (S3, GCS, Azure, HDFS, and ssl
with them): 10-20 ms of a 0.4 s strict verdict, for tables that are already in memory. The
reader class under it needs none of them. Where a pyarrow release moves or changes that class,
the public ``ParquetFile`` is used instead.
"""

from __future__ import annotations


class ParquetBytes:
    """The footer parsed once (or given: ``metadata``); ``read`` decodes the named columns. Not
    safe on two threads at once: give each thread its own, over the same bytes and metadata."""

    def __init__(self, data, metadata=None) -> None:
        import pyarrow as pa

        source = pa.BufferReader(data)
        try:
            from pyarrow._parquet import ParquetReader

            reader = ParquetReader()
            reader.open(source, metadata=metadata)
        except (ImportError, TypeError, AttributeError):  # another pyarrow: the public reader
            import pyarrow.parquet as pq

            reader = pq.ParquetFile(source, metadata=metadata).reader
        self._reader = reader
        self.schema_arrow = reader.schema_arrow
        self.metadata = reader.metadata
        self._place = {name: k for k, name in enumerate(self.schema_arrow.names)}

    def read(self, columns=None, use_threads: bool = False):
        """A pyarrow Table of the named columns (None: all), in the order asked; names the table
        lacks are left out. On the calling thread unless use_threads."""
        places = None if columns is None else [self._place[c] for c in columns if c in self._place]
        return self._reader.read_all(column_indices=places, use_threads=use_threads)
