"""The index of a dump: per token row, an exact fingerprint and magnitude of every tensor row.

Built once from the pass files (in worker processes for large dumps), saved as parquet tables
next to the dump and reused while the dump is unchanged; also the readers that fetch rows back.
"""
