"""Token accounting against the planned pieces of an epoch (pure numpy).

A Mix by tokens (``evenly.Mix(unit="tokens")``) does not deliver every document once: a
source up-sampled by its weight delivers some documents twice in an epoch, and an epoch
may start or end inside a document.  What each epoch must deliver is its plan's items
(document, first token, token count); :func:`compare` counts, per document token, how
many times the plan holds it minus how many times the ranks delivered it, with one sort
over the range ends (never token by token).

>>> expected = (np.array([0, 0, 1]), np.array([0, 0, 0]), np.array([4, 4, 2]))  # doc 0 twice
>>> delivered = (np.array([0, 0, 1]), np.array([0, 0, 1]), np.array([4, 2, 1]))
>>> compare(expected, delivered)
(3, 0, 'document 0 tokens [2, 4) missing 1x, document 1 tokens [0, 1) missing 1x')
"""

from __future__ import annotations

import numpy as np

from ._types import I64

__all__ = ["compare"]

#: Ranges named per problem.
SHOWN = 3

Ranges = tuple[I64, I64, I64]


def compare(expected: Ranges, delivered: Ranges) -> tuple[int, int, str]:
    """``(missing, repeated, text)``: tokens the plan holds more often than the ranks
    delivered them, tokens delivered more often than planned, and the first ranges."""
    (ed, es, el), (dd, ds, dl) = expected, delivered
    docs = np.concatenate([ed, ed, dd, dd]).astype(np.int64)
    pos = np.concatenate([es, es + el, ds, ds + dl]).astype(np.int64)
    ones = np.ones(len(ed), dtype=np.int64), np.ones(len(dd), dtype=np.int64)
    delta = np.concatenate([ones[0], -ones[0], -ones[1], ones[1]])
    order = np.lexsort((pos, docs))
    docs, pos, level = docs[order], pos[order], np.cumsum(delta[order])
    if docs.size < 2:
        return 0, 0, ""
    same = docs[1:] == docs[:-1]
    width = np.where(same, pos[1:] - pos[:-1], 0)
    value = level[:-1]
    bad = (width > 0) & (value != 0)
    missing = int((width * np.maximum(value, 0)).sum())
    repeated = int((width * np.maximum(-value, 0)).sum())
    shown = [
        f"document {int(d)} tokens [{int(a)}, {int(a + w)}) "
        f"{'missing' if v > 0 else 'repeated'} {abs(int(v))}x"
        for d, a, w, v in zip(
            docs[:-1][bad][:SHOWN],
            pos[:-1][bad][:SHOWN],
            width[bad][:SHOWN],
            value[bad][:SHOWN],
            strict=True,
        )
    ]
    more = ", ..." if int(bad.sum()) > SHOWN else ""
    return missing, repeated, ", ".join(shown) + more
