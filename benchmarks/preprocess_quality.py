"""Text quality of preprocess on a plain-text corpus: the issue-23 targets, this checkout vs a baseline.

    python benchmarks/preprocess_quality.py CLUECorpusSmall_bert_sampled.txt CLUECorpusSmall_sampled.txt \
        --baseline /tmp/base-checkout        # a checkout of an older commit (git worktree add ...)

Each file is read as plain lines (one paragraph per line), cleaned, split and filtered with the
default options by this checkout's ``pipeline.stages.preprocess.text`` and, with ``--baseline``, by the
baseline's (loaded from its file), and the kept sentences are checked for:

  markup        kept sentences with "-{", "}-", an HTML tag or an HTML entity
  leading       kept sentences that start with a closing mark, a comma or an enumeration comma
  empty         kept sentences with an empty bracket
  latin dropped low_cjk drops that are Chinese sentences with Latin words (>= 5 CJK characters and a
                Latin letter)
  non-Chinese   kept sentences with fewer than 2 CJK characters
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from pipeline.stages.preprocess import text as current

MARKUP = re.compile(r"-\{|\}-|<[A-Za-z/!][^<>]*>|&(?:#\d+|[A-Za-z]+);")
LEADING = tuple("，、,：:；;）)」』”’》】〕〗〉")
EMPTY = re.compile(r"[（(][\s，,、；;：:]*[）)]|「」|『』|【】|《》|“”")
CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
LATIN = re.compile(r"[A-Za-z\u00c0-\u024f]")


def load(repo: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "baseline_text", repo / "pipeline/stages/preprocess/text.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sentences_of(module: ModuleType, lines: list[str]) -> tuple[list[str], list[str], list[str]]:
    """All split sentences, the kept ones and the low_cjk drops (default filters: 5-256, 0.5)."""
    if hasattr(module, "Cleaner"):
        cleaner = module.Cleaner()
        paragraphs = [p for line in lines for p in cleaner.paragraphs(line)]
    else:
        paragraphs = module.clean_paragraphs(lines)
    split = [s for p in paragraphs for s in module.split_sentences(p)]
    batch = list(split)  # the current filter repairs brackets in place
    result = module.filter_sentences(batch, 5, 256, 0.5)
    kept = result[0]
    if len(result) >= 3:  # the drop masks
        low = [s for s, m in zip(batch, result[2]["low_cjk"].tolist(), strict=True) if m]
    else:
        kept_set = set(kept)
        low = [s for s in split if 5 <= len(s) <= 256 and s not in kept_set]
    return split, kept, low


def report(name: str, split: list[str], kept: list[str], low: list[str]) -> None:
    markup = sum(1 for s in kept if MARKUP.search(s))
    leading = sum(1 for s in kept if s.startswith(LEADING))
    empty = sum(1 for s in kept if EMPTY.search(s))
    latin = sum(1 for s in low if LATIN.search(s) and len(CJK.findall(s)) >= 5)
    non_chinese = sum(1 for s in kept if len(CJK.findall(s)) < 2)
    print(
        f"{name:<9} split {len(split):>7,} kept {len(kept):>7,} markup {markup:>4} leading {leading:>4} "
        f"empty {empty:>4} low_cjk {len(low):>5,} (Chinese with Latin {latin:>4}) "
        f"non-Chinese kept {non_chinese:>3}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument(
        "--baseline", type=Path, help="checkout whose pipeline/stages/preprocess/text.py to compare"
    )
    args = parser.parse_args()
    modules = [("current", current)] + ([("baseline", load(args.baseline))] if args.baseline else [])
    for path in args.files:
        lines = path.read_text(encoding="utf-8").splitlines()
        print(f"{path} ({len(lines):,} lines)")
        for name, module in modules:
            report(name, *sentences_of(module, lines))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
