#!/usr/bin/env bash
# Install the peer libraries that bench/bench_formats.py, bench/bench_packing.py and
# bench/bench_remote.py compare evenly with, into the
# active venv (default: ./.venv), never touching torch: every install is constrained by
# constraints.txt.  litdata and mosaicml-streaming are installed --no-deps (their full
# requirement lists pull in cloud SDKs and, for streaming, torchvision, which has no wheel
# matching the local CPU torch), with the requirements they need to import listed by hand.
# Never install torchvision here.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
PIP=(python -m pip install --quiet -c constraints.txt)

# HF datasets, webdataset, torchdata, psutil (the bench extra of pyproject.toml)
"${PIP[@]}" "psutil>=5.9" "datasets>=2.18" "webdataset>=0.2.86" "torchdata>=0.10"

# bench_remote.py: moto's S3 server, s3fs (evenly's s3:// path through fsspec), and obstore
# (litdata's S3 path where it is installed; the bench runs litdata with and without it).
# One resolver call with boto3: s3fs's aiobotocore pins botocore to a narrow range, and a
# boto3 installed on its own (litdata's line below) would pull a newer botocore than
# aiobotocore accepts; resolved together, pip picks the boto3 whose botocore fits.
"${PIP[@]}" "moto[server]>=5" "s3fs>=2023.6" boto3 aiohttp obstore

# litdata: its import-time requirements, then litdata itself without dependencies
"${PIP[@]}" lightning-utilities filelock boto3 requests tifffile
"${PIP[@]}" --no-deps "litdata==0.2.76"

# mosaicml-streaming: compression codecs, PIL (MDS encodings), xxhash, and transformers
# (streaming.base.dataloader imports it); then streaming itself without dependencies
"${PIP[@]}" Brotli python-snappy zstd zstandard pillow xxhash catalogue transformers
"${PIP[@]}" --no-deps "mosaicml-streaming==0.13.0"

# Grain (its own DataLoader, adapted by evenly.audit.peers for `evenly audit --peer grain`,
# and bench_packing.py's best-fit padding comparison; never a test dependency): its wheel's
# requirements are light (absl-py, array-record, cloudpickle, etils, numpy, portpicker,
# protobuf) and leave torch alone
"${PIP[@]}" "grain==0.2.18"

python - <<'PY'
import importlib
import sys
import types

# bench_formats.py imports mosaicml-streaming the same way: its streaming.vision
# subpackage imports torchvision (not installed here, and not needed by the bench)
sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
for name in (
    "datasets", "webdataset", "litdata", "streaming", "grain", "psutil", "moto", "s3fs", "obstore"
):
    try:
        mod = importlib.import_module(name)
        print(f"ok   {name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:  # report, do not fail: the bench skips what is missing
        print(f"FAIL {name}: {type(exc).__name__}: {exc}")
import torch
print(f"torch {torch.__version__} (pinned by constraints.txt)")
PY
