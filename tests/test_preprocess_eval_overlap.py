"""preprocess drops the sentences of the five scored sets (--exclude_eval, reason eval_overlap): counted
exactly, the rest kept, the same bytes for any worker count or array layout, off on request."""

import json
import shutil
from pathlib import Path

import pytest
from test_preprocess_run import cfg_for, check_counts, out_bytes, read_rows

from pipeline.cli import main
from pipeline.data.eval_overlap import eval_index
from pipeline.errors import InputError
from pipeline.normalize import normalize_text
from pipeline.resources import EVAL_DIR, SAMPLE_CORPUS
from pipeline.shards import read_manifest
from pipeline.stages.preprocess.run import Config, run

# Real sentences of the bundled evaluation files (first column), as they stand there ...
EVAL_LINES = {
    "LCQMC.dev": "开初婚未育证明怎么弄？",
    "STS-B.test": "一群男人在海滩上踢足球。",
    "ATEC.test": "借呗还款的账单日",
    "BQ.dev": "我的借贷额度，怎么减少了呢？",
    "STS-B.train": "一个人正把切碎的奶酪撒在比萨饼上。",
}
# ... and written differently (half-width punctuation, a space, none at all): the same normalize_text key.
VARIANTS = ["人和畜生的区别是什么!", "一个女人在测量 另一个女人的脚踝。", "这种图片是用什么软件制作的"]
QA_TITLES = ["花呗每月最低还款额，怎么计算", "三个人在下棋。"]  # ATEC test, STS-B train


def _own(i: int) -> str:
    return f"这是第{i}个和评测集无关的句子，内容足够长。"


def write_fixture(root: Path) -> tuple[list[str], int]:
    """A plain file and a baike2018qa file mixing own sentences with eval sentences. Returns the own
    sentences (all must be kept) and the number of eval sentences in it (all must be dropped)."""
    root.mkdir(parents=True)
    own = [_own(i) for i in range(40)]
    plain = own[:20] + list(EVAL_LINES.values()) + VARIANTS
    plain.append(EVAL_LINES["LCQMC.dev"] + own[20])  # two sentences on one line: split, then one dropped
    plain.append(EVAL_LINES["STS-B.test"])  # a second occurrence: eval_overlap again, not duplicate
    (root / "plain.txt").write_text("\n".join(plain) + "\n", encoding="utf-8")
    baike = [
        {"qid": str(i), "category": "c", "title": q, "desc": "", "answer": own[21 + i]}
        for i, q in enumerate([*QA_TITLES, own[30]])
    ]
    (root / "qa.json").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in baike), encoding="utf-8"
    )
    return own[:24] + [own[30]], len(EVAL_LINES) + len(VARIANTS) + 2 + len(QA_TITLES)


def test_fixture_sentences_are_what_they_claim():
    index = eval_index(EVAL_DIR)
    for split, line in EVAL_LINES.items():
        assert split in index[normalize_text(line)], (split, line)
    assert all(normalize_text(v) in index for v in VARIANTS + QA_TITLES)
    assert not any(normalize_text(_own(i)) in index for i in range(40))


def test_eval_sentences_dropped_counted_and_the_rest_kept(tmp_path):
    own, n_eval = write_fixture(tmp_path / "in")
    run(cfg_for([tmp_path / "in"], tmp_path / "on"))
    manifest = read_manifest(tmp_path / "on")
    counts = check_counts(manifest)
    assert counts["dropped"]["eval_overlap"] == n_eval == 12
    assert counts["dropped"]["duplicate"] == 0  # the repeated eval sentence counted once per occurrence
    assert sorted(r["text"] for r in read_rows(tmp_path / "on")) == sorted(own)
    samples = manifest["audit"]["samples"]["eval_overlap"]
    assert len(samples) == 3 and all(normalize_text(s) in eval_index(EVAL_DIR) for s in samples)
    assert manifest["config"]["exclude_eval"] is True

    # off: every eval sentence stays (the two that occur twice once each, their repeats duplicates)
    run(cfg_for([tmp_path / "in"], tmp_path / "off", exclude_eval=False))
    counts = check_counts(read_manifest(tmp_path / "off"))
    assert counts["dropped"]["eval_overlap"] == 0 and counts["dropped"]["duplicate"] == 2
    kept = {r["text"] for r in read_rows(tmp_path / "off")}
    assert set(own) < kept and len(kept) == len(own) + n_eval - 2
    assert set(EVAL_LINES.values()) <= kept


