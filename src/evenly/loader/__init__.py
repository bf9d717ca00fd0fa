"""The loaders: ``evenly.DataLoader`` (it owns its passes), the engine and feed under it,
and ``evenly.BatchSampler`` for map-style datasets."""
