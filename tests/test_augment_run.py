"""`python -m pipeline augment`: output format, determinism across workers/tasks/restarts, bad input."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.cli import build_config
from pipeline.errors import ConfigError, InputError
from pipeline.io import atomic_write_json, sha256_file
from pipeline.resources import SAMPLE_CORPUS
from pipeline.shards import (
    BASE_SCHEMA,
    new_manifest,
    read_manifest,
    read_shard,
    sentence_id,
    shard_name,
    write_shard,
)
from pipeline.stages.augment.run import WORK_DIR, Config
from pipeline.stages.augment.run import run as augment

REPO = Path(__file__).resolve().parents[1]


def corpus_sentences(n: int, skip: int = 0) -> list[str]:
    """Distinct sentences of the bundled corpus, split on 。 (what preprocess would hand us)."""
    seen, out = set(), []
    with open(SAMPLE_CORPUS, encoding="utf-8") as f:
        for line in f:
            for s in re.split(r"(?<=。)", line.strip()):
                if len(s) >= 4 and s not in seen:
                    seen.add(s)
                    out.append(s)
                    if len(out) == n + skip:
                        return out[skip:]
    return out[skip:]


def make_input(directory: Path, sentences: list[str], num_shards: int, rows_per_block: int) -> Path:
    directory.mkdir(parents=True)
    per_shard = -(-len(sentences) // num_shards)
    entries = []
    for k in range(num_shards):
        part = sentences[k * per_shard : (k + 1) * per_shard]
        blocks = [
            pa.table(
                {
                    "id": pa.array([sentence_id(s) for s in chunk], pa.uint64()),
                    "text": chunk,
                    "source": ["plain"] * len(chunk),
                },
                schema=BASE_SCHEMA,
            )
            for chunk in (part[b : b + rows_per_block] for b in range(0, len(part), rows_per_block))
        ]
        entries.append(write_shard(directory / shard_name(k), blocks, k))
    atomic_write_json(directory / "manifest.json", new_manifest("preprocess", {"test": True}, entries))
    return directory


def augment_cfg(shards: Path, out: Path, **kw) -> Config:
    return Config(shards=shards, out=out, progress=False, **kw)


def output_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def small_input(tmp_path_factory):
    return make_input(tmp_path_factory.mktemp("aug") / "in", corpus_sentences(360), 3, 50)


@pytest.fixture(scope="module")
def reference(small_input, tmp_path_factory):
    out = tmp_path_factory.mktemp("aug") / "ref"
    augment(augment_cfg(small_input, out))
    return out


def test_output_keeps_rows_and_blocks_and_adds_variants(small_input, reference):
    manifest = read_manifest(reference)
    in_manifest = read_manifest(small_input)
    assert manifest["stage"] == "augment"
    assert [e["name"] for e in manifest["shards"]] == [e["name"] for e in in_manifest["shards"]]
    assert manifest["input_manifest_sha256"] == sha256_file(small_input / "manifest.json")
    assert manifest["config"]["num_variants"] == 4 and manifest["config"]["ops"] == ["sr", "ri", "rs", "rd"]
    assert not (reference / WORK_DIR).exists()
    counts = manifest["counts"]
    variants = short = 0
    by_op = dict.fromkeys(("sr", "ri", "rs", "rd"), 0)
    for entry, in_entry in zip(manifest["shards"], in_manifest["shards"]):
        out_blocks = list(read_shard(reference / entry["name"]))
        in_blocks = list(read_shard(small_input / in_entry["name"]))
        assert [b.num_rows for b in out_blocks] == [b.num_rows for b in in_blocks]
        assert entry["sha256"] == sha256_file(reference / entry["name"])
        for out_block, in_block in zip(out_blocks, in_blocks):
            assert out_block.select(["id", "text", "source"]).equals(in_block)
            assert out_block.schema.field("variants").type == pa.list_(pa.string())
            for text, vs, ops in zip(
                out_block.column("text").to_pylist(),
                out_block.column("variants").to_pylist(),
                out_block.column("variant_ops").to_pylist(),
            ):
                assert len(vs) == len(ops) <= 4
                assert text not in vs and all(v.strip() for v in vs) and len(set(vs)) == len(vs)
                variants += len(vs)
                short += len(vs) < 4
                for spec in ops:
                    for op in spec.split("+"):
                        by_op[op] += 1
    assert counts["sentences"] == 360 == manifest["totals"]["sentences"]
    assert counts["variants"] == variants > 3 * 360
    assert counts["short"] == short
    assert counts["by_op"] == by_op


def test_two_workers_give_identical_bytes(small_input, reference, tmp_path):
    out = tmp_path / "w2"
    augment(augment_cfg(small_input, out, workers=2))
    assert output_files(out) == output_files(reference)


def test_array_tasks_write_manifest_when_last_finishes(small_input, reference, tmp_path):
    out = tmp_path / "tasks"
    augment(augment_cfg(small_input, out, task_index=1, num_tasks=2))
    assert not (out / "manifest.json").exists()
    assert sorted(p.name for p in out.glob("*.tar")) == ["shard-000001.tar"]
    with pytest.raises(InputError, match="not finished"):
        augment(augment_cfg(small_input, out, finalize_only=True))
    augment(augment_cfg(small_input, out, task_index=0, num_tasks=2))
    assert output_files(out) == output_files(reference)


def test_rerun_is_a_noop_and_a_different_config_is_refused(small_input, reference, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in reference.iterdir()}
    augment(augment_cfg(small_input, reference))
    assert {p.name: p.stat().st_mtime_ns for p in reference.iterdir()} == before
    with pytest.raises(InputError, match="different config"):
        augment(augment_cfg(small_input, reference, seed=1))


def test_seed_changes_variants(small_input, reference, tmp_path):
    out = tmp_path / "seed1"
    augment(augment_cfg(small_input, out, seed=1))
    assert (out / "shard-000000.tar").read_bytes() != (reference / "shard-000000.tar").read_bytes()


def test_corrupted_input_shard_is_named(small_input, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in small_input.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    data = bytearray((bad / "shard-000001.tar").read_bytes())
    data[700] ^= 0xFF
    (bad / "shard-000001.tar").write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"shard .*shard-000001\.tar fails its sha256 check"):
        augment(augment_cfg(bad, tmp_path / "out"))
    with pytest.raises(InputError, match=r"shard-000001\.tar fails its sha256 check"):  # same from a worker
        augment(augment_cfg(bad, tmp_path / "out", workers=2))


def test_cli_reports_bad_input_in_one_line(small_input, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "augment",
            "--shards",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("error: ")
        and "manifest.json not found" in proc.stderr
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-variants=0"], "num_variants must be >= 1"),
        (["--alpha-sr=0"], r"alpha_sr must be in \(0, 1\]"),
        (["--ops=[sr, xx]"], "unknown EDA operation 'xx'"),
        (["--mix=sample", "--ops=[sr, rd]", "--op-weights=[1]"], "op_weights has 1 entries for 2 ops"),
        (["--op-weights=[1, 1, 1, 1]"], "only apply to --mix sample"),
        (["--synonyms=vectors"], "needs --synonyms-path"),
        (["--task-index=2", "--num-tasks=2"], r"task_index must be in \[0, num_tasks\)"),
        (["--synonyms=wordnet"], "'wordnet' is not one of"),
    ],
)
def test_bad_config_raises_config_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        build_config(Config, ["--shards=in", "--out=out", *argv])


@pytest.mark.slow
def test_kill_9_and_rerun_gives_the_clean_shards(tmp_path):
    shards = make_input(tmp_path / "in", corpus_sentences(3000, skip=400), 12, 125)
    clean = tmp_path / "clean"
    augment(augment_cfg(shards, clean))
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "pipeline", "augment", "--shards", str(shards), "--out", str(out)]
    proc = subprocess.Popen(cmd + ["--progress=false"], cwd=REPO, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300  # liveness only: start-up alone can take a minute on a loaded machine
    while not list((out / WORK_DIR).glob("shard-*.json")) and time.monotonic() < deadline:
        assert proc.poll() is None, "augment ended before it could be killed"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "killed too late to test a restart"
    done = len(list((out / WORK_DIR).glob("shard-*.json")))
    assert 1 <= done < 12
    subprocess.run(cmd + ["--progress=false"], cwd=REPO, check=True, stderr=subprocess.DEVNULL)
    assert output_files(out) == output_files(clean)
    assert json.loads((out / "manifest.json").read_text())["counts"]["sentences"] == 3000
