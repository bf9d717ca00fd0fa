"""``evenly.from_jsonl`` over real files: the line index, its cache, exactly-once."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

import evenly.sources as es
from evenly.sources._jsonl import JsonlSource
from tests.sources_helpers import check_exactly_once, epoch_over_ranks

N = 64


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def jsonl_dir(tmp_path: Path) -> str:
    out = tmp_path / "jl"
    rows = [{"id": i, "text": "é" * (i % 7), "tags": [i, "x"]} for i in range(N)]
    es.write(rows, out, format="jsonl", rows_per_shard=24, progress=False)
    return str(out)


def test_random_access_and_locate(jsonl_dir: str) -> None:
    src = es.from_jsonl(jsonl_dir)
    assert len(src) == N and src.shard_sizes == (24, 24, 16)
    assert src[50] == {"id": 50, "text": "é" * (50 % 7), "tags": [50, "x"]}
    order = [63, 0, 24, 23, 5, 5]
    assert [s["id"] for s in src.__getitems__(order)] == order
    assert src.locate(30).endswith(f"{os.sep}shard-00001.jsonl row 6")


def test_hand_written_file_with_blank_lines_and_no_final_newline(tmp_path: Path) -> None:
    path = tmp_path / "hand.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\r\n[3, 4]\n"five"')
    src = es.from_jsonl(str(path))
    assert [src[i] for i in range(len(src))] == [{"a": 1}, {"a": 2}, [3, 4], "five"]


def test_line_index_is_cached(
    jsonl_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = sorted(str(p) for p in Path(jsonl_dir).glob("*.jsonl"))
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in files:  # copies without the manifest written by evenly.write
        (plain / os.path.basename(f)).write_bytes(Path(f).read_bytes())
    scanned: list[str] = []
    real = JsonlSource._scan

    def counting(self: JsonlSource, k: int, url: str) -> tuple[int, dict[str, Any]]:
        scanned.append(url)
        return real(self, k, url)

    monkeypatch.setattr(JsonlSource, "_scan", counting)
    es.from_jsonl(str(plain))
    assert len(scanned) == 3
    es.from_jsonl(str(plain))
    es.from_jsonl(jsonl_dir)  # the manifest beside the data
    assert len(scanned) == 3


def test_pickle_round_trip(jsonl_dir: str) -> None:
    src = es.from_jsonl(jsonl_dir)
    src[3]
    copy = pickle.loads(pickle.dumps(src))
    assert not copy._handles and copy[40] == src[40]


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_exactly_once_two_ranks_two_workers(jsonl_dir: str, shuffle: str) -> None:
    src = es.from_jsonl(jsonl_dir)
    (ranks,) = epoch_over_ranks(
        src, world_size=2, batch_size=4, num_workers=2, shuffle=shuffle, block_shards=2
    )
    check_exactly_once(ranks, list(range(N)), key=lambda s: s["id"])


def test_output_readable_without_evenly(jsonl_dir: str) -> None:
    ids = []
    for f in sorted(Path(jsonl_dir).glob("*.jsonl")):
        ids += [json.loads(line)["id"] for line in f.read_text("utf-8").splitlines()]
    assert ids == list(range(N))


def test_blank_lines_with_crlf_spaces_or_tabs_are_not_samples(tmp_path: Path) -> None:
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b'\r\n  \n{"a": 1}\r\n\r\n   \r\n\t \n{"a": 2}\r\n \t\r\n\n  ')
    src = es.from_jsonl(str(path))
    assert len(src) == 2 and src.__getitems__([0, 1]) == [{"a": 1}, {"a": 2}]
    assert src.locate(1) == f"{path} row 1"


def test_blank_lines_across_scan_chunk_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines and blank lines that straddle the scan's chunk boundaries."""
    import evenly.sources._jsonl as jsonl_module

    monkeypatch.setattr(jsonl_module, "_CHUNK", 5)  # many chunks, boundaries everywhere
    lines = [b'{"i": 0}', b"   ", b"", b" [1, 2] ", b"\t\r", b'"s"', b"  ", b"7"]
    path = tmp_path / "chunks.jsonl"
    path.write_bytes(b"\n".join(lines))  # no final newline after "7"
    src = es.from_jsonl(str(path))
    assert src.__getitems__(range(len(src))) == [{"i": 0}, [1, 2], "s", 7]
