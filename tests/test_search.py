"""Search: index build, queries, reduction, approximate indexes, restart by chunk, bad input."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _tiny_models import build_char_encoder

from pipeline.cli import main
from pipeline.errors import InputError
from pipeline.io import sha256_file
from pipeline.resources import SAMPLE_CORPUS
from pipeline.search import SearchIndex, backend
from pipeline.search.reduction import Reduction, fit_pca
from pipeline.shards import sentence_id

REPO = Path(__file__).resolve().parents[1]


def corpus_lines(n: int, skip: int = 0) -> list[str]:
    """Distinct sample-corpus sentences, cut to 40 characters."""
    out, seen = [], set()
    with open(SAMPLE_CORPUS, encoding="utf-8") as f:
        for line in itertools.islice(f, skip, None):
            text = line.strip()[:40]
            if text and text not in seen:
                seen.add(text)
                out.append(text)
            if len(out) == n:
                break
    return out


def build_tiny_model(directory: Path, hidden_size: int = 32, seed: int = 0) -> Path:
    return build_char_encoder(directory, corpus_lines(3000), hidden_size, 64, 64, seed, max_length=48)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def sentences(tmp_path_factory) -> Path:
    lines = corpus_lines(400)
    path = tmp_path_factory.mktemp("data") / "sentences.txt"
    # one blank line and one duplicate: both are counted, neither is indexed
    path.write_text("\n".join(lines[:200] + ["", lines[0]] + lines[200:]) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def flat_index(tiny_model, sentences, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("idx") / "flat"
    assert (
        main(["index", str(tiny_model), "--input", str(sentences), "--out", str(out), "--chunk-size", "64"])
        == 0
    )
    return out


@pytest.fixture(scope="module")
def loaded(flat_index) -> SearchIndex:
    return SearchIndex.load(flat_index, device="cpu")


def test_query_in_corpus_comes_back_first(loaded):
    queries = corpus_lines(400)[::37]
    results = loaded.search(queries, k=5)
    assert len(results) == len(queries)
    for query, hits in zip(queries, results):
        assert len(hits) == 5
        assert hits[0].text == query
        assert hits[0].id == sentence_id(query)
        assert hits[0].score == pytest.approx(1.0, abs=1e-4)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_manifest_counts_files_and_layout(flat_index):
    manifest = json.loads((flat_index / "manifest.json").read_text())
    assert manifest["counts"] == {"read": 402, "blank": 1, "duplicate": 1, "indexed": 400}
    assert manifest["index"]["type"] == "flat" and manifest["index"]["ntotal"] == 400
    assert manifest["embedding_dim"] == manifest["index_dim"] == 32
    assert manifest["reduction"] is None and not (flat_index / "reduction.npz").exists()
    assert set(manifest["files"]) == {"index.faiss", "corpus.parquet", "encoder.json"}
    for name, entry in manifest["files"].items():
        assert sha256_file(flat_index / name) == entry["sha256"]
    assert not (flat_index / ".work").exists()  # chunks are removed after a finished build


def test_search_cli_table_json_and_queries_file(flat_index, tmp_path, capsys):
    first, second = corpus_lines(400)[3], corpus_lines(400)[250]
    assert main(["search", str(flat_index), first, "-k", "3"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == f"query 1: {first}"
    rank, score, row_id, text = table[1].split(maxsplit=3)
    assert (rank, float(score), int(row_id), text) == (
        "1",
        pytest.approx(1.0, abs=1e-3),
        sentence_id(first),
        first,
    )
    assert len([line for line in table if line.strip()]) == 4

    queries = tmp_path / "q.txt"
    queries.write_text(f"{first}\n\n{second}\n", encoding="utf-8")
    assert main(["search", str(flat_index), "--queries-file", str(queries), "-k", "2", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["query"] for r in records] == [first, second]
    assert [r["hits"][0]["text"] for r in records] == [first, second]
    assert [h["rank"] for h in records[1]["hits"]] == [1, 2]


@pytest.mark.parametrize("kind", ["pca", "whitening"])
def test_reduction_is_stored_and_applied_to_queries(kind, tiny_model, sentences, tmp_path):
    out = tmp_path / kind
    argv = ["index", str(tiny_model), "--input", str(sentences), "--out", str(out), "--reduce", kind]
    assert main(argv + ["--reduce-dim", "8"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["index_dim"] == 8 and manifest["embedding_dim"] == 32
    assert manifest["reduction"] == {"kind": kind, "dim": 8, "fit_rows": 400, "file": "reduction.npz"}
    reduction = Reduction.load(out / "reduction.npz")
    assert (reduction.kind, reduction.in_dim, reduction.dim) == (kind, 32, 8)

    index = SearchIndex.load(out, device="cpu")
    assert index.index.d == 8
    query = corpus_lines(400)[123]
    vector = index.embed([query])
    assert vector.shape == (1, 8)
    raw = index.encoder.encode([query])
    np.testing.assert_allclose(vector, reduction.apply(raw), atol=1e-6)
    assert index.search([query], k=1)[0][0].text == query


def test_pca_directions_are_orthonormal_and_ordered():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 16)) * np.linspace(5, 0.1, 16)  # variance falls along the axes
    pca = fit_pca(x, 4)
    np.testing.assert_allclose(pca.matrix.T @ pca.matrix, np.eye(4), atol=1e-5)
    projected = (x - pca.mean) @ pca.matrix
    variances = projected.var(axis=0)
    assert list(variances) == sorted(variances, reverse=True)
    from sklearn.decomposition import PCA

    reference = PCA(n_components=4).fit(x).components_  # (4, 16), rows up to sign
    np.testing.assert_allclose(np.abs(pca.matrix.T), np.abs(reference), atol=1e-4)


def clustered_vectors(n: int, dim: int, clusters: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, dim))
    x = centers[rng.integers(clusters, size=n)] + 0.5 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def recall_at(k: int, exact: np.ndarray, approx: np.ndarray) -> float:
    return float(np.mean([len(set(e) & set(a)) / k for e, a in zip(exact, approx)]))


def test_ivf_and_hnsw_recall_against_exact():
    data = clustered_vectors(6000, 32, 50, seed=1)
    queries = clustered_vectors(6200, 32, 50, seed=1)[6000:]  # same clusters, rows not in the index
    flat, _ = backend.build_index("flat", 32, {}, None, [data], use_gpu=False)
    _, exact = flat.search(queries, 10)
    ivf, _ = backend.build_index(
        "ivf", 32, {"nlist": 64, "nprobe": 8}, data, [data[:3000], data[3000:]], False
    )
    hnsw, _ = backend.build_index(
        "hnsw", 32, {"hnsw_m": 16, "ef_construction": 80, "ef_search": 64}, None, [data], False
    )
    assert ivf.ntotal == hnsw.ntotal == 6000
    ivf_recall = recall_at(10, exact, ivf.search(queries, 10)[1])
    hnsw_recall = recall_at(10, exact, hnsw.search(queries, 10)[1])
    # Stated bounds for these settings (observed ~0.95 and ~0.99): far below means a broken build.
    assert ivf_recall >= 0.85, ivf_recall
    assert hnsw_recall >= 0.9, hnsw_recall
    backend.set_search_params(ivf, nprobe=64)  # visiting every list is exact
    assert recall_at(10, exact, ivf.search(queries, 10)[1]) == pytest.approx(1.0)


def test_ivf_and_hnsw_parameters_are_recorded_and_overridable(tiny_model, sentences, tmp_path):
    import faiss

    base = ["index", str(tiny_model), "--input", str(sentences)]
    assert (
        main(base + ["--out", str(tmp_path / "ivf"), "--index-type", "ivf", "--nlist", "8", "--nprobe", "3"])
        == 0
    )
    assert main(base + ["--out", str(tmp_path / "hnsw"), "--index-type", "hnsw", "--hnsw-m", "8"]) == 0
    ivf_manifest = json.loads((tmp_path / "ivf" / "manifest.json").read_text())
    assert ivf_manifest["index"]["params"] == {"nlist": 8, "nprobe": 3}
    hnsw_manifest = json.loads((tmp_path / "hnsw" / "manifest.json").read_text())
    assert hnsw_manifest["index"]["params"] == {"hnsw_m": 8, "ef_construction": 80, "ef_search": 64}

    ivf = SearchIndex.load(tmp_path / "ivf", device="cpu")
    assert faiss.extract_index_ivf(ivf.index).nprobe == 3
    ivf = SearchIndex.load(tmp_path / "ivf", encoder=ivf.encoder, nprobe=8)
    assert faiss.extract_index_ivf(ivf.index).nprobe == 8
    query = corpus_lines(400)[77]
    assert ivf.search([query], k=1)[0][0].text == query  # nprobe = nlist: exact
    hnsw = SearchIndex.load(tmp_path / "hnsw", encoder=ivf.encoder, ef_search=200)
    assert hnsw.index.hnsw.efSearch == 200
    assert hnsw.search([query], k=1)[0][0].text == query


class FakeGpuFaiss:
    """Stands in for faiss-gpu's three functions and records the calls."""

    def __init__(self):
        self.calls = []

    def resources(self):
        self.calls.append("resources")
        return object()

    def to_gpu(self, resources, device, index):
        self.calls.append(("to_gpu", device))
        return index

    def to_cpu(self, index):
        self.calls.append("to_cpu")
        return index


