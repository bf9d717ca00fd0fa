"""Packed rows for LLM training: evenly vs litdata's ``TokensLoader`` vs the one-process
limit, ``best_fit`` padding vs Grain's best-fit, and planning at 10^8 documents.

The workload (issue 18's goal table): pre-tokenized Arrow shards (``input_ids``
list<int32>, written by ``evenly.write``), document lengths log-normal with median 500
tokens (sigma 1), random token ids; rows of ``--seq-len`` 2048, batches of 8, 2 DataLoader
workers, one globally shuffled epoch.

* **evenly**: ``Dataset(from_arrow(dir), shuffle=True, pack=Packing(2048))`` +
  ``evenly.DataLoader(batch_size=8, num_workers=2)``: batches of ``input_ids``,
  ``position_ids`` and ``labels`` (int64 ``[8, 2048]``).
* **litdata** (its documented recipe): ``litdata.optimize(fn, ..., item_loader=TokensLoader())``
  over the same documents (one int32 tensor each), read by
  ``StreamingDataset(item_loader=TokensLoader(block_size=2048), shuffle=True)`` +
  ``StreamingDataLoader(batch_size=8, num_workers=2)``: ``input_ids`` only.
* **limit**: the one-process limit: the Arrow files memory-mapped, the epoch's documents
  (shuffled) gathered into int64 ``[8, 2048]`` tensors by numpy, no DataLoader.

Each contender runs in a fresh subprocess, interleaved over ``--rounds``; tokens/s
counts the documents' tokens delivered (pads excluded) over the whole first epoch
(workers' start included; the goals are on it) and, reported beside it, over a second
epoch of the same loader (as ``bench_formats.py`` times epoch 2); every contender checks
what it delivered against the corpus (token sum and count), so "missing" shows tokens an
epoch did not deliver. Memory: peak PSS of the process tree. ``best_fit`` padding is
planned over the same lengths (public API: a lengths-only source) and Grain's
``BestFitPackIterDataset`` (``num_packing_bins`` = evenly's ``open_rows``) packs the
same pieces (documents longer than a row cut into ``seq_len`` pieces, as ``best_fit``
does: Grain refuses longer ones) in the same order.
Planning 10^8 documents is ``bench_plan_packing.py``'s child (``--plan-docs``).

    bash bench/setup_peers.sh   # litdata, grain
    python bench/bench_packing.py --rounds 3

A change's cost: ``--also-src LABEL=PATH`` adds the evenly contender importing evenly from
``PATH`` (another commit's ``src``, e.g. from ``git archive``), as ``evenly@LABEL``, in
the same rounds (interleaved, over the same corpus)::

    mkdir /tmp/before && git archive HEAD~1 src | tar -x -C /tmp/before
    python bench/bench_packing.py --rounds 5 --plan-docs 0 --only evenly \\
        --also-src before=/tmp/before/src

Pass ``--child`` only internally.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import env_for, run_child, summary

CONTENDERS = ("evenly", "litdata", "limit")


def make_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(rng.lognormal(np.log(500), 1.0, n), 1).astype(np.int32)


def prepare(data: str, docs: int, names: tuple[str, ...]) -> dict[str, Any]:
    """The corpus as Arrow shards (and litdata chunks); its token count and sum."""
    import pyarrow as pa

    import evenly

    lengths = make_lengths(docs)
    tokens = np.random.default_rng(1).integers(1, 50_000, int(lengths.sum()), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    np.save(os.path.join(data, "starts.npy"), starts)
    tokens.tofile(os.path.join(data, "tokens.i32"))
    schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
    rows = ({"input_ids": tokens[starts[i] : starts[i + 1]]} for i in range(docs))
    evenly.write(
        rows, os.path.join(data, "arrow"), "arrow", -(-docs // 4), schema=schema, progress=False
    )
    if "litdata" in names:
        from litdata import optimize
        from litdata.streaming.item_loader import TokensLoader

        optimize(
            fn=_litdata_doc,
            inputs=list(range(docs)),
            output_dir=os.path.join(data, "lit"),
            chunk_size=2048 * 1024,
            item_loader=TokensLoader(),
            num_workers=1,
            mode="overwrite",
        )
    return {"tokens": int(tokens.size), "sum": int(tokens.sum(dtype=np.int64))}


def _litdata_doc(i: int) -> Any:
    """litdata's optimize fn: one document as an int32 tensor (from the corpus files)."""
    import torch

    data = os.environ["EVENLY_BENCH_DATA"]
    starts = np.load(os.path.join(data, "starts.npy"), mmap_mode="r")
    tokens = np.memmap(os.path.join(data, "tokens.i32"), dtype=np.int32, mode="r")
    return torch.from_numpy(np.array(tokens[starts[i] : starts[i + 1]]))


