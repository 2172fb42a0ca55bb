"""Raw corpus -> deduplicated, globally shuffled sentence shards (``python -m pipeline preprocess``)."""
