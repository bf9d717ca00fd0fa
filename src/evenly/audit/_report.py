"""``--report DIR``: an HTML page with PNG plots (matplotlib, Agg backend).

Plots, one panel per epoch where it applies:

- ``delivery.png``: which rank/worker delivered each id (columns: ids in order; rows: the
  first, second... delivery of that id; white: never delivered), as in the talk's
  diagrams.
- ``order.png``: position in the epoch (as DDP steps see it) against id, coloured by
  rank/worker: a diagonal is unshuffled, blocks are shard-local shuffles.
- ``batches.png``: batch size at each step of each rank, epochs one after the other.
- ``resume.png`` (after ``--resume``): per stop, what each rank delivered before and after
  each interruption (``resume_section``: each rank's deliveries in order against the
  sample's place in the uninterrupted run, coloured by the run they came from; a right
  resume draws every rank's rising staircase without a break at the stop, a lost
  position starts the colour change lower (repeats), a lost sample leaves a gap, a wrong
  epoch jumps a band).

Every PNG has a fixed pixel size (``image_size``), so pages and tests can rely on it.
matplotlib comes with ``pip install 'evenly[report]'`` and is imported only here, when a
report is written; without it ``write_report`` raises ``AuditError`` naming that command
before it writes anything (and ``evenly audit --report`` says so before the audit runs).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._resumecheck import Run, first_occurrences
from ._types import I64, AuditError, Finding, Records, passed, unique_rows

if TYPE_CHECKING:
    from ._resume import ResumeReport

__all__ = ["DPI", "INSTALL", "MAX_POINTS", "image_size", "require_matplotlib", "write_report"]

#: The command that installs what ``--report`` needs.
INSTALL = "pip install 'evenly[report]'"

DPI = 100
#: Points drawn per scatter panel at most (a random subset beyond).
MAX_POINTS = 20_000
_WIDTH = 1100


def image_size(name: str, epochs: int) -> tuple[int, int]:
    """(width, height) in pixels of plot ``name`` for an audit of ``epochs`` epochs.

    >>> image_size("delivery", 2), image_size("order", 3), image_size("batches", 1)
    ((1100, 500), (1100, 400), (1100, 300))
    """
    heights = {"delivery": 100 + 200 * epochs, "order": 400, "batches": 300, "resume": 320}
    return _WIDTH, heights[name]


def require_matplotlib() -> None:
    """Raise ``AuditError`` naming ``INSTALL`` when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise AuditError(
            f"the HTML report (--report / write_report) draws its plots with matplotlib, "
            f"which is not installed ({exc}): {INSTALL}"
        ) from exc


def _figure(name: str, epochs: int, ncols: int = 1, nrows: int = 1) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w, h = image_size(name, epochs)
    fig, axes = plt.subplots(nrows, ncols, figsize=(w / DPI, h / DPI), dpi=DPI, squeeze=False)
    return fig, axes


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": keep the pixel size exact
    plt.close(fig)


def _stream(rec: Records) -> tuple[I64, int]:
    """Global worker index of each row (rank * workers + worker), and how many there are."""
    per_rank = max(rec.num_workers, 1)
    out: I64 = rec.rank * per_rank + rec.worker
    return out, rec.world_size * per_rank


def _colors(n: int) -> Any:
    """One distinct colour per global worker, indexable by that worker's number."""
    import matplotlib
    from matplotlib.colors import ListedColormap

    n = max(n, 1)
    if n <= 20:
        base = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
        return ListedColormap([base(i) for i in range(n)])
    return matplotlib.colormaps["viridis"].resampled(n)


