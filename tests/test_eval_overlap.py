"""The scored sets stay zero-shot: no sentence the main job trains on occurs in an evaluation file.

The main job (launch/run_sample.sh) preprocesses the bundled corpus and distils on every sentence of
it; the model card and the README call its five STS scores zero-shot. This test builds the same shards
and compares every kept sentence, and every text of the bundled pair collections, with every sentence
of the bundled evaluation files (all splits of the five scored sets, STS-B's train and valid too), by
:func:`pipeline.normalize.normalize_text` (spacing, width, case and punctuation ignored).

The labelled files the other configs train on go through ``pipeline decontaminate``
(:mod:`pipeline.data.eval_overlap`): its drop counts are checked exactly on a small fixture, and every
file a shipped config in launch/configs/ names is checked here, the labelled ones by running the command
their config's header gives on the shared file.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.normalize import normalize_text
from pipeline.shards import read_shard, shard_paths

REPO = Path(__file__).resolve().parent.parent
RESOURCES = REPO / "pipeline" / "resources"
# The five scored sets, every split the repository holds (a pair file: sentence1, sentence2, label).
SCORED = ("ATEC.test", "BQ.dev", "LCQMC.dev", "PAWSX.dev", "STS-B.train", "STS-B.valid", "STS-B.test")
MAIN_JOB_CORPUS = ("peoples_daily_199801.txt", "taobao_dialogues.jsonl")


def eval_keys() -> dict[str, str]:
    """Every evaluation sentence's key -> the file it came from."""
    keys: dict[str, str] = {}
    for name in SCORED:
        with open(RESOURCES / "eval" / f"{name}.tsv", encoding="utf-8") as f:
            for line in f:
                for text in line.rstrip("\n").split("\t")[:2]:
                    keys.setdefault(normalize_text(text), name)
    keys.pop("", None)
    return keys


def overlap(texts: set[str], keys: dict[str, str]) -> list[tuple[str, str]]:
    return sorted((text, keys[text]) for text in texts if text in keys)


def test_eval_keys_are_read():
    keys = eval_keys()
    # 47,852 pairs; many sentences repeat across pairs, so fewer keys than 2 x pairs but tens of thousands
    assert len(keys) > 40_000
    assert set(keys.values()) == set(SCORED)


def test_main_job_training_sentences_do_not_occur_in_the_evaluation_sets(tmp_path):
    out = tmp_path / "shards"
    corpus = [str(RESOURCES / "corpus" / name) for name in MAIN_JOB_CORPUS]
    cmd = [sys.executable, "-m", "pipeline", "preprocess", *corpus, "--out", str(out),
           "--sentences_per_shard", "8000", "--rows_per_block", "1000", "--progress", "false"]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    kept = {normalize_text(text) for path in shard_paths(out) for table in read_shard(path)
            for text in table.column("text").to_pylist()}  # fmt: skip
    assert len(kept) > 60_000  # the whole sample, not an empty or truncated run
    assert overlap(kept, eval_keys()) == []


