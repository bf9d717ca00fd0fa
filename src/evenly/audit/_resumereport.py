"""The resume section of the HTML report: ``resume.png`` and a table of the stops.

One panel per stop: each rank's deliveries in order (x) against the sample's place in
the uninterrupted run (y: epoch x samples + its position in that epoch's global order;
a repeat of a padding at its first position), coloured by the run they came from (before
the stop, after the load, after the second load).  A right resume draws every rank's
rising staircase without a break at the stop; a lost position starts the colour change
lower (repeats), a lost sample leaves a gap, a wrong epoch jumps a band.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._resumecheck import Run, first_occurrences

if TYPE_CHECKING:
    from ._resumeplan import ResumeReport

__all__ = ["resume_section"]

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
