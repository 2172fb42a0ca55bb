"""The teacher stage: cached teacher embeddings (and mined hard negatives) in the shards.

``run`` is the command (``python -m pipeline teacher``), ``negatives`` the hard-negative mining over
the whole shard set, ``identity`` what names a teacher (manifest record, hash, the trainer's check).
"""
