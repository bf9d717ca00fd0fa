"""The planning core of ``evenly.Mix`` (numpy only: no torch, no I/O).

* :mod:`evenly.core.mix.apportion`: samples per epoch of each source
  (:func:`~evenly.core.mix.apportion.mix_counts`), stream offsets per epoch
  (:func:`~evenly.core.mix.apportion.epoch_offsets`) and the apportionment ``F(P)`` that
  keeps every prefix of whole steps exact
  (:class:`~evenly.core.mix.apportion.Apportionment`);
* :mod:`evenly.core.mix.order`: one epoch's order, position -> global index
  (:class:`~evenly.core.mix.order.MixOrder`);
* :mod:`evenly.core.mix.tokens`: a mixture by tokens, one epoch's pieces merged by
  virtual midpoint, or by deadline (:mod:`evenly.core.mix.deadline`) where a source
  dominates four or more, each source within one row of its share at every prefix.

The sources' own shuffles use the Mix's key schedule of the one Feistel network
(:func:`evenly.core.permutation.keyed_bijection`).
"""
