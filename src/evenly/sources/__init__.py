"""File-format sources for ``evenly.Dataset``: Arrow IPC (and HF ``datasets`` on disk),
Parquet, WebDataset tar and JSON Lines shards, local or remote (fsspec), Megatron-LM
indexed datasets (``.bin`` + ``.idx``, local), ``write`` to pack any dataset into
shards, and ``tokenizer`` for text (packing on the fly, ``write(tokenize=...)``).

>>> import evenly.sources as es
>>> sorted(es.__all__)[:3]
['ArrowSource', 'JsonlSource', 'MegatronSource']
"""

from ._arrow import ArrowSource, from_arrow
from ._jsonl import JsonlSource, from_jsonl
from ._megatron import MegatronSource, from_megatron
from ._parquet import ParquetSource, from_parquet
from ._tokenize import Tokenizer, tokenizer
from ._webdataset import WebDatasetSource, from_webdataset
from ._write import write

__all__ = [
    "ArrowSource",
    "JsonlSource",
    "MegatronSource",
    "ParquetSource",
    "Tokenizer",
    "WebDatasetSource",
    "from_arrow",
    "from_jsonl",
    "from_megatron",
    "from_parquet",
    "from_webdataset",
    "tokenizer",
    "write",
]