# ---- the contenders (each in its own process) -----------------------------------------
def _batches(name: str, data: str, seq_len: int, batch: int, workers: int) -> Any:
    """A function giving one epoch's ``input_ids`` batches per call."""
    if name == "evenly":
        import evenly

        ds: Any = evenly.Dataset(
            evenly.from_arrow(os.path.join(data, "arrow")),
            shuffle=True,
            seed=0,
            pack=evenly.Packing(seq_len),
        )
        loader = evenly.DataLoader(ds, batch_size=batch, num_workers=workers)
        len(loader)  # lengths and plan found before the clock starts (cached per node)
        return lambda: (b["input_ids"] for b in loader)
    if name == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        lit = StreamingDataset(
            os.path.join(data, "lit"),
            shuffle=True,
            seed=0,
            item_loader=TokensLoader(block_size=seq_len),
        )
        lit_loader = StreamingDataLoader(lit, batch_size=batch, num_workers=workers)
        return lambda: iter(lit_loader)
    return _limit(data, seq_len, batch)


def _limit(data: str, seq_len: int, batch: int) -> Any:
    """Memory-mapped token gather in one process: the Arrow files' token buffers mapped,
    the shuffled documents' tokens copied into int64 [batch, seq_len] tensors."""
    import pyarrow as pa
    import torch

    views, offsets = [], []
    for name in sorted(os.listdir(os.path.join(data, "arrow"))):
        if name.endswith(".arrow"):
            reader = pa.ipc.open_file(pa.memory_map(os.path.join(data, "arrow", name)))
            for k in range(reader.num_record_batches):
                col = reader.get_batch(k).column(0)
                views.append(np.asarray(col.values))
                offsets.append(np.asarray(col.offsets))
    docs = [
        (v, int(o[j]), int(o[j + 1]))
        for v, o in zip(views, offsets, strict=True)
        for j in range(len(o) - 1)
    ]
    rng = np.random.default_rng(0)
    return lambda: _gather(docs, rng.permutation(len(docs)), batch, seq_len, torch)


def _gather(docs: list[Any], order: np.ndarray, batch: int, seq_len: int, torch: Any) -> Any:
    want = batch * seq_len
    out = np.empty(want, dtype=np.int64)
    filled = 0
    for i in order.tolist():
        v, lo, hi = docs[i]
        while lo < hi:
            take = min(hi - lo, want - filled)
            out[filled : filled + take] = v[lo : lo + take]
            filled, lo = filled + take, lo + take
            if filled == want:
                yield torch.from_numpy(out.reshape(batch, seq_len).copy())
                filled = 0
    if filled:
        out[filled:] = 0
        yield torch.from_numpy(out.reshape(batch, seq_len).copy())


def child(name: str, data: str, seq_len: int, batch: int, workers: int) -> None:
    """Time the first epoch (workers' start included) and then a second one."""
    import torch

    t0 = time.perf_counter()
    epoch = _batches(name, data, seq_len, batch, workers)
    setup = time.perf_counter() - t0
    out: dict[str, Any] = {"setup": setup}
    for key in ("", "2"):
        count = total = 0
        t1 = time.perf_counter()
        for ids in epoch():
            count += int(torch.count_nonzero(ids))
            total += int(ids.sum())
        out.update({f"seconds{key}": time.perf_counter() - t1, f"tokens{key}": count})
        out[f"sum{key}"] = total
    print(json.dumps(out))