def test_bundled_pair_collections_do_not_occur_in_the_evaluation_sets():
    """The pair stage's bundled sample (titles, questions, answers, translations) is training text too:
    each field whole and each of its lines."""
    keys = eval_keys()
    texts: set[str] = set()
    for path in sorted((RESOURCES / "corpus" / "pairs").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                fields = [v for v in record.values() if isinstance(v, str)]
                texts.update(normalize_text(part) for v in fields for part in (v, *v.splitlines()))
    texts.discard("")
    assert len(texts) > 1_000
    assert overlap(texts, keys) == []


def test_overlap_finds_a_planted_sentence():
    keys = eval_keys()
    planted = next(iter(keys))
    assert overlap({planted, "这句话不在任何评测集里出现过的样子吧"}, keys) == [(planted, keys[planted])]


# ---------------------------------------------------------------------- the filter (pipeline decontaminate)
def _eval_fixture(folder: Path) -> Path:
    """A small evaluation folder: one split file of each scored set, STS-B with two splits."""
    folder.mkdir()
    rows = {
        "ATEC.test": ["花呗怎么还款\t花呗如何还钱\t1"],
        "BQ.dev": ["借款可以提前还吗\t能提前还款吗\t1"],
        "LCQMC.dev": ["今天天气怎么样\t今天天气好吗\t1"],
        "PAWSX.dev": ["他出生在北京\t他在北京出生\t1"],
        "STS-B.train": ["一个男人在弹吉他\t一个人在弹奏乐器\t4"],
        "STS-B.test": ["一只猫在睡觉\t猫睡着了\t5"],
    }
    for name, lines in rows.items():
        (folder / f"{name}.tsv").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return folder


def test_filter_drops_exactly_the_records_with_an_evaluation_sentence(tmp_path, monkeypatch):
    from pipeline.cli import main as cli_main
    from pipeline.data.eval_overlap import eval_index, report_path

    eval_dir = _eval_fixture(tmp_path / "eval")
    records = [  # a CBLUE array (CHIP-STS's keys): the form the shared labelled files come in
        {"id": "1", "text1": "糖尿病能吃西瓜吗", "text2": "糖尿病人可以吃西瓜吗", "label": "1"},
        {"id": "2", "text1": "花呗怎么还款？", "text2": "头疼怎么办", "label": "0"},  # ATEC (the ？ aside)
        {"id": "3", "text1": "高血压吃什么药", "text2": "一只猫 在睡觉", "label": "0"},  # STS-B.test
        {"id": "4", "text1": "今天天气怎么样", "text2": "一个男人在弹吉他", "label": "0"},  # 2 splits
        {"id": "5", "text1": "感冒发烧怎么办", "text2": "发烧了怎么处理", "label": "1"},
    ]
    src = tmp_path / "CHIP-STS_train.json"
    src.write_text(json.dumps(records, ensure_ascii=False, indent=1), encoding="utf-8")
    out = tmp_path / "labels" / "chip_sts.tsv"
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # what the command line sets for any command
    assert cli_main(["decontaminate", str(src), "--out", str(out), "--eval_dir", str(eval_dir)]) == 0

    kept = out.read_text(encoding="utf-8").splitlines()
    assert kept == ["糖尿病能吃西瓜吗\t糖尿病人可以吃西瓜吗\t1", "感冒发烧怎么办\t发烧了怎么处理\t1"]
    counts = json.loads(report_path(out).read_text(encoding="utf-8"))
    assert (counts["read"], counts["kept"], counts["dropped"]) == (5, 2, 3)
    assert counts["dropped_by_split"] == {"ATEC.test": 1, "LCQMC.dev": 1, "STS-B.test": 1, "STS-B.train": 1}
    keys = eval_index(eval_dir)
    left = {normalize_text(t) for line in kept for t in line.split("\t")[:2]}
    assert not left & keys.keys()


def test_filter_reads_triples_and_refuses_an_evaluation_folder_missing_a_set(tmp_path):
    from pipeline.data.eval_overlap import eval_index, filter_records, read_labelled
    from pipeline.errors import InputError

    eval_dir = _eval_fixture(tmp_path / "eval")
    src = tmp_path / "t.tsv"
    src.write_text("甲乙丙\t借款可以提前还吗\t丁戊己\n甲乙丙\t庚辛壬\t丁戊己\n", encoding="utf-8")
    kept, report = filter_records(read_labelled(src, triples=True), eval_index(eval_dir))
    assert [r.positive for r in kept] == ["庚辛壬"] and report.dropped_by_split == {"BQ.dev": 1}
    (eval_dir / "PAWSX.dev.tsv").unlink()
    with pytest.raises(InputError, match="holds no split file of PAWSX"):
        eval_index(eval_dir)


def test_the_bundled_sts_b_train_split_is_dropped_whole(tmp_path):
    """The split cosent.yaml and sbert.yaml used to train on: nothing of it survives the filter."""
    from pipeline.data.eval_overlap import eval_index, filter_records, read_labelled

    sts_b_train = read_labelled(RESOURCES / "eval" / "STS-B.train.tsv")
    kept, report = filter_records(sts_b_train, eval_index(RESOURCES / "eval"))
    assert kept == [] and report.dropped == report.read > 5_000


# ----------------------------------------------------------------- every shipped config's training files
CONFIGS = sorted((REPO / "launch" / "configs").glob("*.yaml"))
# Shard sets the configs name: launch/run_sample.sh (and the pair commands in pairs_distill.yaml's header)
# build them from the bundled corpus, whose every sentence the two tests above check.
BUNDLED_SHARDS = {f"runs/sample/{name}" for name in ("augmented", "teacher", "tokenized", "pairs-teacher")}
# The labelled files (CHIP-STS, KUAKE-QQR: licence none stated) are not in the project; the configs read
# them from ../shared/data/pairs beside the project root, through the command their header gives.
SHARED_PAIRS = Path(os.environ.get("PIPELINE_PAIRS_DIR", REPO.parent / "shared" / "data" / "pairs"))
COMMAND = re.compile(r"python -m pipeline decontaminate (\S+)(?: --triples)? --out (\S+)")
# Shard sets built from the user's own data by a stage that drops scored-set sentences by default
# (``exclude_eval``): the cluster chain's preprocess (README's "On a GPU cluster") and ``pipeline pairs
# --format`` on the user's pair file (byo_pairs.yaml's header). Checked: the stage's default is on and no
# command that builds them turns it off.
USER_SHARDS = {
    "runs/cluster/tokenized": ("pipeline.stages.preprocess.run", REPO / "README.md"),
    "runs/my-pairs/shards": ("pipeline.stages.pairs.run", None),
}
EXCLUDE_OFF = re.compile(r"--exclude_eval[= ](false|no|0)\b", re.IGNORECASE)


def _training_files(config: Path) -> list[tuple[str, str]]:
    import yaml

    data = yaml.safe_load(config.read_text(encoding="utf-8")).get("data") or {}
    return [(key, str(data[key])) for key in ("shards", "supervised_file") if data.get(key)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_trains_on_files_free_of_the_evaluation_sets(config, tmp_path):
    """Each file a config trains on is either built from the bundled corpus (checked above) or the output
    of the `pipeline decontaminate` command the config's own header gives; that command is run here (on
    the shared labelled file) and what it writes overlaps the evaluation sets in no sentence."""
    keys = eval_keys()
    for key, name in _training_files(config):
        if key == "shards" and name in USER_SHARDS:
            import importlib

            module, doc = USER_SHARDS[name]
            stage = importlib.import_module(module).Config
            assert stage.__dataclass_fields__["exclude_eval"].default is True, f"{module}: exclude_eval off"
            for text in (config.read_text(encoding="utf-8"), doc.read_text(encoding="utf-8") if doc else ""):
                assert not EXCLUDE_OFF.search(text), f"{config.name}: a command that builds {name} keeps eval"
            continue
        if key == "shards":
            assert name in BUNDLED_SHARDS, f"{config.name}: data.shards {name} is not from the bundled corpus"
            continue
        assert not (REPO / name).resolve().is_relative_to(RESOURCES / "eval"), f"{config.name}: {name}"
        commands = {out: src for src, out in COMMAND.findall(config.read_text(encoding="utf-8"))}
        assert name in commands, f"{config.name}: no `pipeline decontaminate ... --out {name}` in its header"
        src = commands[name]
        # the header's source: the shared copy, the user's download of a shared file (the same name), or
        # a placeholder for the user's own file (sup_simcse's NLI triples)
        source = SHARED_PAIRS / (src.removeprefix("../shared/data/pairs/") if src.startswith("../shared/")
                                 else Path(src).name)  # fmt: skip
        if not src.startswith("../shared/data/pairs/") and Path(src).stem.isupper():
            continue  # a placeholder for the user's own file
        if not source.is_file():
            pytest.skip(f"{source} is not here (set PIPELINE_PAIRS_DIR to the shared pairs folder)")
        out = tmp_path / Path(name).name
        cmd = [sys.executable, "-m", "pipeline", "decontaminate", str(source), "--out", str(out)]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
        texts = {normalize_text(t) for line in out.read_text(encoding="utf-8").splitlines()
                 for t in line.split("\t")[:2]}  # fmt: skip
        assert len(texts) > 1_000 and overlap(texts, keys) == []
