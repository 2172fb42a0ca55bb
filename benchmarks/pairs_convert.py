"""Convert the real pair files of ../shared/data/pairs/ into nlp_chinese_corpus's own JSON-lines formats.

So the pairs stage's real readers (``pipeline/stages/corpus/readers.py``) and extractors
(``pipeline/stages/pairs/extract.py``) read them as they would the collections:

==============================================  ==================  =========================================
file (in ../shared/data/pairs/)                  written as          mapping
==============================================  ==================  =========================================
cctv_news_title_lead_body.jsonl.gz (MIT code)    news2016zh          title; desc = lead; content = body;
                                                                     source = "cctv"; time = date
baidu_hot_query_desc.jsonl.gz (none stated)      baike2018qa         title = query; answer = desc;
                                                                     category = "百度热搜"
toyhom_medical_qa_sample.csv (MIT)               baike2018qa         category = department; title; desc = ask;
                                                                     answer
KUAKE-QTR_train.json (none stated)               webtext2019zh       one qid per query; title = query; each
                                                                     page title graded >= 2 is an answer
                                                                     (content); topic = "医疗搜索"
tatoeba_cmn-eng.txt (CC-BY 2.0 FR)               translation2019zh   english, chinese, attribution kept
CSL_ts_dev.tsv, CSL_ts_test.tsv (Apache-2.0)     wiki_zh             title = paper title; text = title line +
                                                                     abstract (the first paragraph)
LCCC-base_test.json (research use; --only)       webtext2019zh       title = a Weibo post; content = its first
                                                                     reply; topic = "微博"
==============================================  ==================  =========================================

``--bundle DIR`` writes the small sample the project may carry (only the MIT, Apache-2.0 and CC-BY
files: toyhom, tatoeba, CSL; the CCTV text is CCTV's, so it is left out) as gzip files with their
records chosen by a seeded shuffle, after dropping every record one of whose texts (a whole field or
any sentence of it, under ``normalize_text``) occurs in an evaluation set (pipeline/resources/eval/
and ../shared/data/eval/). It prints the counts.

    .venv/bin/python benchmarks/pairs_convert.py --out /tmp/pairs_corpus
    .venv/bin/python benchmarks/pairs_convert.py --bundle pipeline/resources/corpus/pairs
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import io
import json
import random
import re
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.normalize import normalize_text  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
PAIRS = SHARED / "pairs"
EVAL_DIRS = (REPO / "pipeline" / "resources" / "eval", SHARED / "eval")
BUNDLE_COUNTS = {"baike2018qa_toyhom_medical": 800, "translation2019zh_tatoeba": 1500, "wiki_zh_csl": 300}


def _id(*parts: str) -> str:
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=6).hexdigest()


def cctv() -> Iterator[dict]:
    with gzip.open(PAIRS / "cctv_news_title_lead_body.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            yield {
                "news_id": _id("cctv", r["date"], r["title"]),
                "keywords": "",
                "title": r["title"],
                "desc": r["lead"],
                "source": "cctv",
                "time": r["date"],
                "content": r["body"],
            }


def baidu_hot() -> Iterator[dict]:
    with gzip.open(PAIRS / "baidu_hot_query_desc.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            yield {"qid": _id("baidu", r["query"]), "category": "百度热搜", "title": r["query"], "desc": "",
                   "answer": r["desc"]}  # fmt: skip


def toyhom() -> Iterator[dict]:
    with open(PAIRS / "toyhom_medical_qa_sample.csv", encoding="utf-8", newline="") as f:
        for i, r in enumerate(csv.DictReader(f)):
            yield {"qid": f"toyhom_{i}", "category": r["department"], "title": r["title"], "desc": r["ask"],
                   "answer": r["answer"]}  # fmt: skip


def kuake_qtr(min_label: int = 2) -> Iterator[dict]:
    rows = json.loads((PAIRS / "KUAKE-QTR_train.json").read_text(encoding="utf-8"))
    by_query: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if int(r["label"]) >= min_label:
            by_query[r["query"]].append(r)
    for n, (query, answers) in enumerate(by_query.items()):
        for a in answers:
            yield {"qid": n, "title": query, "desc": "", "topic": "医疗搜索", "star": int(a["label"]),
                   "content": a["title"], "answer_id": a["id"]}  # fmt: skip


def lccc() -> Iterator[dict]:
    """Weibo post -> its first reply (LCCC-base test: research use, not bundled), characters spaced
    as the source has them: the cleaner's whitespace rule removes the spaces."""
    dialogues = json.loads((PAIRS / "LCCC-base_test.json").read_text(encoding="utf-8"))
    for n, turns in enumerate(dialogues):
        if len(turns) >= 2:
            yield {"qid": f"lccc_{n}", "title": turns[0], "desc": "", "topic": "微博", "star": 0,
                   "content": turns[1], "answer_id": f"lccc_{n}_1"}  # fmt: skip


