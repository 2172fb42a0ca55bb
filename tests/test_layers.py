"""The package's layers point only down: every import of pipeline code, at module level or inside a
function, goes to a lower layer or stays inside its own package. The order is docs/DESIGN.md's
("Layers"); a new module gets a layer here, and an import that would run back up fails this test with
the file, the line and both layers named."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A unit is a top-level module or package of ``pipeline`` (pipeline.X).
LAYERS: list[tuple[str, ...]] = [
    ("pipeline", "pipeline.errors", "pipeline.distributed", "pipeline.progress"),  # no pipeline imports
    # + where and in what precision to compute
    ("pipeline.config", "pipeline.io", "pipeline.normalize", "pipeline.devices", "pipeline.precision"),
    ("pipeline.shards", "pipeline.vectors", "pipeline.run_layout", "pipeline.resources"),  # formats; data
    ("pipeline.model", "pipeline.stages", "pipeline.stages.runner"),  # the encoder; the stage runner
    ("pipeline.data", "pipeline.stages.corpus"),  # training batches; what the corpus stages share
    ("pipeline.losses",),  # loss terms: they read the model's rows and the typed batch (pipeline.data)
    ("pipeline.evaluate",),  # scoring
    ("pipeline.train",),  # the trainer: reads the stages' output through the formats, never the stages
    # the offline stages that build on the encoder, the data and the scores, and what uses the encoder
    (
        "pipeline.stages.preprocess",
        "pipeline.stages.decontaminate",
        "pipeline.stages.augment",
        "pipeline.stages.tokenize",
        "pipeline.stages.student",
    ),
    (
        "pipeline.export",
        "pipeline.search",
        "pipeline.similarity",
        "pipeline.finetune",
        "pipeline.stages.fetch",
        "pipeline.stages.pairs",
    ),
    ("pipeline.stages.teacher",),  # the teacher stage (encodes, mines)
    ("pipeline.shards_command", "pipeline.cli", "pipeline.doctor"),  # commands
    ("pipeline.__main__",),  # `python -m pipeline`
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """pipeline.X, or pipeline.stages.X for a stage (each stage is a unit of its own)."""
    parts = module.split(".")
    return ".".join(parts[:3] if parts[:2] == ["pipeline", "stages"] else parts[:2])


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def pipeline_imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) for every import of pipeline code in ``source`` (the text of ``module``),
    at any depth (inside functions too), relative imports resolved."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "pipeline"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "pipeline":
                continue
            # ``from pipeline import x`` imports the unit pipeline.x when x is one
            names = [f"{base}.{a.name}" for a in node.names] if base == "pipeline" else [base]
            found += [(node.lineno, name) for name in names]
    return sorted(found)


SOURCES = sorted((ROOT / "pipeline").rglob("*.py"))


def test_every_unit_has_a_layer():
    units = {unit_of(module_name(p)) for p in SOURCES}
    assert not units - LAYER.keys(), f"give these a layer in LAYERS: {sorted(units - LAYER.keys())}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    here = unit_of(module_name(path))
    wrong = []
    source = path.read_text(encoding="utf-8")
    for line, name in pipeline_imports(source, module_name(path), path.name == "__init__.py"):
        there = unit_of(name)
        if there not in LAYER:  # ``from pipeline import __version__`` and the like: the package itself
            there = "pipeline"
        if there != here and LAYER[there] >= LAYER[here]:
            where = f"{path.relative_to(ROOT)}:{line}"
            wrong.append(f"{where} imports {name} (layer {LAYER[there]}) from layer {LAYER[here]}")
    assert not wrong, "imports that do not point down:\n" + "\n".join(wrong)


def test_the_checker_sees_imports_inside_functions_and_relative_ones():
    source = "import os\n\ndef f():\n    from pipeline.cli import main\n\nfrom .text import x\n"
    found = pipeline_imports(source, "pipeline.stages.preprocess.run")
    assert found == [(4, "pipeline.cli"), (6, "pipeline.stages.preprocess.text")]
    assert LAYER[unit_of(found[0][1])] > LAYER["pipeline.stages.preprocess"]  # would be reported
