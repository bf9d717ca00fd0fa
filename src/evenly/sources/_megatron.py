"""``evenly.from_megatron``: Megatron-LM's indexed dataset (``prefix.bin`` + ``prefix.idx``),
memory-mapped.

The ``.idx`` file (the ``MMIDIDX`` layout megatron-core's ``IndexedDatasetBuilder`` writes)
holds a header (magic ``MMIDIDX\\0\\0``, version 1 as ``<Q``, the token dtype code as
``<B``, the sequence count and the document count as ``<Q``), then the sizes (``int32``,
tokens per sequence), the pointers (``int64``, byte offset of each sequence in ``.bin``),
the document indices (``int64``, the sequence index at which each Megatron document
ends, starting with 0) and, for multimodal datasets, one ``int8`` mode per sequence.  The
``.bin`` file is every sequence's tokens back to back.

A sample of this source is one **sequence** of the index: a 1-D numpy array of its tokens
in the stored dtype (a view of the memory map, no copy; writable copy-on-write, so an
edit stays private to the process and never reaches the file).  Both files are mapped
once per process and shared through the OS page cache by every worker and rank of a
node; the token lengths that packing plans with are the ``.idx`` sizes array itself
(:meth:`MegatronSource.token_lengths`), not a copy.

>>> import os, tempfile, numpy as np
>>> prefix = os.path.join(tempfile.mkdtemp(), "corpus")
>>> write_megatron(prefix, [np.array([5, 6, 7]), np.array([8])], dtype=np.uint16)
>>> src = from_megatron(prefix)
>>> len(src), src[0].tolist(), src.token_lengths().tolist()
(2, [5, 6, 7], [3, 1])
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ._manifest import local_fingerprint

__all__ = ["MegatronSource", "from_megatron", "write_megatron"]

MAGIC = b"MMIDIDX\x00\x00"
#: ``struct`` layout of the header after the magic: version, dtype code, sequences, documents
_HEADER = struct.Struct("<QBQQ")
HEADER_BYTES = len(MAGIC) + _HEADER.size  # 34
#: megatron-core's ``DType`` codes
DTYPES: dict[int, type[np.number[Any]]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_WHAT = "evenly.from_megatron"
#: sequences of the index checked at a time when the source opens
CHECK_CHUNK = 1 << 20


def _paths(prefix: str | os.PathLike[str]) -> tuple[str, str, str]:
    """``(prefix, bin, idx)`` of a prefix (a path to either file is accepted too)."""
    p = os.fspath(prefix)
    if "://" in p:
        raise ValueError(
            f"{_WHAT}: {p!r} is a URL; Megatron files are memory-mapped, so they must be "
            f"local: copy them to a local disk (or write Parquet shards with "
            f"`evenly write --tokenize`, which read from object storage)"
        )
    if p.endswith((".bin", ".idx")):
        p = p[:-4]
    p = os.path.abspath(p)
    return p, p + ".bin", p + ".idx"


def _map(path: str) -> mmap.mmap | None:
    """A copy-on-write map of the file (None for an empty file)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None


class _Maps:
    """The two files of one dataset mapped in this process, and the arrays over them."""

    def __init__(self, src: MegatronSource) -> None:
        idx_map = _map(src.idx_path)
        self.bin_map = _map(src.bin_path)
        n, d = src.num_sequences, src.num_documents
        base = HEADER_BYTES
        assert idx_map is not None  # its size was checked: at least the header
        self.sizes = np.frombuffer(idx_map, np.int32, n, base)
        self.pointers = np.frombuffer(idx_map, np.int64, n, base + 4 * n)
        self.documents = np.frombuffer(idx_map, np.int64, d, base + 12 * n)
        self.tokens: npt.NDArray[Any] = (
            np.frombuffer(self.bin_map, src.dtype)
            if self.bin_map is not None
            else np.zeros(0, src.dtype)
        )