# ---- padding and planning --------------------------------------------------------------
class LengthsOnly:
    """A source that only knows its documents' lengths (for planning alone)."""

    def __init__(self, lengths: np.ndarray, name: str) -> None:
        self.lengths = lengths
        self.fingerprint = f"lengths:{name}:{lengths.size}"

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __getitem__(self, index: int) -> Any:
        raise RuntimeError("planning only")

    def token_lengths(self, field: str) -> np.ndarray:
        return self.lengths


def padding(lengths: np.ndarray, seq_len: int, cache: str) -> dict[str, Any]:
    """best_fit's padding fraction (evenly, public API) and Grain's on the same pieces."""
    import evenly

    pack = evenly.Packing(seq_len, strategy="best_fit")
    os.environ["EVENLY_CACHE_DIR"] = cache
    ds: Any = evenly.Dataset(LengthsOnly(lengths, "bench"), shuffle=False, pack=pack)
    tokens = int(lengths.sum(dtype=np.int64))
    ideal = -(-tokens // seq_len)
    out: dict[str, Any] = {
        "evenly": 1 - tokens / (len(ds) * seq_len),
        "ideal_rows": ideal,
        "evenly_rows": len(ds),
        "open_rows": pack.open_rows,
        "window": pack.window,
    }
    pieces = np.concatenate(
        [
            [seq_len] * (int(n) // seq_len) + ([int(n) % seq_len] if n % seq_len else [])
            for n in lengths.tolist()
        ]
    )
    try:
        out["grain"], out["grain_rows"] = _grain(pieces, seq_len, pack.open_rows)
    except ImportError as exc:
        out["grain"] = f"not installed ({exc})"
    return out


def _grain(pieces: np.ndarray, seq_len: int, bins: int) -> tuple[float, int]:
    import grain
    from grain.experimental import BestFitPackIterDataset

    docs = [{"input_ids": np.ones(int(n), dtype=np.int32)} for n in pieces.tolist()]
    ds = grain.MapDataset.source(docs).to_iter_dataset()
    packed = BestFitPackIterDataset(
        ds, length_struct={"input_ids": seq_len}, num_packing_bins=bins, shuffle_bins=False
    )
    rows = used = 0
    for row in packed:
        rows += 1
        used += int(np.count_nonzero(row["input_ids_segment_ids"]))
    assert used == int(pieces.sum()), "grain lost tokens"
    return 1 - used / (rows * seq_len), rows


def first_pass(tmp: str, docs: int, seq_len: int) -> dict[str, float]:
    """Seconds per document of packing's first lengths pass: text tokenized on the fly (a
    BPE tokenizer of 2,000 tokens trained here, batched calls) vs pre-tokenized shards
    (lengths from the list offsets); and of ``evenly.write(tokenize=...)``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    import evenly

    rng = np.random.default_rng(3)
    words = np.array([f"w{i}" + "x" * (i % 5) for i in range(5000)])
    counts = np.maximum(rng.lognormal(np.log(300), 1.0, docs), 1).astype(int)
    texts = [" ".join(rng.choice(words, int(c))) for c in counts]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["[PAD]", "[UNK]"])
    tok.train_from_iterator(texts[:500], trainer)
    tk = evenly.tokenizer(tok)
    os.environ["EVENLY_CACHE_DIR"] = os.path.join(tmp, "fp-cache")
    evenly.write(({"text": t} for t in texts), os.path.join(tmp, "text"), "jsonl", progress=False)
    out: dict[str, float] = {"docs": docs}
    t0 = time.perf_counter()
    pack = evenly.Packing(seq_len, tokenize=tk, tokenizer_id=tk.tokenizer_id)
    len(evenly.Dataset(evenly.from_jsonl(os.path.join(tmp, "text")), pack=pack))
    out["on_the_fly"] = (time.perf_counter() - t0) / docs
    t0 = time.perf_counter()
    evenly.write(
        evenly.from_jsonl(os.path.join(tmp, "text")),
        os.path.join(tmp, "tok"),
        "arrow",
        tokenize=tk,
        progress=False,
    )
    out["write"] = (time.perf_counter() - t0) / docs
    t0 = time.perf_counter()
    len(evenly.Dataset(evenly.from_arrow(os.path.join(tmp, "tok")), pack=evenly.Packing(seq_len)))
    out["pre_tokenized"] = (time.perf_counter() - t0) / docs
    return out


def plan_memory(docs: int, seq_len: int, tmp: str) -> list[dict[str, Any]]:
    """bench_plan_packing.py's child, once per strategy: seconds, extra private memory."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(tmp, "plan-lengths.i32")
    out = np.memmap(path, dtype=np.int32, mode="w+", shape=(docs,))
    for lo in range(0, docs, 1 << 22):
        out[lo : min(lo + (1 << 22), docs)] = make_lengths(min(1 << 22, docs - lo), seed=lo)
    out.flush()
    del out
    results = []
    for strategy in ("concat", "best_fit"):
        env = {**os.environ, "EVENLY_CACHE_DIR": os.path.join(tmp, f"plan-cache-{strategy}")}
        cmd = [
            sys.executable,
            os.path.join(here, "bench_plan_packing.py"),
            "--seq-len",
            str(seq_len),
            "--child",
            path,
            str(docs),
            strategy,
        ]
        line = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        results.append({"strategy": strategy, **json.loads(line.stdout.strip().splitlines()[-1])})
        shutil.rmtree(env["EVENLY_CACHE_DIR"], ignore_errors=True)  # a 10^8 best_fit plan: ~2.4 GB
    os.unlink(path)
    return results


# ---- the run ---------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--padding-docs", type=int, default=100_000)
    p.add_argument("--text-docs", type=int, default=5_000, help="first lengths pass")
    p.add_argument("--plan-docs", type=int, default=10**8, help="0: skip the planning row")
    p.add_argument("--only", nargs="*", default=list(CONTENDERS))
    p.add_argument(
        "--also-src",
        nargs="*",
        default=[],
        metavar="LABEL=PATH",
        help="also time evenly imported from PATH (another commit's src), as evenly@LABEL",
    )
    p.add_argument("--child", nargs=2, metavar=("NAME", "DATA"))
    a = p.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.seq_len, a.batch, a.workers)
        return
    names = tuple(n for n in CONTENDERS if n in a.only)
    sources = dict(item.split("=", 1) for item in a.also_src)
    timed = (*names, *(f"evenly@{label}" for label in sources))
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        os.makedirs(data)
        env = {**env_for(data), "EVENLY_CACHE_DIR": os.path.join(tmp, "cache")}
        os.environ["EVENLY_BENCH_DATA"] = data
        corpus = prepare(data, a.docs, names)
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in timed}
        for _ in range(a.rounds):
            for name in timed:
                label = name.partition("@")[2]
                child_env = env
                if label:  # evenly from another tree, with its own cache
                    cache = os.path.join(tmp, f"cache-{label}")
                    child_env = {**env, "PYTHONPATH": sources[label], "EVENLY_CACHE_DIR": cache}
                cmd = [
                    sys.executable,
                    __file__,
                    "--seq-len",
                    str(a.seq_len),
                    "--batch",
                    str(a.batch),
                    "--workers",
                    str(a.workers),
                    "--child",
                    name.partition("@")[0],
                    data,
                ]
                runs[name].append(run_child(cmd, child_env, timeout=900))
        pad = padding(make_lengths(a.padding_docs, seed=2), a.seq_len, os.path.join(tmp, "pc"))
        first = first_pass(tmp, a.text_docs, a.seq_len)
        plans = plan_memory(a.plan_docs, a.seq_len, tmp) if a.plan_docs else []
    report(a, corpus, runs, pad, plans, first)


