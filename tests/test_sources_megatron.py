"""``evenly.from_megatron``: Megatron-LM indexed datasets written by megatron-core's own
builder read back token for token, memory-mapped (lengths and samples are views of the
files' maps, not copies), exactly once under workers (fork and spawn) and simulated
ranks; bad, truncated and changed files raise naming the file."""

from __future__ import annotations

import mmap
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import evenly
from evenly.sources._megatron import MegatronSource, write_megatron
from tests.sources_helpers import check_exactly_once, epoch_over_ranks


def _megatron_core() -> Any:
    """megatron-core's indexed dataset module (its import warns that Transformer Engine
    and Apex are absent: irrelevant to the file format)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    return module


def documents(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 60_000, int(rng.integers(0, 40))) for _ in range(n)]


def built_by_megatron(prefix: Path, docs: list[np.ndarray], dtype: Any) -> Any:
    """Write ``docs`` with megatron-core's ``IndexedDatasetBuilder``: the first four as one
    Megatron document of four sequences (``add_document``), the rest one each."""
    import torch

    mc = _megatron_core()
    builder = mc.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    with warnings.catch_warnings():  # its numpy.array(tensor, dtype): torch's __array__ warns
        warnings.simplefilter("ignore", DeprecationWarning)
        builder.add_document(torch.from_numpy(np.concatenate(docs[:4])), [len(d) for d in docs[:4]])
    for d in docs[4:]:
        builder.add_item(torch.from_numpy(d))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return mc


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_reads_what_megatron_core_wrote_token_for_token(tmp_path: Path, dtype: Any) -> None:
    docs = documents(50)
    mc = built_by_megatron(tmp_path / "corpus", docs, dtype)
    src = evenly.from_megatron(tmp_path / "corpus")
    assert len(src) == 50 and src.dtype == np.dtype(dtype)
    got = src.__getitems__(range(50))
    for i, (doc, sample) in enumerate(zip(docs, got, strict=True)):
        assert sample.dtype == np.dtype(dtype) and sample.ndim == 1
        assert sample.tolist() == doc.tolist(), i
    assert src.token_lengths().dtype == np.int32
    assert src.token_lengths().tolist() == [len(d) for d in docs]
    theirs = mc.IndexedDataset(str(tmp_path / "corpus"))
    assert src.document_indices.tolist() == theirs.document_indices.tolist()
    assert src.document_indices.tolist()[:3] == [0, 4, 5]  # the 4-sequence document
    # a path to either file names the same dataset
    assert evenly.from_megatron(f"{tmp_path}/corpus.idx").fingerprint == src.fingerprint


def test_the_documented_layout_is_byte_for_byte_megatron_cores(tmp_path: Path) -> None:
    """write_megatron (the docs' and benches' writer) writes exactly what megatron-core's
    builder writes for one document per sequence, and megatron-core reads it back."""
    import torch

    docs = documents(20, seed=1)
    mc = _megatron_core()
    builder = mc.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_item(torch.from_numpy(d))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    write_megatron(tmp_path / "ours", docs, dtype=np.uint16)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()
    theirs = mc.IndexedDataset(str(tmp_path / "ours"))
    assert [theirs[i].tolist() for i in range(20)] == [d.tolist() for d in docs]


def test_lengths_and_samples_are_views_of_the_maps_not_copies(tmp_path: Path) -> None:
    docs = documents(30)
    write_megatron(tmp_path / "c", docs, dtype=np.uint16)
    src = evenly.from_megatron(tmp_path / "c")

    def mapped(arr: np.ndarray) -> bool:
        base: Any = arr
        while isinstance(base, np.ndarray):
            assert not base.flags.owndata
            base = base.base
        return isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)

    assert mapped(src.token_lengths())
    sample = next(s for s in src.__getitems__(range(30)) if s.size)
    assert mapped(sample)
    before = (tmp_path / "c.bin").read_bytes()
    sample[0] = 7  # copy-on-write: the process's own page, never the file
    assert (tmp_path / "c.bin").read_bytes() == before
    assert (
        evenly.from_megatron(tmp_path / "c").__getitems__(range(30))[0].tolist() == docs[0].tolist()
    )


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_exactly_once_under_workers_and_ranks(tmp_path: Path, start_method: str) -> None:
    docs = documents(37)
    write_megatron(tmp_path / "c", [np.concatenate([[i], d]) for i, d in enumerate(docs)])
    src = evenly.from_megatron(tmp_path / "c")
    world, workers = (2, 2) if start_method == "fork" else (1, 2)
    ranks = []
    for rank in range(world):
        ds: evenly.Dataset[Any] = evenly.Dataset(
            src, shuffle=True, seed=3, rank=rank, world_size=world, pad="none"
        )
        loader = evenly.DataLoader(
            ds,
            batch_size=4,
            num_workers=workers,
            collate_fn=list,
            multiprocessing_context=start_method,
            timeout=60,
        )
        ranks.append([list(b) for b in loader])
    seen = sorted(int(s[0]) for batches in ranks for b in batches for s in b)
    assert seen == list(range(37))
    by_id = {int(s[0]): s[1:].tolist() for batches in ranks for b in batches for s in b}
    assert by_id == {i: d.tolist() for i, d in enumerate(docs)}


def test_simulated_ranks_pad_to_equal_batches(tmp_path: Path) -> None:
    write_megatron(tmp_path / "c", [[i, i] for i in range(21)])
    out = epoch_over_ranks(
        evenly.from_megatron(tmp_path / "c"), world_size=3, batch_size=4, num_workers=0
    )
    check_exactly_once(out[0], list(range(21)), key=lambda s: int(s[0]))


def test_pickled_source_maps_again_and_keeps_its_identity(tmp_path: Path) -> None:
    write_megatron(tmp_path / "c", documents(10))
    src = evenly.from_megatron(tmp_path / "c")
    src[0]
    copy = pickle.loads(pickle.dumps(src))
    assert copy._maps is None and len(pickle.dumps(src)) < 2000
    assert [a.tolist() for a in copy.__getitems__(range(10))] == [
        a.tolist() for a in src.__getitems__(range(10))
    ]
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(tmp_path / f"c{ext}", moved / f"c{ext}")
    assert evenly.from_megatron(moved / "c").fingerprint == src.fingerprint


# ---- bad files -----------------------------------------------------------------------
def test_missing_file_names_it(tmp_path: Path) -> None:
    write_megatron(tmp_path / "c", documents(5))
    os.unlink(tmp_path / "c.bin")
    with pytest.raises(FileNotFoundError, match=r"c\.bin not found.*prefix\.bin \+ prefix\.idx"):
        evenly.from_megatron(tmp_path / "c")


def test_truncated_idx_names_it(tmp_path: Path) -> None:
    write_megatron(tmp_path / "c", documents(5))
    data = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").write_bytes(data[:-3])
    with pytest.raises(ValueError, match=r"c\.idx holds \d+ bytes.*truncated"):
        evenly.from_megatron(tmp_path / "c")
    (tmp_path / "c.idx").write_bytes(data[:20])
    with pytest.raises(ValueError, match=r"c\.idx is not a Megatron index"):
        evenly.from_megatron(tmp_path / "c")


def test_truncated_bin_names_it(tmp_path: Path) -> None:
    write_megatron(tmp_path / "c", documents(5))
    data = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(data[:-4])
    with pytest.raises(ValueError, match=r"c\.bin holds \d+ bytes.*c\.idx describes"):
        evenly.from_megatron(tmp_path / "c")


def test_a_bin_that_is_no_whole_number_of_tokens_names_files_sizes_and_dtype(
    tmp_path: Path,
) -> None:
    write_megatron(tmp_path / "c", documents(5), dtype=np.int32)
    data = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(data[:-1])
    size = len(data) - 1
    with pytest.raises(
        ValueError,
        match=rf"c\.bin holds {size} bytes, not a whole number of int32 tokens \(4 bytes "
        rf"each, the dtype .*c\.idx names\)",
    ):
        evenly.from_megatron(tmp_path / "c")


def rewrite_index(prefix: Path, edit: Any) -> None:
    """Rewrite ``prefix.idx`` after ``edit(sizes, pointers)`` changed its arrays in place
    (the header and the document indices kept)."""
    data = bytearray((prefix.parent / f"{prefix.name}.idx").read_bytes())
    n = int(np.frombuffer(bytes(data[18:26]), np.uint64)[0])
    sizes = np.frombuffer(data, np.int32, n, 34)
    pointers = np.frombuffer(data, np.int64, n, 34 + 4 * n)
    edit(sizes, pointers)
    (prefix.parent / f"{prefix.name}.idx").write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # sequence 1 one token longer, sequence 4 one shorter: the same .bin size in all
        (
            lambda s, p: (s.__setitem__(1, s[1] + 1), s.__setitem__(4, s[4] - 1)),
            r"sequence 1 \(\d+ int32 tokens from byte \d+\) ends at byte \d+ of .*c\.bin, but "
            r"sequence 2 starts at byte \d+: it runs into sequence 2",
        ),
        (
            lambda s, p: (s.__setitem__(1, s[1] - 1), s.__setitem__(4, s[4] + 1)),
            r"sequence 1 .* but sequence 2 starts at byte \d+: the 4 bytes between belong "
            r"to no sequence",
        ),
        (lambda s, p: p.__setitem__(3, p[3] + 4), r"sequence 2 .* sequence 3 starts at byte"),
        (lambda s, p: p.__setitem__(0, 4), r"sequence 0 starts at byte 4 of .*c\.bin, not at"),
        (
            lambda s, p: s.__setitem__(2, -1),
            r"sequence 2 has a negative size \(-1 tokens\)",
        ),
    ],
    ids=["overlap", "gap", "pointer", "first-pointer", "negative-size"],
)
def test_an_index_whose_sequences_do_not_lie_back_to_back_names_the_sequence(
    tmp_path: Path, edit: Any, message: str
) -> None:
    docs = [np.arange(1, 6) + 10 * i for i in range(6)]  # every sequence 5 tokens long
    write_megatron(tmp_path / "c", docs)
    rewrite_index(tmp_path / "c", edit)
    with pytest.raises(ValueError, match=r"c\.idx is corrupt: " + message):
        evenly.from_megatron(tmp_path / "c")


def test_other_formats_and_corrupt_headers_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "c.bin").write_bytes(b"")
    (tmp_path / "c.idx").write_bytes(b"TNTIDX\x00\x00" + bytes(40))
    with pytest.raises(ValueError, match=r"c\.idx is not a Megatron index.*TNTIDX"):
        evenly.from_megatron(tmp_path / "c")
    write_megatron(tmp_path / "d", documents(3))
    data = bytearray((tmp_path / "d.idx").read_bytes())
    data[17] = 42  # the dtype code
    (tmp_path / "d.idx").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"d\.idx names token dtype code 42"):
        evenly.from_megatron(tmp_path / "d")
    with pytest.raises(ValueError, match="must be local"):
        evenly.from_megatron("s3://bucket/corpus")


def test_a_file_changed_after_opening_raises_instead_of_serving_other_tokens(
    tmp_path: Path,
) -> None:
    write_megatron(tmp_path / "c", [[1, 2, 3], [4, 5]])
    src = evenly.from_megatron(tmp_path / "c")
    assert src[1].tolist() == [4, 5]
    src.check_unchanged()
    write_megatron(tmp_path / "c", [[9, 9, 9], [8, 8]])  # same sizes, other tokens
    with pytest.raises(ValueError, match=r"c\.bin.*changed since the source was opened"):
        src.check_unchanged()
    with pytest.raises(ValueError, match="changed since the source was opened"):
        src.__getitems__([0, 1])
    ds: evenly.Dataset[Any] = evenly.Dataset(src, shuffle=False)
    with pytest.raises(ValueError, match="changed since the source was opened"):
        list(evenly.DataLoader(ds, batch_size=2, collate_fn=list))


def test_index_out_of_range_names_the_range(tmp_path: Path) -> None:
    write_megatron(tmp_path / "c", [[1], [2]])
    src: MegatronSource = evenly.from_megatron(tmp_path / "c")
    with pytest.raises(IndexError, match=r"sample index 2 is out of range \[0, 2\)"):
        src[2]
    assert src.locate(1).endswith("c.bin sequence 1")


def test_an_empty_dataset_opens(tmp_path: Path) -> None:
    write_megatron(tmp_path / "c", [])
    src = evenly.from_megatron(tmp_path / "c")
    assert len(src) == 0 and src.token_lengths().size == 0
