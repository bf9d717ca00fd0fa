"""Exact mid-epoch resume over real shard files, locally and on the real local S3 server:
save after k batches on 2 ranks x 2 workers, resume on a new topology, exactly once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import evenly
import evenly.sources as es
from tests import s3server
from tests.s3server import S3Endpoint
from tests.sources_helpers import as_list

s3 = s3server.s3
s3_prefix = s3server.s3_prefix
N, K = 96, 3
READERS = {"parquet": es.from_parquet, "webdataset": es.from_webdataset, "jsonl": es.from_jsonl}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write(tmp_path: Path, fmt: str) -> Path:
    rows = [
        {"__key__": f"k{i:03d}", "id": i} if fmt == "webdataset" else {"id": i} for i in range(N)
    ]
    out = tmp_path / fmt
    es.write(rows, out, format=fmt, rows_per_shard=12, progress=False)
    return out


def loaders(source: Any, shuffle: str, world: int, workers: int, batch: int) -> list[Any]:
    return [
        evenly.DataLoader(
            evenly.Dataset(
                source, shuffle=shuffle, block_shards=2, seed=3, rank=r, world_size=world
            ),
            batch_size=batch,
            num_workers=workers,
            collate_fn=as_list,
            timeout=60 if workers else 0,
        )
        for r in range(world)
    ]


def resume_exactly_once(source: Any, shuffle: str) -> None:
    seen: list[int] = []
    states = []
    for loader in loaders(source, shuffle, world=2, workers=2, batch=4):
        it = iter(loader)
        seen += [int(s["id"]) for _ in range(K) for s in next(it)]
        states.append(loader.state_dict())
        del it
    assert states[0] == states[1] and states[0]["position"] == K * 2 * 4
    assert states[0]["shuffle"] == shuffle and "source" in states[0]
    after = []
    for loader in loaders(source, shuffle, world=3, workers=2, batch=5):
        loader.load_state_dict(states[0])
        after.append([[int(s["id"]) for s in b] for b in loader])
    assert len({len(r) for r in after}) == 1  # equal batch counts on the new ranks
    union = Counter(seen + [i for r in after for b in r for i in b])
    padded = sum(union.values()) - N
    assert set(union) == set(range(N)) and 0 <= padded < 3


@pytest.mark.parametrize("shuffle", ["global", "block"])
@pytest.mark.parametrize("fmt", READERS)
def test_local_shards_resume_exactly(tmp_path: Path, fmt: str, shuffle: str) -> None:
    resume_exactly_once(READERS[fmt](str(write(tmp_path, fmt))), shuffle)


@pytest.mark.parametrize("fmt", READERS)
def test_remote_shards_resume_exactly(
    s3: S3Endpoint, s3_prefix: str, tmp_path: Path, fmt: str
) -> None:
    url = s3.upload(str(write(tmp_path, fmt)), f"{s3_prefix}/{fmt}")
    source = READERS[fmt](url, storage_options=s3.storage_options, cache_dir=str(tmp_path / "c"))
    resume_exactly_once(source, "block")


def test_a_state_from_other_shards_is_refused(tmp_path: Path) -> None:
    first = es.from_jsonl(str(write(tmp_path, "jsonl")))
    (loader,) = loaders(first, "global", world=1, workers=0, batch=4)
    state = loader.state_dict()
    rows = [{"id": i} for i in range(N)]
    es.write(rows, tmp_path / "other", format="jsonl", rows_per_shard=16, progress=False)
    (other,) = loaders(es.from_jsonl(str(tmp_path / "other")), "global", 1, 0, 4)
    with pytest.raises(evenly.StateError, match="source: saved"):
        other.load_state_dict(state)