class MegatronSource:
    """One Megatron-LM indexed dataset as a source: sample ``i`` is sequence ``i`` of the
    index, a 1-D numpy array of tokens.  Build it with :func:`from_megatron`.

    It offers ``token_lengths`` (for ``evenly.Packing``), ``locate``, ``check_unchanged``
    (at every pass start: a ``stat`` of both files) and ``fingerprint`` (for checkpoints:
    the file name, token dtype, sequence count and ``.bin`` size; not the directory, so a
    copy elsewhere resumes from the same checkpoint).
    """

    format = "megatron"
    #: one memory-mapped file: any read order is as cheap as another
    preferred_shuffle = "global"

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix, self.bin_path, self.idx_path = _paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{_WHAT}: {path} not found; a Megatron dataset is the pair "
                    f"prefix.bin + prefix.idx (pass the prefix, without the extension)"
                )
        self._identity = (local_fingerprint(self.idx_path), local_fingerprint(self.bin_path))
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[: len(MAGIC)] != MAGIC:
            raise ValueError(
                f"{_WHAT}: {self.idx_path} is not a Megatron index (it does not start with "
                f"the MMIDIDX header, or is shorter than it): a truncated file, or another "
                f"format (the older 'TNTIDX' layout is not supported)"
            )
        version, code, n, d = _HEADER.unpack(head[len(MAGIC) :])
        if version != 1:
            raise ValueError(
                f"{_WHAT}: {self.idx_path} has index version {version}; only 1 is known"
            )
        if code not in DTYPES:
            raise ValueError(
                f"{_WHAT}: {self.idx_path} names token dtype code {code}, not one of "
                f"megatron-core's codes {sorted(DTYPES)}: the header is corrupt"
            )
        self.dtype = np.dtype(DTYPES[code])
        self.num_sequences, self.num_documents = int(n), int(d)
        plain = HEADER_BYTES + 12 * n + 8 * d
        idx_size = int(self._identity[0].split(":")[0])
        if idx_size not in (plain, plain + n):
            raise ValueError(
                f"{_WHAT}: {self.idx_path} holds {idx_size} bytes, but its header "
                f"({n} sequences, {d} documents) needs {plain} (or {plain + n} with "
                f"multimodal modes): the file is truncated or was written by another tool"
            )
        #: whether the index has one ``int8`` mode per sequence (multimodal datasets)
        self.multimodal = idx_size == plain + n and n > 0
        bin_size = int(self._identity[1].split(":")[0])
        if bin_size % self.dtype.itemsize:
            raise ValueError(
                f"{_WHAT}: {self.bin_path} holds {bin_size} bytes, not a whole number of "
                f"{self.dtype.name} tokens ({self.dtype.itemsize} bytes each, the dtype "
                f"{self.idx_path} names): the .bin is truncated, or the two files are not "
                f"a pair"
            )
        self._pid = os.getpid()
        self._maps: _Maps | None = None
        need = self._check_index(self._mapped())
        if bin_size != need:
            raise ValueError(
                f"{_WHAT}: {self.bin_path} holds {bin_size} bytes, but {self.idx_path} "
                f"describes {need} bytes of {self.dtype.name} tokens: the .bin is truncated, "
                f"or the two files are not a pair"
            )

    def _check_index(self, maps: _Maps) -> int:
        """Check that the sequences lie back to back from byte 0 (sequence ``i + 1``
        starts where ``i`` ends, as megatron-core writes them), and return where the last
        one ends: vectorised, ``CHECK_CHUNK`` sequences at a time (constant memory)."""
        item = self.dtype.itemsize
        end = 0  # where the next sequence must start
        for lo in range(0, self.num_sequences, CHECK_CHUNK):
            sizes = maps.sizes[lo : lo + CHECK_CHUNK].astype(np.int64)
            pointers = maps.pointers[lo : lo + CHECK_CHUNK]
            ends = pointers + sizes * item
            starts = np.concatenate([[end], ends[:-1]])
            bad = (sizes < 0) | (pointers != starts)
            if bool(bad.any()):
                raise self._bad_sequence(lo + int(np.argmax(bad)), maps)
            end = int(ends[-1])
        return end

    def _bad_sequence(self, i: int, maps: _Maps) -> ValueError:
        """The error for sequence ``i``, whose size or pointer does not fit the others."""
        item, size, pointer = self.dtype.itemsize, int(maps.sizes[i]), int(maps.pointers[i])
        head = f"{_WHAT}: {self.idx_path} is corrupt: sequence {i}"
        tail = "the index was damaged or written by another tool; write it again"
        if size < 0:
            return ValueError(f"{head} has a negative size ({size} tokens); {tail}")
        if i == 0:
            return ValueError(
                f"{head} starts at byte {pointer} of {self.bin_path}, not at byte 0; {tail}"
            )
        before, prior = int(maps.pointers[i - 1]), int(maps.sizes[i - 1])
        end = before + prior * item
        if end > pointer:
            how = f"it runs into sequence {i}: their shared tokens would be served twice"
        else:
            how = f"the {pointer - end} bytes between belong to no sequence (tokens lost)"
        return ValueError(
            f"{_WHAT}: {self.idx_path} is corrupt: sequence {i - 1} ({prior} {self.dtype.name} "
            f"tokens from byte {before}) ends at byte {end} of {self.bin_path}, but sequence "
            f"{i} starts at byte {pointer}: {how}; {tail}"
        )

    # ---- mapping (once per process) -----------------------------------------------
    def _mapped(self) -> _Maps:
        if self._maps is None or self._pid != os.getpid():
            now = (local_fingerprint(self.idx_path), local_fingerprint(self.bin_path))
            if now != self._identity:
                raise self._changed(now)
            self._maps = _Maps(self)
            self._pid = os.getpid()
        return self._maps

    def _changed(self, now: tuple[str, str]) -> ValueError:
        which = [
            p
            for p, a, b in zip((self.idx_path, self.bin_path), self._identity, now, strict=True)
            if a != b
        ]
        return ValueError(
            f"{_WHAT}: {', '.join(which)} changed since the source was opened "
            f"(size:mtime:ctime:inode {self._identity} then, {now} now): reading it would "
            f"return other tokens; open the source again"
        )

    def check_unchanged(self) -> None:
        """Raise if ``.bin`` or ``.idx`` changed since the source was opened (rewritten,
        truncated, replaced: reading a truncated map would kill the process)."""
        try:
            now = (local_fingerprint(self.idx_path), local_fingerprint(self.bin_path))
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"{_WHAT}: {exc.filename} was deleted or moved since the source was opened"
            ) from None
        if now != self._identity:
            raise self._changed(now)

    # ---- the Source protocol -------------------------------------------------------
    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, index: int) -> npt.NDArray[Any]:
        n = self.num_sequences
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(f"{_WHAT}: a sample index is an int, got {type(index).__name__}")
        i = int(index)
        if not 0 <= i < n:
            raise IndexError(f"{_WHAT}: sample index {i} is out of range [0, {n})")
        maps = self._mapped()
        start, rem = divmod(int(maps.pointers[i]), self.dtype.itemsize)
        size = int(maps.sizes[i])
        view = maps.tokens[start : start + size]
        if rem or size < 0 or view.size != size:
            raise ValueError(
                f"{_WHAT}: cannot read sample {i} ({self.locate(i)}): the index points "
                f"outside {self.bin_path} ({maps.tokens.size} tokens): the index is corrupt"
            )
        return view

    def __getitems__(self, indices: Sequence[int]) -> list[npt.NDArray[Any]]:
        """The sequences at ``indices`` (views), the files checked unchanged first (a
        ``stat`` of each per batch)."""
        self.check_unchanged()
        return [self[int(i)] for i in indices]

    def read_tokens(self, indices: Sequence[int], field: str = "input_ids") -> list[Any]:
        """The sequences at ``indices`` (packing's reads; ``field`` ignored, as for
        :meth:`token_lengths`)."""
        return self.__getitems__(indices)

    def token_lengths(self, field: str = "input_ids") -> npt.NDArray[np.int32]:
        """Tokens per sample (``int32``): the index's sizes array, memory-mapped (shared by
        every process of the node, no copy).  ``field`` is accepted for the packing
        protocol and ignored: a sample is the token sequence itself."""
        return self._mapped().sizes

    @property
    def document_indices(self) -> npt.NDArray[np.int64]:
        """Megatron's own document boundaries (sequence index at each document's end,
        starting with 0); evenly's documents are the sequences."""
        return self._mapped().documents

    @property
    def fingerprint(self) -> str:
        """Identity for checkpoints: name, dtype, sequences and ``.bin`` size."""
        bin_size = self._identity[1].split(":")[0]
        digest = hashlib.sha256(
            f"{os.path.basename(self.prefix)}:{self.dtype.name}:{self.num_sequences}:"
            f"{self.num_documents}:{bin_size}".encode()
        )
        return f"megatron:{self.num_sequences}:{digest.hexdigest()[:16]}"

    def content_key(self) -> str:
        """The key of these two files on this machine (their paths, sizes, mtimes, ctimes
        and inodes), for packing's cached lengths: unlike :attr:`fingerprint`, another
        corpus of the same name and sizes, or a rewrite, has another."""
        text = f"{self.idx_path}\t{self._identity[0]}\n{self.bin_path}\t{self._identity[1]}"
        return f"megatron:{self.num_sequences}:{hashlib.sha256(text.encode()).hexdigest()[:32]}"

    def locate(self, index: int) -> str:
        """Where sample ``index`` lives, e.g. ``"/data/corpus.bin sequence 17"``."""
        return f"{self.bin_path} sequence {int(index)}"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = None  # mapped again (and checked) in the process that reads
        return state

    def __repr__(self) -> str:
        return (
            f"MegatronSource({self.num_sequences} sequences of {self.dtype.name} tokens, "
            f"{self.prefix!r})"
        )


