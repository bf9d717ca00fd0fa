"""``evenly write``: pack a dataset named on the command line into shards.

    evenly write mypkg.data:make_dataset out/ --format parquet --rows-per-shard 10000
    evenly write 'raw/*.jsonl' tokens/ --tokenize tokenizer.json --append-eos

``module:name`` names an iterable, a map-style dataset, or a function of no argument
that returns one; a path or glob of ``.jsonl`` / ``.parquet`` / ``.arrow`` files is read
with ``evenly.from_*``.  ``--tokenize`` (a ``tokenizer.json`` file, or a name or directory
for ``transformers.AutoTokenizer``) writes ``input_ids`` (list<int32>) shards from the
``--text-field`` of each sample: the pre-tokenized fast path for ``evenly.Packing``.
``evenly.cli`` calls :func:`register` on its subparsers.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import sys
from typing import Any

from ._tokenize import tokenizer
from ._write import FORMATS, write

__all__ = ["load_object", "load_source", "register", "run_write"]


def load_object(spec: str) -> Any:
    """Import ``module:name`` (``name`` may be dotted) and call it if it is a function."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:name', got {spec!r} (e.g. 'mypkg.data:make_dataset')")
    if "" not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: modules in the current directory
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attr!r}") from None
    if callable(obj) and not hasattr(obj, "__getitem__") and not hasattr(obj, "__iter__"):
        obj = obj()
    return obj


#: file extensions ``evenly write`` reads by path, and the reader of each
_READERS = {".jsonl": "from_jsonl", ".parquet": "from_parquet", ".arrow": "from_arrow"}


def load_source(spec: str) -> Any:
    """``module:name`` (see :func:`load_object`), or a path / glob of data files."""
    stem = spec[:-3] if spec.endswith(".gz") else spec
    ext = next((e for e in _READERS if stem.endswith(e)), None)
    if ext is None and os.path.isdir(spec):
        ext = next((e for e in _READERS if glob.glob(os.path.join(spec, f"*{e}*"))), None)
    if ext is None:
        return load_object(spec)
    import evenly.sources

    return getattr(evenly.sources, _READERS[ext])(spec)


def run_write(args: argparse.Namespace) -> int:
    """Run ``evenly write`` with parsed ``args``; returns the exit code."""
    what = args.source
    try:
        data = load_source(args.source)
        tk = None
        if args.tokenize:
            what = args.tokenize
            tk = tokenizer(
                args.tokenize,
                add_special_tokens=not args.no_special_tokens,
                append_eos=args.append_eos,
            )
    except (ImportError, OSError, ValueError) as exc:
        print(f"evenly write: cannot load {what!r}: {exc}", file=sys.stderr)
        return 2
    paths = write(
        data,
        args.out_dir,
        format=args.format,
        rows_per_shard=args.rows_per_shard,
        row_group_size=args.row_group_size,
        prefix=args.prefix,
        progress=False if args.no_progress else (True if args.progress else None),
        tokenize=tk,
        text_field=args.text_field,
        keep_fields=args.keep_field,
    )
    what = f" of token ids ({tk.tokenizer_id})" if tk is not None else ""
    print(f"wrote {len(paths)} {args.format} shard(s){what} and a manifest to {args.out_dir}")
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``write`` subcommand; its handler is ``args.handler(args) -> int``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "write",
        help="pack a dataset (or tokenize text) into shards plus a manifest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", help="module:name of an iterable, dataset, or factory")
    parser.add_argument("out_dir", help="output directory (created if needed)")
    parser.add_argument("--format", choices=sorted(FORMATS), default="parquet")
    parser.add_argument("--rows-per-shard", type=int, default=10_000)
    parser.add_argument("--row-group-size", type=int, default=None, help="Parquet only")
    parser.add_argument("--prefix", default="shard", help="shard name prefix")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    tok = parser.add_argument_group("tokenize-and-shard mode")
    tok.add_argument(
        "--tokenize",
        metavar="TOKENIZER",
        help="tokenizer.json, or a transformers tokenizer name/dir: write input_ids shards",
    )
    tok.add_argument("--text-field", default="text", help="the text of a sample (dict)")
    tok.add_argument(
        "--keep-field", action="append", default=[], help="also write this field (repeat)"
    )
    tok.add_argument("--append-eos", action="store_true", help="end each document with EOS")
    tok.add_argument(
        "--no-special-tokens", action="store_true", help="do not add BOS/special tokens"
    )
    parser.add_argument(
        "--progress", action="store_true", help="show it even when stderr is not a terminal"
    )
    parser.set_defaults(handler=run_write)
    return parser