def test_gpu_branch_moves_flat_and_ivf_but_not_hnsw(monkeypatch):
    import faiss

    fake = FakeGpuFaiss()
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)
    monkeypatch.setattr(faiss, "StandardGpuResources", fake.resources, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_gpu", fake.to_gpu, raising=False)
    monkeypatch.setattr(faiss, "index_gpu_to_cpu", fake.to_cpu, raising=False)
    data = clustered_vectors(500, 8, 5, seed=2)
    index, where = backend.build_index("ivf", 8, {"nlist": 4, "nprobe": 2}, data, [data], use_gpu=True)
    assert where == "gpu" and index.ntotal == 500
    assert fake.calls == ["resources", ("to_gpu", 0), "to_cpu"]
    fake.calls.clear()
    _, where = backend.build_index(
        "hnsw", 8, {"hnsw_m": 8, "ef_construction": 20, "ef_search": 20}, None, [data], True
    )
    assert fake.calls == []  # faiss has no GPU HNSW
    _, where = backend.build_index("flat", 8, {}, None, [data], use_gpu=False)
    assert where == "cpu" and fake.calls == []


def run_index_subprocess(model: Path, sentences: Path, out: Path, chunk_size: int) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "pipeline",
        "index",
        str(model),
        "--input",
        str(sentences),
        "--out",
        str(out),
    ]
    argv += ["--chunk-size", str(chunk_size), "--batch-size", "5", "--keep-work"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_restart_after_sigkill_equals_uninterrupted_build(tiny_model, tmp_path):
    lines = corpus_lines(200)
    sentences = tmp_path / "s.txt"
    sentences.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "killed"
    proc = run_index_subprocess(tiny_model, sentences, out, chunk_size=5)  # 40 chunks
    work = out / ".work"
    deadline = time.time() + 300  # liveness only: start-up alone can take a minute on a loaded machine
    while not (work / "emb-000002.npy").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline, "the build never wrote its third chunk"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert not (out / "manifest.json").exists()
    with pytest.raises(InputError, match="did not finish"):
        SearchIndex.load(out)
    survivors = {p.name: p.stat().st_mtime_ns for p in work.glob("emb-*.npy")}
    assert 3 <= len(survivors) < 40

    # The resumed and the uninterrupted build run in fresh interpreters too, so that all three encode
    # with the same torch thread settings (another test in this process could have changed them).
    for target in (out, tmp_path / "whole"):
        proc = run_index_subprocess(tiny_model, sentences, target, chunk_size=5)
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr.decode()[-2000:]
        if target == out:
            assert "resuming: " in stderr.decode()
    for name, mtime in survivors.items():
        assert (work / name).stat().st_mtime_ns == mtime, f"{name} was encoded again"
    assert len(list(work.glob("emb-*.npy"))) == 40
    for name in ("index.faiss", "corpus.parquet"):
        assert sha256_file(out / name) == sha256_file(tmp_path / "whole" / name), name


def test_stale_chunks_from_another_input_are_discarded(tiny_model, sentences, tmp_path):
    out = tmp_path / "idx"
    work = out / ".work"
    work.mkdir(parents=True)
    (work / "state.json").write_text('{"texts_sha256": "something else"}')
    np.save(work / "emb-000000.npy", np.zeros((64, 32), dtype=np.float32))  # would poison row 0
    assert (
        main(["index", str(tiny_model), "--input", str(sentences), "--out", str(out), "--chunk-size", "64"])
        == 0
    )
    index = SearchIndex.load(out, device="cpu")
    first = corpus_lines(1)[0]
    assert index.search([first], k=1)[0][0].text == first


# ------------------------------------------------------------------------------------------ bad input
def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("error: ")
    return err[-1]


def test_empty_query_is_one_line(flat_index, capsys):
    assert main(["search", str(flat_index), "北京", "  "]) == 2
    assert "query 2 is empty" in one_line_error(capsys)


def test_dimension_mismatch_is_one_line(flat_index, tmp_path, capsys):
    wider = build_tiny_model(tmp_path / "wide", hidden_size=48)
    assert main(["search", str(flat_index), "北京", "--model", str(wider)]) == 2
    assert "dimension mismatch: the model gives 48-d embeddings" in one_line_error(capsys)


def test_missing_index_file_is_one_line(flat_index, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(flat_index, broken)
    (broken / "index.faiss").unlink()
    assert main(["search", str(broken), "北京"]) == 2
    assert "index.faiss listed in" in one_line_error(capsys)
    shutil.copyfile(flat_index / "index.faiss", broken / "index.faiss")
    with open(broken / "corpus.parquet", "r+b") as f:
        f.seek(10)
        f.write(b"\x00")
    assert main(["search", str(broken), "北京"]) == 2
    assert "corpus.parquet fails its sha256 check" in one_line_error(capsys)


def test_missing_model_is_one_line(tiny_model, sentences, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    assert main(["index", str(model), "--input", str(sentences), "--out", str(tmp_path / "idx")]) == 0
    shutil.rmtree(model)
    assert main(["search", str(tmp_path / "idx"), "北京"]) == 2
    assert "no longer exists; pass --model" in one_line_error(capsys)
    assert main(["search", str(tmp_path / "idx"), "北京", "--model", str(tiny_model)]) == 0


def test_wrong_index_dir_is_one_line(tiny_model, tmp_path, capsys):
    assert main(["search", str(tiny_model), "北京"]) == 2
    assert "is not a search index" in one_line_error(capsys)
    assert main(["search", str(tmp_path / "nowhere"), "北京"]) == 2
    assert "does not exist" in one_line_error(capsys)
    (tmp_path / "manifest.json").write_text('{"format": "sentence-shards"}')
    assert main(["search", str(tmp_path), "北京"]) == 2
    assert "not a sentence-search-index manifest" in one_line_error(capsys)


def test_index_input_errors_are_one_line(tiny_model, flat_index, sentences, tmp_path, capsys):
    assert (
        main(["index", str(tiny_model), "--input", str(tmp_path / "none.txt"), "--out", str(tmp_path / "o")])
        == 2
    )
    assert "none.txt does not exist" in one_line_error(capsys)
    assert main(["index", str(tiny_model), "--input", str(sentences), "--out", str(flat_index)]) == 2
    assert "already holds a finished index; pass --overwrite" in one_line_error(capsys)
    bad = tmp_path / "bad.txt"
    bad.write_bytes("好\n".encode() + b"\xff\xfe\n")
    assert main(["index", str(tiny_model), "--input", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "bad.txt:2: not valid UTF-8" in one_line_error(capsys)
    assert main(["index", str(tiny_model), "--input", str(sentences), "--out", str(tmp_path / "o"),
                 "--reduce", "pca", "--reduce-dim", "64"]) == 2  # fmt: skip
    assert "--reduce-dim 64 exceeds the model's 32 dimensions" in one_line_error(capsys)


def write_shards(directory: Path, texts: list[str]) -> None:
    import pyarrow as pa

    from pipeline.io import atomic_write_json
    from pipeline.shards import BASE_SCHEMA, new_manifest, shard_name, write_shard

    directory.mkdir(parents=True)
    entries = []
    for s, part in enumerate((texts[:60], texts[60:])):
        blocks = [
            pa.table(
                {
                    "id": [sentence_id(t) for t in part[b : b + 25]],
                    "text": part[b : b + 25],
                    "source": ["plain"] * len(part[b : b + 25]),
                },
                schema=BASE_SCHEMA,
            )  # fmt: skip
            for b in range(0, len(part), 25)
        ]
        entries.append(write_shard(directory / shard_name(s), blocks, s))
    atomic_write_json(directory / "manifest.json", new_manifest("preprocess", {}, entries))


def test_index_from_shards_and_a_checkpoint_directory(tiny_model, tmp_path, capsys):
    import shutil

    texts = corpus_lines(100, skip=2000)
    write_shards(tmp_path / "shards", texts)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000010"
    shutil.copytree(tiny_model, checkpoint / "model")
    out = tmp_path / "idx"
    assert main(["index", str(checkpoint), "--input", str(tmp_path / "shards"), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["input"]["kind"] == "shards" and manifest["counts"]["indexed"] == 100
    assert manifest["model"]["path"] == str((checkpoint / "model").resolve())
    index = SearchIndex.load(out, device="cpu")
    assert index.ids.tolist() == [sentence_id(t) for t in texts]
    assert index.search([texts[70]], k=1)[0][0].text == texts[70]

    with open(tmp_path / "shards" / "shard-000001.tar", "r+b") as f:  # same size, different bytes
        f.seek(600)
        f.write(b"\x01")
    argv = ["index", str(tiny_model), "--input", str(tmp_path / "shards"), "--out", str(tmp_path / "o2")]
    assert main(argv) == 2
    assert "shard-000001.tar fails its sha256 check" in one_line_error(capsys)


def test_corpus_gets_the_document_prompt_and_queries_the_query_prompt(tiny_model, tmp_path):
    """e5-style folders carry two prompts: `index` encodes the corpus with `passage: `, `search` the
    queries with `query: ` (issue 34); a folder with one prompt keeps it on both sides."""
    from pipeline.model import SentenceEncoder

    model = tmp_path / "e5like"
    SentenceEncoder.from_pretrained(tiny_model, prefix="query: ").save_pretrained(model)
    st_config = model / "config_sentence_transformers.json"
    settings = json.loads(st_config.read_text())
    st_config.write_text(json.dumps({**settings, "prompts": {"query": "query: ", "passage": "passage: "}}))
    texts = corpus_lines(30)
    path = tmp_path / "s.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "idx"
    assert main(["index", str(model), "--input", str(path), "--out", str(out), "--progress", "false"]) == 0
    info = json.loads((out / "manifest.json").read_text())["model"]
    assert info["prefix"] == "query: " and info["document_prefix"] == "passage: "
    index = SearchIndex.load(out, device="cpu")
    encoder = SentenceEncoder.from_pretrained(model)
    stored = index.vectors(np.arange(len(texts)))
    as_documents = SentenceEncoder.from_pretrained(model, prefix="passage: ").encode(texts)
    assert np.abs(stored - as_documents).max() <= 1e-5
    assert np.abs(index.embed(texts[:3], document=True) - as_documents[:3]).max() <= 1e-5
    assert np.abs(index.embed(texts[:3]) - encoder.encode(texts[:3])).max() <= 1e-5  # queries: query prompt
    assert np.abs(encoder.encode(texts[:3]) - as_documents[:3]).max() > 1e-3  # the prompts differ

    # one prompt (no document prompt in the folder): both sides as before
    plain = tmp_path / "idx_plain"
    argv = ["index", str(tiny_model), "--input", str(path), "--out", str(plain), "--progress", "false"]
    assert main(argv) == 0
    info = json.loads((plain / "manifest.json").read_text())["model"]
    assert info["document_prefix"] == info["prefix"]