def from_megatron(prefix: str | os.PathLike[str]) -> MegatronSource:
    """Open a Megatron-LM indexed dataset (``prefix.bin`` + ``prefix.idx``) as a source.

    Each sample is one sequence of the index (a 1-D numpy array of its tokens, a view of
    the memory map); pass it to ``evenly.Dataset(..., pack=evenly.Packing(seq_len))`` to
    train on packed rows.  A bad or truncated file raises here, naming it.

    Args:
        prefix: the path without extension (``/data/corpus`` for ``/data/corpus.bin`` and
            ``/data/corpus.idx``); a path to either file is accepted too.  Local files only.
    """
    return MegatronSource(prefix)


def write_megatron(
    prefix: str | os.PathLike[str],
    sequences: Iterable[Sequence[int] | npt.NDArray[Any]],
    *,
    dtype: type[np.number[Any]] | np.dtype[Any] = np.int32,
) -> None:
    """Write ``sequences`` as ``prefix.bin`` + ``prefix.idx`` in the MMIDIDX layout (one
    Megatron document per sequence), readable by megatron-core and :func:`from_megatron`.
    A small writer for tests and examples; megatron-core's ``IndexedDatasetBuilder``
    writes the same files."""
    dt = np.dtype(dtype)
    codes = {np.dtype(v): k for k, v in DTYPES.items()}
    if dt not in codes:
        raise ValueError(f"write_megatron: dtype must be one of {sorted(str(d) for d in codes)}")
    _, bin_path, idx_path = _paths(prefix)
    sizes: list[int] = []
    with open(bin_path, "wb") as out:
        for seq in sequences:
            arr = np.asarray(seq, dtype=dt).reshape(-1)
            out.write(arr.tobytes())
            sizes.append(arr.size)
    lengths = np.asarray(sizes, dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * dt.itemsize
    documents = np.arange(len(sizes) + 1, dtype=np.int64)
    with open(idx_path, "wb") as out:
        out.write(MAGIC + _HEADER.pack(1, codes[dt], len(sizes), len(documents)))
        out.write(lengths.tobytes())
        out.write(pointers.astype(np.int64)[: len(sizes)].tobytes())
        out.write(documents.tobytes())