def report(
    a: Any,
    corpus: dict[str, Any],
    runs: dict[str, list[dict[str, Any]]],
    pad: dict[str, Any],
    plans: list[dict[str, Any]],
    first: dict[str, float],
) -> None:
    print(
        f"{a.docs:,} documents, {corpus['tokens']:,} tokens (log-normal, median 500); "
        f"seq_len {a.seq_len}, batch {a.batch}, {a.workers} workers; {a.rounds} interleaved "
        f"rounds: median [min, max]"
    )
    rates: dict[str, float] = {}
    rates2: dict[str, float] = {}
    print(
        f"\n{'contender':<14} {'tokens/s, epoch 1':>30} {'epoch 2':>30} {'setup s':>8} "
        f"{'PSS MiB':>8} {'missing':>9}"
    )
    for name, rs in runs.items():
        bad = next((r["error"] for r in rs if "error" in r), None)
        if bad:
            print(f"{name:<14} failed: {bad}")
            continue
        med, lo, hi = summary([r["tokens"] / r["seconds"] for r in rs])
        med2, lo2, hi2 = summary([r["tokens2"] / r["seconds2"] for r in rs])
        rates[name], rates2[name] = med, med2
        setup = statistics.median(r["setup"] for r in rs)
        pss = max(r["peak_pss"] for r in rs) / 2**20
        missing = max(corpus["tokens"] - r[f"tokens{k}"] for r in rs for k in ("", "2"))
        wrong = any(
            r[f"tokens{k}"] == corpus["tokens"] and r[f"sum{k}"] != corpus["sum"]
            for r in rs
            for k in ("", "2")
        )
        print(
            f"{name:<14} {med / 1e6:>9.2f}M [{lo / 1e6:.2f}M-{hi / 1e6:.2f}M] "
            f"{med2 / 1e6:>9.2f}M [{lo2 / 1e6:.2f}M-{hi2 / 1e6:.2f}M] "
            f"{setup:>8.1f} {pss:>8,.0f} {missing:>9,}{'  (token sum differs!)' if wrong else ''}"
        )
    print(
        f"\nbest_fit padding over {a.padding_docs:,} lengths (open_rows {pad['open_rows']}, "
        f"window {pad['window']}): evenly {100 * pad['evenly']:.3f}% ({pad['evenly_rows']:,} "
        f"rows; ideal {pad['ideal_rows']:,})",
        end="",
    )
    grain_pad = pad["grain"]
    if isinstance(grain_pad, float):
        print(f", Grain {100 * grain_pad:.3f}% ({pad['grain_rows']:,} rows)")
    else:
        print(f", Grain {grain_pad}")
    for r in plans:
        print(
            f"planning {a.plan_docs:,} documents, {r['strategy']}: {r['seconds']:.1f} s, "
            f"extra private {r['extra_anon_mb']:.1f} MB, peak PSS {r['peak_pss_mb']:.0f} MB"
        )

    print(
        f"first lengths pass over {first['docs']:,} text documents (median 300 words): "
        f"tokenized on the fly {first['on_the_fly'] * 1e6:.0f} us/document, pre-tokenized "
        f"Arrow {first['pre_tokenized'] * 1e6:.1f} us/document; evenly.write(tokenize=...) "
        f"{first['write'] * 1e6:.0f} us/document"
    )

    def ratio(x: str, y: str, of: dict[str, float] = rates) -> float | None:
        return of[x] / of[y] if x in of and y in of else None

    print("\n## goals")
    goals = [
        ("packed tokens/s vs litdata TokensLoader", ">=", 2.0, ratio("evenly", "litdata")),
        ("packed tokens/s vs the one-process limit", ">=", 0.25, ratio("evenly", "limit")),
        ("  the same, epoch 2 (reported)", ">=", 0.25, ratio("evenly", "limit", rates2)),
        ("  vs litdata, epoch 2 (reported)", ">=", 2.0, ratio("evenly", "litdata", rates2)),
        (
            "best_fit padding vs Grain best-fit",
            "<=",
            1.0,
            pad["evenly"] / grain_pad if isinstance(grain_pad, float) and grain_pad else None,
        ),
        (
            "planning 10^8 docs, peak extra MB per process",
            "<=",
            64.0,
            max(r["extra_anon_mb"] for r in plans) if plans else None,
        ),
    ]
    for what, op, goal, value in goals:
        if value is None:
            print(f"{what:<48} {op} {goal:<5} -")
            continue
        met = value >= goal if op == ">=" else value <= goal
        print(f"{what:<48} {op} {goal:<5} {value:8.2f}  {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
