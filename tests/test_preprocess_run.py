import bz2
import gzip
import json
import logging
import os
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.cli import build_config, main
from pipeline.errors import ConfigError, InputError
from pipeline.resources import SAMPLE_CORPUS
from pipeline.shards import read_manifest, read_shard, sentence_id, verify_shard
from pipeline.stages.preprocess.run import Config, run
from pipeline.stages.preprocess.text import clean_paragraphs, split_sentences

REPO = Path(__file__).resolve().parents[1]
SENTENCE_REASONS = (
    "too_short", "too_long", "low_cjk", "title", "truncated", "eval_overlap", "duplicate", "near_duplicate"
)
RECORD_REASONS = ("empty", "invalid_utf8", "bad_json", "missing_field", "too_long_record", "unreadable")


def _sentence(tag: str, i: int) -> str:
    return f"这是{tag}集合里的第{i}个测试句子，内容足够长。"


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def write_corpus(root: Path) -> set[str]:
    """One small file per nlp_chinese_corpus format (+ plain), compressed several ways.

    Returns the sentences every run must keep."""
    root.mkdir(parents=True, exist_ok=True)
    expected = set()

    def s(tag, i):
        expected.add(_sentence(tag, i))
        return _sentence(tag, i)

    wiki = [
        {"id": str(i), "url": "u", "title": "标题", "text": f"标题\n\n{s('wiki', i)}\n{s('wiki', i + 100)}"}
        for i in range(20)
    ]
    news = [
        {
            "news_id": str(i),
            "keywords": "",
            "desc": "",
            "title": s("news", i),
            "source": "x",
            "time": "",
            "content": s("news", i + 100) + s("news", i + 200),
        }
        for i in range(20)
    ]
    baike = [
        {"qid": str(i), "category": "c", "title": s("baike", i), "desc": "", "answer": s("baike", i + 100)}
        for i in range(20)
    ]
    web = [
        {
            "qid": str(i),
            "title": s("web", i),
            "desc": s("web", i + 100),
            "topic": "",
            "star": 1,
            "content": s("web", i + 200),
            "answer_id": str(i),
            "answerer_tags": "",
        }
        for i in range(20)
    ]
    trans = [{"english": "This is a sentence.", "chinese": s("trans", i)} for i in range(20)]
    (root / "wiki_00").write_bytes(_jsonl(wiki))
    with gzip.open(root / "news.json.gz", "wb") as f:
        f.write(_jsonl(news))
    with bz2.open(root / "baike.json.bz2", "wb") as f:
        f.write(_jsonl(baike))
    with zipfile.ZipFile(root / "web_trans.zip", "w") as z:
        z.writestr("webtext2019zh/web_train.json", _jsonl(web))
        z.writestr("translation2019zh/trans_train.json", _jsonl(trans))
    plain = [s("plain", i) + s("plain", i + 100) for i in range(20)]
    # the same sentence in two files and twice in one: exact dedup across the corpus
    plain += [_sentence("wiki", 3), _sentence("plain", 0)]
    (root / "plain.txt").write_text("\n".join(plain) + "\n", encoding="utf-8")
    return expected


def read_rows(out: Path) -> list[dict]:
    manifest = read_manifest(out)
    rows = []
    for entry in manifest["shards"]:
        for table in read_shard(verify_shard(out, entry)):
            rows.extend(table.to_pylist())
    return rows


def out_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def cfg_for(inputs, out, **kw) -> Config:
    kw.setdefault("sentences_per_shard", 50)
    kw.setdefault("rows_per_block", 20)
    return Config(inputs=[Path(p) for p in inputs], out=Path(out), **kw)


def check_counts(manifest: dict) -> dict:
    counts = manifest["counts"]
    dropped = counts["dropped"]
    assert counts["kept"] == manifest["totals"]["sentences"]
    assert counts["sentences_split"] == counts["kept"] + sum(dropped[r] for r in SENTENCE_REASONS)
    assert counts["records"] == counts["records_with_text"] + sum(dropped[r] for r in RECORD_REASONS)
    return counts


