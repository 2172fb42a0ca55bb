"""``python -m pipeline pairs``: raw corpus files -> shards of the pairs their records' structure gives."""
