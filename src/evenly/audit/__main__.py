"""``python -m evenly.audit module:factory ...``: the ``evenly audit`` command."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