def test_all_formats_end_to_end(tmp_path):
    expected = write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    assert run(cfg_for([tmp_path / "in"], out)) == 0
    manifest = read_manifest(out)
    rows = read_rows(out)
    texts = [r["text"] for r in rows]
    assert set(texts) == expected
    assert len(texts) == len(set(texts))  # exact dedup
    assert all(r["id"] == sentence_id(r["text"]) for r in rows)
    sources = {r["source"] for r in rows}
    assert sources == {"wiki_zh", "news2016zh", "baike2018qa", "webtext2019zh", "translation2019zh", "plain"}
    # the duplicate of a wiki sentence in plain.txt keeps the first source in SOURCES order
    assert {r["source"] for r in rows if r["text"] == _sentence("wiki", 3)} == {"wiki_zh"}
    counts = check_counts(manifest)
    assert counts["dropped"]["duplicate"] == 2
    # the wiki title lines ("标题") are headings, not sentences: counted as titles, not as too short
    assert (counts["dropped"]["title"], counts["dropped"]["too_short"]) == (20, 0)
    # globally shuffled: not in input order, and shards mix collections
    assert texts != sorted(texts, key=lambda t: (t.split("集合")[0], int(t.split("第")[1].split("个")[0])))
    assert len({r["source"] for r in read_rows_shard(out, 0)}) >= 4
    assert not (out / ".work").exists()
    assert manifest["totals"]["shards"] == len(manifest["shards"]) >= 6


def read_rows_shard(out, index):
    return [r for t in read_shard(out / f"shard-{index:06d}.tar") for r in t.to_pylist()]


def test_shards_readable_with_tarfile_and_pyarrow_only(tmp_path):
    run(cfg_for([SAMPLE_CORPUS], tmp_path / "out", sentences_per_shard=4000, rows_per_block=1000))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["totals"]["shards"] >= 8  # enough for ranks x loader workers on the sample
    with tarfile.open(tmp_path / "out" / "shard-000001.tar") as tar:
        names = tar.getnames()
        table = pa.ipc.open_file(pa.BufferReader(tar.extractfile(names[1]).read())).read_all()
    assert names[:2] == ["000001-000000.arrow", "000001-000001.arrow"]
    assert table.num_rows == 1000 and table.column_names == ["id", "text", "source"]
    assert "\u3000" not in table.column("text")[0].as_py()


def test_deterministic_whatever_workers_tasks_or_partitions(tmp_path):
    write_corpus(tmp_path / "in")
    inputs = [tmp_path / "in", SAMPLE_CORPUS]
    common = dict(chunk_bytes=1 << 20, sentences_per_shard=5000, rows_per_block=1000)
    run(cfg_for(inputs, tmp_path / "w1", **common))
    run(cfg_for(inputs, tmp_path / "w2", workers=2, **common))
    reference = out_bytes(tmp_path / "w1")
    assert len(reference) >= 9
    assert out_bytes(tmp_path / "w2") == reference
    # a SLURM-style array of 3 tasks per phase, phases one after another
    for phase in ("split", "dedup", "shards", "finalize"):
        for task in range(3):
            run(cfg_for(inputs, tmp_path / "t3", phase=phase, task_index=task, num_tasks=3, **common))
    assert out_bytes(tmp_path / "t3") == reference
    # the partition count only changes the work layout, not the output
    other = cfg_for(inputs, tmp_path / "p7", num_partitions=7, **common)
    run(other)
    assert out_bytes(tmp_path / "p7")["shard-000000.tar"] == reference["shard-000000.tar"]
    # another seed is another order of the same sentences
    run(cfg_for(inputs, tmp_path / "s1", seed=1, **common))
    assert out_bytes(tmp_path / "s1")["shard-000000.tar"] != reference["shard-000000.tar"]
    assert sorted(r["text"] for r in read_rows(tmp_path / "s1")) == sorted(
        r["text"] for r in read_rows(tmp_path / "w1")
    )