def _legend(ax: Any, rec: Records) -> None:
    from matplotlib.patches import Patch

    n = rec.world_size * max(rec.num_workers, 1)
    if n > 16:
        return
    cmap = _colors(n)
    handles = [
        Patch(
            color=cmap(g),
            label=f"rank {g // max(rec.num_workers, 1)} worker {g % max(rec.num_workers, 1)}",
        )
        for g in range(n)
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def _columns(rec: Records) -> tuple[I64, bool]:
    """The ids to draw as columns, and whether column ``k`` is id ``k``.

    Integer ids that are non-negative and dense enough (at least half of
    ``[0, max(expected, max id + 1))`` seen) are drawn at their own position, so ids never
    delivered show as white gaps; other ids are drawn in sorted order.
    """
    seen = np.unique(rec.ids)
    if rec.labels is None and len(seen) and seen.min() >= 0:
        width = max(int(seen.max()) + 1, rec.expected or 0)
        if width <= 2 * len(seen):
            full: I64 = np.arange(width, dtype=np.int64)
            return full, True
    return seen.astype(np.int64), False


def plot_delivery(rec: Records, path: Path) -> None:
    fig, axes = _figure("delivery", rec.epochs, nrows=rec.epochs)
    columns, by_id = _columns(rec)
    stream, n_streams = _stream(rec)
    cmap = _colors(n_streams)
    for e in range(rec.epochs):
        ax = axes[e][0]
        rows = np.flatnonzero(rec.epoch == e)
        col = np.searchsorted(columns, rec.ids[rows])
        order = np.lexsort((stream[rows], col))
        col, who = col[order], stream[rows][order]
        # k-th delivery of its id: position within the run of equal columns.
        starts = np.r_[0, np.flatnonzero(np.diff(col)) + 1] if len(col) else np.zeros(0, int)
        run_start = np.repeat(starts, np.diff(np.r_[starts, len(col)]))
        copy = np.arange(len(col)) - run_start
        depth = int(copy.max()) + 1 if len(copy) else 1
        grid = np.full((depth, len(columns)), np.nan)
        grid[copy, col] = who
        ax.imshow(
            grid, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=n_streams - 0.5
        )
        ax.set_yticks(range(depth), [f"{k + 1}x" for k in range(depth)], fontsize=8)
        ax.set_title(f"epoch {e}: who delivered each id (white: never)", fontsize=10)
    axes[-1][0].set_xlabel("sample id" if by_id else "sample (in sorted id order)")
    _legend(axes[0][0], rec)
    fig.subplots_adjust(left=0.06, right=0.84, top=0.92, bottom=0.1, hspace=0.6)
    _save(fig, path)


def plot_order(rec: Records, path: Path) -> None:
    fig, axes = _figure("order", rec.epochs, ncols=rec.epochs)
    order = rec.global_order()
    stream, n_streams = _stream(rec)
    rng = np.random.default_rng(0)
    for e in range(rec.epochs):
        ax = axes[0][e]
        rows = order[rec.epoch[order] == e]
        position = np.arange(len(rows))
        if len(rows) > MAX_POINTS:
            keep = np.sort(rng.choice(len(rows), MAX_POINTS, replace=False))
            rows, position = rows[keep], position[keep]
        ax.scatter(
            position,
            rec.ids[rows],
            c=stream[rows],
            cmap=_colors(n_streams),
            s=14 if len(rows) <= 2_000 else 3,
            vmin=-0.5,
            vmax=n_streams - 0.5,
            linewidths=0,
        )
        ax.set_title(f"epoch {e}", fontsize=10)
        ax.set_xlabel("position in epoch (step, rank, slot)")
    axes[0][0].set_ylabel("sample id")
    _legend(axes[0][-1], rec)
    fig.subplots_adjust(left=0.07, right=0.84, top=0.9, bottom=0.14, wspace=0.25)
    _save(fig, path)


def plot_batches(rec: Records, path: Path) -> None:
    fig, axes = _figure("batches", rec.epochs)
    ax = axes[0][0]
    uniq, _, sizes = unique_rows(rec.epoch, rec.rank, rec.batch)
    steps_per_epoch = [
        int(uniq[uniq[:, 0] == e][:, 2].max()) + 1 if (uniq[:, 0] == e).any() else 0
        for e in range(rec.epochs)
    ]
    starts = np.r_[0, np.cumsum(steps_per_epoch)][:-1]
    for r in range(rec.world_size):
        mask = uniq[:, 1] == r
        x = starts[uniq[mask, 0]] + uniq[mask, 2]
        ax.plot(
            x,
            sizes[mask],
            marker="os^vD<>"[r % 7] if len(x) <= 200 else None,
            markersize=7 - 5 * r / max(rec.world_size, 1),
            linestyle="-",
            # Later ranks thinner, so equal sizes on every rank stay visible.
            linewidth=1 + 3 * (rec.world_size - 1 - r) / max(rec.world_size, 1),
            label=f"rank {r}",
            alpha=0.8,
        )
    for s in starts[1:]:
        ax.axvline(s - 0.5, color="grey", linestyle=":")
    total = int(sum(steps_per_epoch))
    ax.axhline(
        rec.batch_size, color="grey", linestyle="--", linewidth=0.8, zorder=0, label="batch_size"
    )
    ax.set_xlim(-0.5, max(total, 1) - 0.5)
    ax.set_ylim(0, rec.batch_size * 1.15)
    ax.set_xlabel("step (epochs one after the other)")
    ax.set_ylabel("batch size")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.subplots_adjust(left=0.07, right=0.86, top=0.92, bottom=0.16)
    _save(fig, path)


_CSS = """
body { font-family: sans-serif; margin: 2em; color: #222; max-width: 1150px; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
.PASS { background: #d8f3dc; } .WARN { background: #fff3bf; } .FAIL { background: #ffc9c9; }
img { display: block; margin: 0.5em 0 1.5em 0; max-width: 100%; }
"""

PLOTS = (
    ("delivery", "Which rank and worker delivered each sample, per epoch"),
    ("order", "Position in the epoch against sample id"),
    ("batches", "Batch size at each step, per rank"),
)


def _page(factory: str, rec: Records, findings: Sequence[Finding]) -> str:
    esc = html.escape
    verdict = "OK" if passed(findings) else "FAIL"
    rows = "\n".join(
        f'<tr class="{f.status}"><td>{esc(f.title)}</td><td><b>{f.status}</b></td>'
        f"<td>{f.value:g}</td><td>{esc(f.detail)}</td></tr>"
        for f in findings
    )
    ranks = "\n".join(
        f"<tr><td>{r.rank}</td><td>{r.epoch}</td><td>{r.samples}</td><td>{r.batches}</td>"
        f"<td>{r.reported_len}</td><td>{r.reported_batches}</td></tr>"
        for r in rec.per_rank
    )
    plots = "\n".join(
        f'<h2>{esc(title)}</h2>\n<img src="{name}.png" alt="{esc(title)}" '
        f'width="{image_size(name, rec.epochs)[0]}">'
        for name, title in PLOTS
    )
    warns = "".join(f"<li>{esc(w)}</li>" for w in rec.warnings) or "<li>none</li>"
    mix = _mix_section(rec)
    nodes = f"<p>Nodes: {esc(rec.layout())}.</p>\n" if rec.nodes > 1 else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>evenly audit: {esc(factory)}</title>
<style>{_CSS}</style></head><body>
<h1>evenly audit: <code>{esc(factory)}</code> &mdash; {verdict}</h1>
<p>{rec.world_size} rank(s) &times; {rec.num_workers} worker(s) &times; {rec.epochs} epoch(s),
batch size {rec.batch_size}; {len(rec)} samples delivered; expected {rec.expected} distinct
per epoch ({esc(rec.expected_source)}).</p>
{nodes}<table><tr><th>finding</th><th>status</th><th>value</th><th>detail</th></tr>
{rows}
</table>
<h2>Per rank and epoch</h2>
<table><tr><th>rank</th><th>epoch</th><th>samples</th><th>batches</th><th>len()</th>
<th>len(loader)</th></tr>
{ranks}
</table>
{mix}{plots}
<h2>Warnings raised during the audit</h2><ul>{warns}</ul>
</body></html>
"""


def _mix_section(rec: Records) -> str:
    """For a Mix: a table of samples per source and epoch (delivered / expected)."""
    if rec.mix is None:
        return ""
    from ._coverage import cell_status, per_epoch

    esc = html.escape
    names = rec.mix.names
    head = "".join(f"<th>{esc(n)}</th>" for n in names)
    rows = []
    for row in per_epoch(rec):
        cells = "".join(
            f'<td class="{cell_status(row, n)}">{row["delivered"][n]} / {row["expected"][n]}</td>'
            for n in names
        )
        rows.append(f"<tr><td>{row['epoch']}</td>{cells}</tr>")
    body = "\n".join(rows)
    return (
        '<h2>Samples per source and epoch (delivered / mix.counts)</h2>\n<table id="mix">'
        f"<tr><th>epoch</th>{head}</tr>\n{body}\n</table>\n"
    )


# ---- the resume section -------------------------------------------------------------
_SEGMENTS = ("before the stop", "after the load", "after the second load")
_COLORS = ("#4c72b0", "#dd8452", "#55a868")


def _places(ref: Run) -> dict[tuple[int, int], int]:
    """(epoch, id) -> its place in the reference: epoch offset + global position."""
    out: dict[tuple[int, int], int] = {}
    offset = 0
    for e in ref.epochs():
        order = first_occurrences(ref.global_order(e))
        for i, x in enumerate(order.tolist()):
            out[(e, int(x))] = offset + i
        offset += len(order)
    return out


def _panel(ax: Any, run: Run, places: dict[tuple[int, int], int], title: str) -> None:
    for r in range(run.world_size):
        rows = np.flatnonzero(run.rank == r)
        rows = rows[np.argsort(run.seg[rows], kind="stable")]
        y = np.asarray(
            [
                places.get((int(e), int(x)), -1)
                for e, x in zip(run.epoch[rows], run.ids[rows], strict=True)
            ]
        )
        x = np.arange(len(rows))
        for k, color in enumerate(_COLORS):
            pick = run.seg[rows] == k
            if pick.any():
                ax.scatter(
                    x[pick],
                    y[pick],
                    s=4,
                    color=color,
                    marker="os^v"[r % 4],
                    label=f"rank {r}, {_SEGMENTS[k]}" if r == 0 else None,
                )
    ax.set_title(title, fontsize=8)
    ax.set_xlabel("delivery on the rank", fontsize=7)
    ax.tick_params(labelsize=6)


def resume_section(
    report: ResumeReport,
    directory: Path,
    figure: Callable[..., tuple[Any, Any]],
    save: Callable[[Any, Path], None],
) -> str:
    """Draw ``resume.png`` into ``directory``; return the section's HTML."""
    esc = html.escape
    if report.cannot is not None:
        return f"<h2>Resume</h2><p>cannot resume: {esc(report.cannot)}</p>\n"
    drawn = [(s, s.run) for s in report.stops if s.run is not None]
    rows = "\n".join(
        f"<tr><td>{esc(str(s.stop))}</td><td>{s.world_size} x {s.num_workers}</td>"
        f"<td>{esc(s.error or '; '.join(s.notes) or '')}</td></tr>"
        for s in report.stops
    )
    img = ""
    if drawn and report.reference is not None:
        places = _places(report.reference)
        fig, axes = figure("resume", 1, ncols=len(drawn))
        for ax, (s, run) in zip(axes[0], drawn, strict=True):
            _panel(ax, run, places, str(s.stop))
        axes[0][0].set_ylabel("place in the uninterrupted run", fontsize=7)
        axes[0][0].legend(fontsize=6, loc="upper left")
        fig.subplots_adjust(left=0.05, right=0.99, top=0.88, bottom=0.16, wspace=0.3)
        save(fig, directory / "resume.png")
        img = '<img src="resume.png" alt="what each rank delivered around each stop" width="1100">'
    return (
        "<h2>Resume: what each rank delivered before and after each interruption</h2>\n"
        f"{img}\n<table><tr><th>stop</th><th>resumed onto (ranks x workers)</th>"
        f"<th>notes</th></tr>\n{rows}\n</table>\n"
    )


def write_report(
    directory: Path,
    factory: str,
    rec: Records,
    findings: Sequence[Finding],
    resume: ResumeReport | None = None,
) -> Path:
    """Write ``index.html`` and the PNGs of ``PLOTS`` into ``directory`` (and, after a
    resume audit, ``resume.png``); return the page."""
    require_matplotlib()
    directory.mkdir(parents=True, exist_ok=True)
    plot_delivery(rec, directory / "delivery.png")
    plot_order(rec, directory / "order.png")
    plot_batches(rec, directory / "batches.png")
    section = ""
    if resume is not None:
        section = resume_section(resume, directory, _figure, _save)
    page = directory / "index.html"
    text = _page(factory, rec, findings)
    page.write_text(
        text.replace("<h2>Warnings raised", section + "<h2>Warnings raised"), encoding="utf-8"
    )
    return page
