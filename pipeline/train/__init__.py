"""Training: config, data-to-loss loop, schedule, queue + momentum encoder, checkpointing, signals.

Entry points: ``python -m pipeline train`` (:mod:`pipeline.train.run`) and ``launch/pretrain.py``.
"""
