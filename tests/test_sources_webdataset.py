"""``evenly.from_webdataset`` over real tar files: grouping by key as WebDataset does,
the member-offset index, exactly-once, and tars written by other tools."""

from __future__ import annotations

import gc
import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

import evenly.sources as es
from evenly.sources._webdataset import split_name
from tests.sources_helpers import check_exactly_once, epoch_over_ranks

N = 48


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVENLY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def wds_dir(tmp_path: Path) -> str:
    out = tmp_path / "wds"
    rows = [
        {"__key__": f"s{i:04d}", "txt": f"text {i}", "cls": i % 5, "npy": np.arange(i % 4)}
        for i in range(N)
    ]
    es.write(rows, out, format="webdataset", rows_per_shard=16, progress=False)
    return str(out)


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_split_name_like_webdataset() -> None:
    assert split_name("dir/abc.seg.PNG") == ("dir/abc", "seg.png")
    assert split_name("a.b/c.txt") == ("a.b/c", "txt")
    assert split_name("README") is None


def test_random_access(wds_dir: str) -> None:
    src = es.from_webdataset(wds_dir)
    assert len(src) == N and src.shard_sizes == (16, 16, 16)
    s = src[37]
    assert s["__key__"] == "s0037" and s["txt"] == b"text 37" and s["cls"] == b"2"
    assert np.load(io.BytesIO(s["npy"])).tolist() == [0]
    assert s["__url__"].endswith("shard-00002.tar")
    order = [47, 0, 16, 15, 0]
    assert [x["__key__"] for x in src.__getitems__(order)] == [f"s{i:04d}" for i in order]
    assert src.locate(17).endswith("shard-00001.tar row 1")


def test_tar_from_another_tool_with_dirs_and_dotted_fields(tmp_path: Path) -> None:
    path = tmp_path / "other.tar"
    with tarfile.open(path, "w") as tar:
        d = tarfile.TarInfo("imgs")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        add(tar, "imgs/a.jpg", b"A")
        add(tar, "imgs/a.seg.png", b"AS")
        add(tar, "imgs/b.jpg", b"B")
        add(tar, "imgs/b.seg.png", b"BS")
    src = es.from_webdataset(str(path))
    assert len(src) == 2
    assert src[1]["__key__"] == "imgs/b" and src[1]["seg.png"] == b"BS"


def test_pickle_round_trip(wds_dir: str) -> None:
    src = es.from_webdataset(wds_dir)
    src[3]
    copy = pickle.loads(pickle.dumps(src))
    assert not copy._handles and copy[40] == src[40]


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_exactly_once_two_ranks_two_workers(wds_dir: str, shuffle: str) -> None:
    src = es.from_webdataset(wds_dir)
    (ranks,) = epoch_over_ranks(
        src, world_size=2, batch_size=4, num_workers=2, shuffle=shuffle, block_shards=2
    )
    check_exactly_once(ranks, [f"s{i:04d}" for i in range(N)], key=lambda s: s["__key__"])


def test_output_readable_by_tarfile(wds_dir: str) -> None:
    with tarfile.open(Path(wds_dir) / "shard-00000.tar") as tar:
        names = tar.getnames()
    assert names[:3] == ["s0000.txt", "s0000.cls", "s0000.npy"]


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # webdataset leaves its tar files open
def test_output_readable_by_webdataset(wds_dir: str) -> None:
    wds = pytest.importorskip("webdataset")
    urls = sorted(str(p) for p in Path(wds_dir).glob("*.tar"))
    keys = [s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False)]
    gc.collect()
    assert keys == [f"s{i:04d}" for i in range(N)]