def test_the_same_bytes_for_any_workers_or_array_tasks(tmp_path):
    own, n_eval = write_fixture(tmp_path / "in")
    inputs = [tmp_path / "in", SAMPLE_CORPUS]  # the sample: several units, so two workers share them
    common = dict(chunk_bytes=1 << 20, sentences_per_shard=5000, rows_per_block=1000)
    run(cfg_for(inputs, tmp_path / "w1", **common))
    reference = out_bytes(tmp_path / "w1")
    assert read_manifest(tmp_path / "w1")["counts"]["dropped"]["eval_overlap"] == n_eval
    run(cfg_for(inputs, tmp_path / "w2", workers=2, **common))
    assert out_bytes(tmp_path / "w2") == reference
    for phase in ("split", "dedup", "shards", "finalize"):
        for task in range(2):
            run(cfg_for(inputs, tmp_path / "t2", phase=phase, task_index=task, num_tasks=2, **common))
    assert out_bytes(tmp_path / "t2") == reference
    # the sample alone shares no sentence with the eval sets: its shards are those of a run without it
    run(cfg_for([SAMPLE_CORPUS], tmp_path / "s_on", **common))
    run(cfg_for([SAMPLE_CORPUS], tmp_path / "s_off", exclude_eval=False, **common))
    on, off = out_bytes(tmp_path / "s_on"), out_bytes(tmp_path / "s_off")
    assert {k: v for k, v in on.items() if k.endswith(".tar")} == {
        k: v for k, v in off.items() if k.endswith(".tar")
    }
    assert read_manifest(tmp_path / "s_on")["counts"]["dropped"]["eval_overlap"] == 0


def test_an_eval_folder_without_a_scored_set_is_a_one_line_error(tmp_path, capsys):
    partial = tmp_path / "eval"
    partial.mkdir()
    for path in EVAL_DIR.glob("*.tsv"):
        if not path.name.startswith("PAWSX."):
            shutil.copy(path, partial / path.name)
    args = ["preprocess", str(SAMPLE_CORPUS), f"--out={tmp_path / 'o'}", f"--eval_dir={partial}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(partial) in err and "PAWSX" in err and "--eval_dir" in err
    assert not (tmp_path / "o").exists()
    # with the filter off the folder is not read
    Config(inputs=[SAMPLE_CORPUS], eval_dir=partial, exclude_eval=False)
    with pytest.raises(InputError, match="PAWSX"):
        Config(inputs=[SAMPLE_CORPUS], eval_dir=partial)


def test_a_resume_after_the_eval_files_changed_is_refused(tmp_path):
    own, n_eval = write_fixture(tmp_path / "in")
    evals = tmp_path / "eval"
    shutil.copytree(EVAL_DIR, evals)
    run(cfg_for([tmp_path / "in"], tmp_path / "out", eval_dir=evals, phase="split"))
    # an unchanged folder: the stopped run goes on, as without the rule
    run(cfg_for([tmp_path / "in"], tmp_path / "out", eval_dir=evals, phase="dedup"))
    with (evals / "STS-B.test.tsv").open("a", encoding="utf-8") as f:
        f.write(f"{own[0]}\t{own[1]}\t3\n")
    with pytest.raises(InputError, match=r"evaluation files of --eval_dir\) changed .* --overwrite"):
        run(cfg_for([tmp_path / "in"], tmp_path / "out", eval_dir=evals))
    run(cfg_for([tmp_path / "in"], tmp_path / "out", eval_dir=evals, overwrite=True))
    counts = read_manifest(tmp_path / "out")["counts"]
    assert counts["dropped"]["eval_overlap"] == n_eval + 2 and counts["kept"] == len(own) - 2
