"""The pure planning core: numpy only, no torch, no I/O (``tests/test_import.py`` imports
every module of it with ``torch`` blocked).  Permutations, orders, epoch and stream plans,
the topology value, pass states and the pass tracker, source protocols, mixtures."""