def test_phase_out_of_order_is_a_clear_error(tmp_path):
    write_corpus(tmp_path / "in")
    cfg = cfg_for([tmp_path / "in"], tmp_path / "out", phase="split", task_index=0, num_tasks=2)
    run(cfg)
    with pytest.raises(InputError, match=r"phase split is not finished .* run --phase split \(every task\)"):
        run(cfg_for([tmp_path / "in"], tmp_path / "out", phase="dedup"))


def test_bad_input_is_counted_and_good_records_survive(tmp_path, caplog):
    good = [{"id": str(i), "url": "u", "title": "t", "text": _sentence("good", i)} for i in range(12)]
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in good]
    bad = [
        b'{"id": "x", "url": "u", "text": "broken',  # line 4: bad JSON
        "这一行不是合法的UTF-8，".encode() + b"\xff\xfe" + "后面也是。".encode(),  # line 6
        json.dumps({"id": "y", "url": "u", "title": "t"}).encode(),  # line 8: no text field
        b"   ",  # line 10: blank
        b"x" * (10 << 20),  # line 12: a 10 MB line
        json.dumps({"id": "z", "url": "u", "text": "控制\x00字符\x07在这里出现了。"}).encode(),  # line 14
        b"[1, 2]",  # line 16: JSON but not an object
    ]
    # good records at lines 1-3, 5, 7, ..., 15, 17-19; the bad ones at the even lines 4-16
    ordered = lines[:3]
    for i, line in enumerate(bad):
        ordered += [line, lines[3 + i]]
    ordered += lines[3 + len(bad) :]
    path = tmp_path / "wiki_bad"
    path.write_bytes(b"\n".join(ordered) + b"\n")
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        run(cfg_for([path], out, input_format="wiki_zh"))
    texts = {r["text"] for r in read_rows(out)}
    assert {_sentence("good", i) for i in range(12)} <= texts
    assert "控制字符在这里出现了。" in texts  # control characters stripped, record kept
    counts = check_counts(read_manifest(out))
    dropped = counts["dropped"]
    assert (dropped["bad_json"], dropped["invalid_utf8"], dropped["missing_field"]) == (2, 1, 1)
    assert (dropped["empty"], dropped["too_long_record"], counts["control_chars"]) == (1, 1, 1)
    assert counts["records"] == 19
    assert f"{path}:4: bad_json" in caplog.text and f"{path}:6: invalid_utf8" in caplog.text

    with pytest.raises(InputError, match=rf"{path}:4: bad_json: .*--strict"):
        run(cfg_for([path], tmp_path / "strict", input_format="wiki_zh", strict=True))


