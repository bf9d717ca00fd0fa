"""Rank bodies for the real-client interop tests (Accelerate, Lightning, HF Trainer).

Each module here holds module-level functions that ``tests.distributed.run_ranks`` starts
in real gloo ranks (so they can be pickled for spawn) and ``expect`` the checks the tests
share.  Framework imports stay inside the functions: importing this package is cheap.
"""
