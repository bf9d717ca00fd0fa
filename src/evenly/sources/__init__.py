"""File-format sources for ``evenly.Dataset``: Arrow IPC (and HF ``datasets`` on disk),
Parquet, WebDataset tar and JSON Lines shards, local or remote (fsspec), and ``write``
to pack any dataset into shards.

>>> import evenly.sources as es
>>> sorted(es.__all__)[:3]
['ArrowSource', 'JsonlSource', 'ParquetSource']
"""

from ._arrow import ArrowSource, from_arrow
from ._jsonl import JsonlSource, from_jsonl
from ._parquet import ParquetSource, from_parquet
from ._webdataset import WebDatasetSource, from_webdataset
from ._write import write

__all__ = [
    "ArrowSource",
    "JsonlSource",
    "ParquetSource",
    "WebDatasetSource",
    "from_arrow",
    "from_jsonl",
    "from_parquet",
    "from_webdataset",
    "write",
]