def test_truncated_gzip_keeps_what_was_readable(tmp_path):
    data = gzip.compress("\n".join(_sentence("gz", i) for i in range(2000)).encode())
    path = tmp_path / "cut.txt.gz"
    path.write_bytes(data[: len(data) // 2])
    run(cfg_for([path], tmp_path / "out"))
    manifest = read_manifest(tmp_path / "out")
    assert manifest["counts"]["dropped"]["unreadable"] == 1
    assert 0 < manifest["counts"]["kept"] < 2000


def test_user_mistakes_are_one_line_errors(tmp_path, capsys):
    assert main(["preprocess", str(tmp_path / "nothing*.txt"), f"--out={tmp_path / 'o'}"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: no input matched")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert main(["preprocess", str(SAMPLE_CORPUS), f"--out={tmp_path / 'full'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not empty (holds notes.txt)" in err and "--overwrite" in err
    assert main(["preprocess", str(SAMPLE_CORPUS), "--min_cjk_ratio=2"]) == 2
    assert "min_cjk_ratio must be in [0, 1]" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="choose one --phase"):
        build_config(Config, ["x.txt", "--num_tasks=2"], "inputs")
    with pytest.raises(ConfigError, match=r"text_fields.wiki_zh is empty"):
        build_config(Config, ["x.txt", "--text_fields.wiki_zh=[]"], "inputs")


def test_rerun_finished_and_changed_config(tmp_path):
    write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    run(cfg_for([tmp_path / "in"], out))
    before = out_bytes(out)
    run(cfg_for([tmp_path / "in"], out))  # the same command again: nothing to do
    assert out_bytes(out) == before
    with pytest.raises(InputError, match="finished run with a different config"):
        run(cfg_for([tmp_path / "in"], out, min_chars=3))
    run(cfg_for([tmp_path / "in"], out, min_chars=3, overwrite=True))
    assert read_manifest(out)["config"]["min_chars"] == 3


def test_text_fields_override(tmp_path):
    write_corpus(tmp_path / "in")
    cfg = build_config(
        Config,
        [
            str(tmp_path / "in" / "news.json.gz"),
            f"--out={tmp_path / 'o'}",
            "--text_fields.news2016zh=[title]",
        ],
        "inputs",
    )
    run(cfg)
    assert {r["text"] for r in read_rows(tmp_path / "o")} == {_sentence("news", i) for i in range(20)}


@pytest.mark.parametrize(
    "kill_after, workers",
    [
        ("split/unit-000000.json", 1),
        ("split/unit-000004.json", 2),
        ("dedup/part-000001.json", 1),
        ("shards/shard-000002.json", 1),
        ("dedup/bucket-000003.json", 1),  # near-duplicate removal on (the bucket pieces of dedup)
    ],
)
def test_kill_9_then_rerun_equals_uninterrupted(tmp_path, kill_after, workers, caplog):
    args = [str(SAMPLE_CORPUS), "--chunk_bytes=65536", "--num_partitions=16", f"--workers={workers}"]
    if "bucket" in kill_after:
        args.append("--near_duplicates=true")
    clean = tmp_path / "clean"
    run(build_config(Config, [*args, f"--out={clean}"], "inputs"))

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "pipeline", "preprocess", *args, f"--out={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = out / ".work" / kill_after
    deadline = time.monotonic() + 300  # liveness only: start-up alone can take a minute on a loaded machine
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists() and not (out / "manifest.json").exists(), "the run was not stopped mid-way"

    with caplog.at_level(logging.INFO):
        run(build_config(Config, [*args, f"--out={out}"], "inputs"))
    assert "already done (skipped)" in caplog.text
    assert out_bytes(out) == out_bytes(clean)


def test_slurm_script_phases_equal_a_local_run(tmp_path):
    write_corpus(tmp_path / "in")
    options = ["--sentences_per_shard=50", "--rows_per_block=20"]
    script = REPO / "launch" / "slurm" / "preprocess.sbatch"
    out = tmp_path / "slurm"
    env = {**os.environ, "PYTHON": sys.executable, "PIPELINE_REPO": str(REPO)}
    for phase, tasks in [("split", 2), ("dedup", 2), ("shards", 2), ("finalize", 1)]:
        for task in range(tasks):
            task_env = {**env, "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": str(tasks)}
            cmd = ["bash", str(script), phase, str(out), str(tmp_path / "in"), *options]
            subprocess.run(cmd, env=task_env, check=True, capture_output=True)
    run(cfg_for([tmp_path / "in"], tmp_path / "local"))
    assert out_bytes(out) == out_bytes(tmp_path / "local")


def test_bom_lone_surrogates_and_unicode_line_breaks(tmp_path):
    records = [
        {"english": "a", "chinese": "第一句有字节顺序标记，应该保留。"},
        {"english": "b", "chinese": "孤立的代理\ud800字符会被删除。"},
        {"english": "c", "chinese": "段落分隔符\u2028后面是新的一段话"},
    ]
    path = tmp_path / "trans.json"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in records).encode())
    run(cfg_for([path], tmp_path / "out"))
    texts = {r["text"] for r in read_rows(tmp_path / "out")}
    assert texts == {
        "第一句有字节顺序标记，应该保留。",
        "孤立的代理字符会被删除。",
        "段落分隔符",
        "后面是新的一段话",
    }
    counts = check_counts(read_manifest(tmp_path / "out"))
    assert counts["control_chars"] == 1 and counts["dropped"]["bad_json"] == 0


def _near_duplicate_corpus(root: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """Plain lines: 40 distinct sentences of the bundled sample, and reposts of 20 of them (a tag
    added, or one character changed), spread over two files.

    Returns the sentences and the (sentence, repost) pairs."""
    root.mkdir(parents=True, exist_ok=True)
    sentences = [
        s
        for p in clean_paragraphs(SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()[:3000])
        for s in split_sentences(p)
        if 30 <= len(s) <= 80
    ][::50][:40]
    pairs = [(b, b[:-1] + "（转载自人民网）" + b[-1]) for b in sentences[:10]]
    pairs += [(b, b[:12] + ("甲" if b[12] != "甲" else "乙") + b[13:]) for b in sentences[10:20]]
    reposts = [r for _, r in pairs]
    (root / "a.txt").write_text("\n".join(sentences[:25] + reposts[:10]) + "\n", encoding="utf-8")
    (root / "b.txt").write_text("\n".join(sentences[25:] + reposts[10:]) + "\n", encoding="utf-8")
    return sentences, pairs


def test_near_duplicates_removed_counted_and_independent_of_the_work_layout(tmp_path):
    sentences, pairs = _near_duplicate_corpus(tmp_path / "in")
    assert len(set(sentences)) == 40
    common = dict(sentences_per_shard=7, rows_per_block=3, near_duplicates=True)
    run(cfg_for([tmp_path / "in"], tmp_path / "one", **common))
    manifest = read_manifest(tmp_path / "one")
    counts = check_counts(manifest)
    texts = {r["text"] for r in read_rows(tmp_path / "one")}
    assert all((a in texts) != (b in texts) for a, b in pairs)  # exactly one of each pair is kept
    assert set(sentences[20:]) <= texts  # no sentence without a repost is taken for one
    assert counts["dropped"]["near_duplicate"] == 20 and counts["kept"] == 40
    examples = manifest["audit"]["samples"]["near_duplicate"]
    assert len(examples) == 3
    assert all(e["dropped"] not in texts and e["duplicates"] in texts for e in examples)
    # a function of the texts and the seed: workers, array tasks and partitions change nothing
    reference = out_bytes(tmp_path / "one")
    run(cfg_for([tmp_path / "in"], tmp_path / "w2", workers=2, **common))
    assert out_bytes(tmp_path / "w2") == reference
    for phase in ("split", "dedup", "shards", "finalize"):
        for task in range(3):
            array = dict(phase=phase, task_index=task, num_tasks=3)
            run(cfg_for([tmp_path / "in"], tmp_path / "t3", **array, **common))
    assert out_bytes(tmp_path / "t3") == reference
    run(cfg_for([tmp_path / "in"], tmp_path / "p7", num_partitions=7, **common))
    tars = {k: v for k, v in out_bytes(tmp_path / "p7").items() if k.endswith(".tar")}
    assert tars == {k: v for k, v in reference.items() if k.endswith(".tar")}
    # off by default: every sentence and repost is kept
    run(cfg_for([tmp_path / "in"], tmp_path / "off", sentences_per_shard=7, rows_per_block=3))
    assert {r["text"] for r in read_rows(tmp_path / "off")} == set(sentences) | {r for _, r in pairs}


def test_near_duplicates_with_nothing_kept_and_bad_truncated_fields(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("短句。\n很短。\n", encoding="utf-8")
    run(cfg_for([path], tmp_path / "out", near_duplicates=True))  # every bucket empty
    counts = check_counts(read_manifest(tmp_path / "out"))
    assert counts["kept"] == 0 and counts["dropped"]["too_short"] == 2
    with pytest.raises(ConfigError, match=r"truncated_fields: 'content' is not collection.field"):
        build_config(Config, ["x.txt", "--truncated_fields=[content]"], "inputs")
