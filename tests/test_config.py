from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from pipeline.cli import build_config, parse_cli
from pipeline.config import load_config, option, to_dict
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
