"""The planning core of packing (numpy only: no torch, no I/O).

* :mod:`evenly.core.packing.settings`: :class:`~evenly.core.packing.settings.Packing`,
  the user's settings (``evenly.Packing``);
* :mod:`evenly.core.packing.pieces`: rows as pieces of documents, and the token arrays
  of packed rows (:func:`~evenly.core.packing.pieces.assemble`);
* :mod:`evenly.core.packing.concat`: the ``concat`` strategy (resume points every
  1024 documents: row ``r`` found with no replay);
* :mod:`evenly.core.packing.best_fit`: the ``best_fit`` strategy (windowed
  best-fit-decreasing, all windows in lockstep; resume points every 1024 rows).

Rows are a function of the documents' lengths in the epoch's order and the settings
only: never of ranks, workers or batch size.
"""
