"""Record ``tests/data/order_pins.json`` from the code as it is (see ``tests/order_pins.py``).

Run once, from the commit whose orders are the spec:

    PYTHONPATH=src python tests/scripts/record_order_pins.py

It refuses to overwrite the file: a pinned order is never re-recorded to make a test pass.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.order_pins import KINDS, digest  # noqa: E402

TARGET = ROOT / "tests" / "data" / "order_pins.json"


def main() -> None:
    if TARGET.exists() and "--force" not in sys.argv:
        raise SystemExit(f"{TARGET} exists: pinned orders are not re-recorded")
    pins = {
        kind: [{"case": case, **digest(compute(case))} for case in cases()]
        for kind, (cases, compute) in KINDS.items()
    }
    lines = [
        f'"{kind}": [\n' + ",\n".join(json.dumps(entry) for entry in entries) + "\n]"
        for kind, entries in pins.items()
    ]
    TARGET.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one case per line
    print(f"wrote {TARGET} ({TARGET.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
