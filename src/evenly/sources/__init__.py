"""File-format sources for ``evenly.Dataset``: Parquet, WebDataset tar and JSON Lines
shards, local or remote (fsspec), and ``write`` to pack any dataset into shards.

>>> import evenly.sources as es
>>> sorted(es.__all__)[:3]
['JsonlSource', 'ParquetSource', 'WebDatasetSource']
"""

from ._jsonl import JsonlSource, from_jsonl
from ._parquet import ParquetSource, from_parquet
from ._webdataset import WebDatasetSource, from_webdataset
from ._write import write

__all__ = [
    "JsonlSource",
    "ParquetSource",
    "WebDatasetSource",
    "from_jsonl",
    "from_parquet",
    "from_webdataset",
    "write",
]
