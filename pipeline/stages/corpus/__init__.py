"""What the corpus stages (``preprocess``, ``pairs``: raw corpus files -> shards) share: the readers
(input files, work units, formats), near-duplicate detection, the work directory's files and the
writer of pass 1 (``passes``), and the template that runs a stage's three passes and finalize
(``template``: options and their checks, the plan, the phases, the worker pool, resume and SLURM
array splitting). A corpus stage adds what a row is and how each pass makes its rows.
"""