def tatoeba() -> Iterator[dict]:
    with open(PAIRS / "tatoeba_cmn-eng.txt", encoding="utf-8-sig") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 3:
                yield {"english": parts[0], "chinese": parts[1], "attribution": parts[2]}


def csl() -> Iterator[dict]:
    for name in ("CSL_ts_dev.tsv", "CSL_ts_test.tsv"):
        with open(PAIRS / name, encoding="utf-8") as f:
            for line in f:
                _, abstract, title = line.rstrip("\n").split("\t")
                yield {"id": f"csl_{_id(title)}", "url": "", "title": title, "text": f"{title}\n\n{abstract}"}


CONVERTERS = {
    "news2016zh_cctv": cctv,
    "baike2018qa_baidu_hot": baidu_hot,
    "baike2018qa_toyhom_medical": toyhom,
    "webtext2019zh_kuake_qtr": kuake_qtr,
    "translation2019zh_tatoeba": tatoeba,
    "wiki_zh_csl": csl,
}
# converted on request only (--only): not part of the benchmark corpus that docs/pairs.md measures
EXTRA = {"webtext2019zh_lccc": lccc}
TEXT_FIELDS = ("title", "desc", "answer", "content", "chinese", "english", "text")
_SENTENCES = re.compile(r"[^。！？!?；;\n]+[。！？!?；;]?")


def eval_keys() -> set[str]:
    """normalize_text of every sentence of every evaluation file (each text column of each line)."""
    keys: set[str] = set()
    for directory in EVAL_DIRS:
        for path in sorted(directory.rglob("*.tsv")):
            for line in path.read_text(encoding="utf-8").splitlines():
                for column in line.split("\t"):
                    key = normalize_text(column)
                    if len(key) >= 2 and not key.isdigit():
                        keys.add(key)
    return keys


def overlaps(record: dict, keys: set[str]) -> bool:
    """True if a whole text field, or a sentence of one, equals an evaluation text under normalize_text."""
    for name in TEXT_FIELDS:
        value = record.get(name)
        if not isinstance(value, str):
            continue
        if normalize_text(value) in keys:
            return True
        if any(normalize_text(s) in keys for s in _SENTENCES.findall(value)):
            return True
    return False


def write_jsonl(path: Path, records: list[dict], compress: bool) -> None:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    if compress:
        buffer = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as f:
            f.write(data)
        data = buffer.getvalue()
    path.write_bytes(data)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="write every converted file here (one per source)")
    parser.add_argument("--bundle", type=Path, help="write the bundled sample (MIT/Apache/CC-BY only) here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help=f"convert only these (also: {', '.join(EXTRA)})")
    args = parser.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        chosen = {**CONVERTERS, **EXTRA} if args.only else CONVERTERS
        for name, convert in chosen.items():
            if args.only and name not in args.only:
                continue
            records = list(convert())
            write_jsonl(args.out / f"{name}.json", records, compress=False)
            print(f"{name}: {len(records):,} records")
    if args.bundle:
        args.bundle.mkdir(parents=True, exist_ok=True)
        keys = eval_keys()
        print(f"evaluation texts: {len(keys):,}")
        for name, count in BUNDLE_COUNTS.items():
            records = list(CONVERTERS[name]())
            clean = [r for r in records if not overlaps(r, keys)]
            random.Random(args.seed).shuffle(clean)
            sample = clean[:count]
            path = args.bundle / f"{name}.jsonl.gz"
            write_jsonl(path, sample, compress=True)
            print(f"{name}: {len(records):,} records, {len(records) - len(clean):,} overlap an eval set "
                  f"(dropped), {len(sample):,} bundled, {path.stat().st_size:,} bytes")  # fmt: skip


if __name__ == "__main__":
    main()
