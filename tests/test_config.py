from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar, Literal

import pytest

from pipeline.cli import build_config, parse_cli
from pipeline.config import Legacy, from_dict, help_lines, load_config, option, to_dict
from pipeline.errors import ConfigError


@dataclass
class Optim:
    lr: float = option(1e-3, "learning rate")
    betas: list[float] = option([0.9, 0.999], "Adam betas")


@dataclass
class Cfg:
    inputs: list[Path] = option(factory=list, help="inputs")
    workers: int = option(1, "workers")
    strict: bool = option(False, "strict")
    pooling: Literal["cls", "mean"] = option("cls", "pooling")
    name: str | None = option(None, "optional name")
    optim: Optim = option(factory=Optim, help="optimizer")

    def __post_init__(self):
        if self.workers < 1:
            raise ConfigError("workers must be >= 1; set --workers to a positive number")


def test_yaml_then_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("workers: 3\noptim:\n  lr: 0.5\n")
    cfg = build_config(Cfg, ["--config", str(y), "--optim.lr=2e-5", "a.txt", "b.txt", "--strict"], "inputs")
    assert cfg.workers == 3
    assert cfg.optim.lr == pytest.approx(2e-5)
    assert cfg.strict is True
    assert cfg.inputs == [Path("a.txt"), Path("b.txt")]
    assert to_dict(cfg)["inputs"] == ["a.txt", "b.txt"]


def test_dashes_and_space_separated_values():
    _, overrides = parse_cli(Cfg, ["--workers", "4", "--pooling=mean", "--strict", "false"])
    assert overrides == {"workers": 4, "pooling": "mean", "strict": False}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--wrokers=2"], "unknown config key 'wrokers'. Did you mean 'workers'"),
        (["--optim.lrr=1"], "unknown config key 'optim.lrr'"),
        (["--workers=two"], "workers: expected an integer"),
        (["--pooling=max"], "'max' is not one of"),
        (["--workers=0"], "workers must be >= 1"),
        (["--optim.betas=[0.9, x]"], "optim.betas[1]: expected a number"),
    ],
)
def test_bad_keys_and_types_name_the_key(argv, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_config(Cfg, argv, "inputs")


def test_unknown_key_in_yaml(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("optim:\n  momentum: 0.9\n")
    with pytest.raises(ConfigError, match="unknown config key 'optim.momentum'"):
        load_config(Cfg, y)


def test_yaml_must_be_mapping(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(Cfg, y)


def test_cli_prints_one_line_for_unknown_command(capsys):
    from pipeline.cli import main

    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


@dataclass
class SearchLike:
    index_dir: Path | None = option(None, "index")
    queries: list[str] = option(factory=list, help="queries")
    k: int = option(10, "top k")


def test_several_positionals_and_short_flags():
    cfg = build_config(SearchLike, ["idx", "北京天气", "-k", "3", "上海"], ("index_dir", "queries"))
    assert cfg.index_dir == Path("idx")
    assert cfg.queries == ["北京天气", "上海"]
    assert cfg.k == 3


def test_list_flag_followed_by_more_words_keeps_every_input():
    # `preprocess --inputs a.txt b.jsonl` used to keep only b.jsonl: the words after the flag replaced it
    cfg = build_config(Cfg, ["--inputs", "a.txt", "b.jsonl", "c.gz"], positional="inputs")
    assert cfg.inputs == [Path("a.txt"), Path("b.jsonl"), Path("c.gz")]
    cfg = build_config(Cfg, ["x.txt", "--inputs=a.txt", "--workers", "2"], positional="inputs")
    assert cfg.inputs == [Path("a.txt"), Path("x.txt")] and cfg.workers == 2


def test_single_field_given_as_flag_and_positional_is_refused():
    with pytest.raises(ConfigError, match="name given twice"):
        parse_cli(Cfg, ["--name=x", "y"], positional="name")


def test_literal_no_survives_yaml_and_cli_booleans(tmp_path):
    """YAML 1.1 reads a bare `no` as False; a choice field that offers "no" gets its word back."""

    @dataclass
    class Precision:
        mixed_precision: Literal["no", "bf16"] = option("bf16", "precision")

    y = tmp_path / "p.yaml"
    y.write_text("mixed_precision: no\n")
    assert load_config(Precision, y, {}).mixed_precision == "no"
    assert build_config(Precision, ["--mixed_precision=no"]).mixed_precision == "no"
    with pytest.raises(ConfigError, match="mixed_precision: True is not one of"):
        build_config(Precision, ["--mixed_precision=yes"])


@dataclass
class OldSection:
    speed: float | None = option(None, "the old name of optim.lr")


def read_old(data, section):
    if section.speed is None:
        return data
    return {**data, "optim": {**data.get("optim", {}), "lr": section.speed}}


@dataclass
class Versioned(Cfg):
    LEGACY: ClassVar[dict[str, Legacy]] = {"old": Legacy(OldSection, read_old)}


def test_a_legacy_section_is_read_at_load_and_never_a_field(tmp_path):
    """A section of earlier versions (``LEGACY``): read from a file, dotted overrides or a saved mapping,
    its keys and types checked; not a field, so neither to_dict nor --help shows it."""
    y = tmp_path / "old.yaml"
    y.write_text("old:\n  speed: 0.25\n")
    assert load_config(Versioned, y).optim.lr == 0.25
    assert build_config(Versioned, ["--old.speed=0.5"]).optim.lr == 0.5
    assert from_dict(Versioned, {"old": {"speed": None}}).optim.lr == 1e-3  # a section of nulls: nothing
    with pytest.raises(ConfigError, match="unknown config key 'old.sped'"):
        build_config(Versioned, ["--old.sped=1"])
    with pytest.raises(ConfigError, match=r"old.speed: expected float \| None"):
        from_dict(Versioned, {"old": {"speed": "fast"}})
    cfg = load_config(Versioned, y)
    assert "old" not in to_dict(cfg) and "old" not in {f.name for f in fields(cfg)}
    assert "--old" not in "\n".join(help_lines(Versioned))


def test_the_training_config_reads_objective_at_load_only():
    """issue 42: ``objective:`` is off the live training Config (no field, no --help line); an old config's
    section still loads, read into ``loss`` (tests/test_loss_terms.py checks what it reads as)."""
    from pipeline.train.config import PROJECT_ROOT, Config

    assert "objective" not in {f.name for f in fields(Config)}
    assert "--objective" not in "\n".join(help_lines(Config))
    debug = PROJECT_ROOT / "launch" / "configs" / "debug.yaml"
    cfg = load_config(Config, debug, {"objective.momentum": 0.9})
    assert cfg.loss[0]["luse"]["momentum"] == 0.9 and "objective" not in to_dict(cfg)
