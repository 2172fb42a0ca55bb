"""Every command line the docs show parses against the real command line and config.

README.md and every docs/*.md page (read when the tests are collected: a page added later is checked too)
are searched for commands, in fenced code blocks (continuation lines joined) and in inline code:
``python -m pipeline COMMAND ...`` (any interpreter: ``.venv/bin/python``, ``python3``; also the
``sentence-pretrain`` script), ``launch/pretrain.py ...`` (after ``accelerate launch [OPTIONS]``,
``torchrun ...`` or an interpreter) and the SLURM scripts (``sbatch [OPTIONS] launch/slurm/X.sbatch ...``,
``bash launch/slurm/preprocess.sbatch submit ...``), whose arguments go to a pipeline command, and
dotted overrides shown alone (``--optim.lr=3e-5``: the training config's keys). Each is
checked as the program would read it: the command exists; every ``--key`` names a field of its config,
dotted keys included; every value parses as its field's type; ``--config`` names a file that exists; the
whole config validates (``__post_init__``); ``accelerate launch``'s own options parse with accelerate's
parser. Placeholders are not values: a word in capitals (``RUN_DIR``, ``N``), ``...``, ``[optional]``
brackets and ``<angle>`` words.
"""

from __future__ import annotations

import importlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.cli import COMMANDS, parse_cli
from pipeline.config import _coerce as coerce
from pipeline.config import field_type, load_config
from pipeline.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
PLACEHOLDER = re.compile(r"^([A-Z][A-Z0-9_]*(\.[A-Za-z0-9]+)?|[a-z])$")  # RUN_DIR, N, FILE.yaml, W2V, k
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "$(", "`"}
GENERIC = {
    "--key=value",
    "--a.b=v",
    "--a.b=value",
    "--section.key=value",
    "--key",
    "VALUE",
}  # the syntax itself
REDIRECTS = {">", ">>", "<", "2>", "2>&1", ">&", "&>"}
# A SLURM script's leading positionals and the pipeline command they become (the rest passes through).
SBATCH_STAGES = {
    "augment.sbatch": ("augment", ("--shards", "--out")),
    "teacher.sbatch": ("teacher", ("--shards", "--out", "--model")),
    "tokenize.sbatch": ("tokenize", ("--shards", "--out", "--model")),
}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Found:
    """One command line of a page: where, and its words as the shell splits them."""

    page: str
    line: int
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.words)}"


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command text): fenced code lines with continuations joined, and inline code."""
    out: list[tuple[int, str]] = []
    fenced, pending, start = False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced, pending = not fenced, ""
            continue
        if fenced:
            if not pending:
                start = number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((start, pending + line))
            pending = ""
        else:
            out.extend((number, code) for code in INLINE_CODE.findall(line))
    return out


def split_words(text: str) -> list[list[str]]:
    """The simple commands of one shell line: words split as bash would, at ; && | ( ) $( and redirections
    (a redirection's target dropped), comments dropped; ``<word>`` placeholders become ``WORD``."""
    text = re.sub(r"<([A-Za-z][\w .-]*)>", lambda m: re.sub(r"\W", "_", m.group(1)).upper(), text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    lexer.wordchars += "$[]{}:,@%+=~*!^"
    try:
        words = list(lexer)
    except ValueError:  # an unclosed quote: prose, not a command
        return []
    commands: list[list[str]] = [[]]
    skip_next = False
    for word in words:
        if skip_next:
            skip_next = False
            continue
        if word in SEPARATORS or set(word) <= set(";&|()"):
            commands.append([])
        elif word in REDIRECTS or set(word) <= set("<>&"):
            skip_next = True
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


def documented_commands(page: Path, root: Path = ROOT) -> list[Found]:
    found = []
    for number, text in shell_lines(page.read_text(encoding="utf-8")):
        for words in split_words(text):
            if target(words) is not None:
                found.append(Found(str(page.relative_to(root)), number, tuple(words)))
    return found


def is_python(word: str) -> bool:
    return re.fullmatch(r"(.*/)?python[0-9.]*", word) is not None


def target(words: list[str]) -> tuple[str, list[str], list[str]] | None:
    """``(kind, before, args)``: kind "pipeline" (args[0] the command), "train" (launch/pretrain.py's
    arguments), or "sbatch:NAME" (a SLURM script's arguments); ``before``: the words before them."""
    for i, word in enumerate(words):
        if is_python(word) and words[i + 1 : i + 3] == ["-m", "pipeline"] and len(words) > i + 3:
            return "pipeline", words[:i], words[i + 3 :]
        if word == "sentence-pretrain" and len(words) > i + 1:
            return "pipeline", words[:i], words[i + 1 :]
        if word.endswith("launch/pretrain.py"):
            return "train", words[:i], words[i + 1 :]
        if word.endswith(".sbatch") and "/slurm/" in word:
            return f"sbatch:{Path(word).name}", words[: i + 1], words[i + 1 :]
    if all(re.match(r"--[a-z_]+\.[a-z_.]+(=|$)", w) for w in words):
        return "overrides", [], words  # `--optim.lr=3e-5` in a sentence: the training config's dotted keys
    return None


def clean(args: list[str]) -> list[str]:
    """The arguments without placeholders' punctuation: ``[--flag VALUE]`` -> ``--flag VALUE``; ``...``
    (and a flag whose value it is), a ``[word]`` where no flag takes it and generic ``--key=value``
    examples dropped."""
    out: list[str] = []
    for arg in args:
        if arg.startswith("[-"):
            arg = arg[1:]
        while arg.endswith("]") and arg.count("]") > arg.count("["):
            arg = arg[:-1]
        takes_value = bool(out) and out[-1].startswith("--") and "=" not in out[-1]
        if arg in ("...", "…"):
            if takes_value:
                out.pop()  # `--config ...`
            continue
        if not arg or arg in GENERIC:
            continue
        if re.fullmatch(r"\[[\w -]+\]", arg) and not takes_value:
            continue  # `[extra]`: more arguments of the reader's choice
        out.append(arg.rstrip(".…") if arg.endswith(("...", "…")) else arg)
    return out


def is_placeholder(value: str) -> bool:
    return PLACEHOLDER.match(value) is not None or "$" in value


def check_config(
    cls: type, argv: list[str], positional: str | tuple[str, ...] | None, whole: bool = True
) -> None:
    """Parse ``argv`` as the program would and validate the config (``whole``; else each value against its
    field's type: a synopsis of optional flags need not be a valid combination); raises ConfigError."""
    yaml_path, overrides = parse_cli(cls, argv, positional)
    if yaml_path is not None and is_placeholder(Path(yaml_path).stem):
        yaml_path = None
    elif yaml_path is not None:
        if not (ROOT / yaml_path).is_file():
            raise ConfigError(f"--config {yaml_path}: no such file in the project")
        yaml_path = ROOT / yaml_path
    typed = {}
    for key, value in overrides.items():
        tp = field_type(cls, key)
        if (
            isinstance(value, str)
            and is_placeholder(value)
            and tp not in (str, Path, str | None, Path | None)
        ):
            continue  # a placeholder for a number or a choice: the key is checked, the value is not
        typed[key] = value if whole else coerce(value, tp, key)
    if whole:
        load_config(cls, yaml_path, typed)


def check_accelerate(before: list[str]) -> None:
    """``accelerate launch OPTIONS`` (the words before the script) through accelerate's own parser."""
    if "launch" not in before:
        return
    # a placeholder ($NODE_RANK) stands for a value the parser would take
    options = [
        o if o.startswith("-") or not is_placeholder(o) else "0"
        for o in clean(before[before.index("launch") + 1 :])
    ]
    from accelerate.commands.launch import launch_command_parser

    try:
        parsed = launch_command_parser().parse_args([*options, "launch/pretrain.py"])
    except SystemExit:
        raise ConfigError(f"accelerate launch does not take {' '.join(options)}") from None
    if parsed.config_file and parsed.config_file != "0":
        if not (ROOT / parsed.config_file).is_file():
            raise ConfigError(f"--config_file {parsed.config_file}: no such file in the project")


def check_pipeline(args: list[str], whole: bool = True) -> None:
    name, rest = args[0], args[1:]
    if is_placeholder(name):
        return  # `python -m pipeline <command> --help`
    if name not in COMMANDS:
        raise ConfigError(f"python -m pipeline {name}: no such command")
    if "--help" in rest or "-h" in rest:
        return
    command = COMMANDS[name]
    module = importlib.import_module(command.module)
    check_config(module.Config, rest, command.positional, whole)


def check_sbatch(script: str, before: list[str], args: list[str]) -> None:
    path = next(w for w in before if w.endswith(script))
    if not (ROOT / path).is_file():
        raise ConfigError(f"{path}: no such script")
    from pipeline.train.config import Config

    if "--help" in args:
        return
    if script == "pretrain.sbatch":
        check_config(Config, args, None)
    elif script == "pipeline.sbatch":
        check_pipeline(args)
    elif script == "preprocess.sbatch":  # PHASE OUT INPUT... [--key=value ...]
        phase, out, *rest = args
        if phase not in ("submit", "split", "dedup", "shards", "finalize"):
            raise ConfigError(
                f"preprocess.sbatch {phase}: the phase is submit, split, dedup, shards or finalize"
            )
        check_pipeline(["preprocess", *rest, "--out", out])
    elif script in SBATCH_STAGES:
        command, flags = SBATCH_STAGES[script]
        given = [a for a in args if not a.startswith("-")][: len(flags)]
        if len(given) < len(flags):
            raise ConfigError(f"{script} takes {len(flags)} paths first, got {given}")
        rest = list(args)
        for value in given:
            rest.remove(value)
        check_pipeline([command, *[x for pair in zip(flags, given, strict=True) for x in pair], *rest])


def check(found: Found) -> None:
    """Raises ConfigError naming what the program would refuse. A command named without arguments is a
    mention, not a command line: only its name is checked."""
    kind, before, args = target(list(found.words))
    whole = not any(a.startswith("[-") for a in args)  # a synopsis with [--optional] flags: each flag alone
    args = clean(args)
    if kind == "pipeline" and len(args) == 1 or kind not in ("pipeline", "overrides") and not args:
        args = args[:1] + ["--help"] if kind != "sbatch:pretrain.sbatch" else ["--help"]
    if kind == "pipeline":
        check_pipeline(args, whole)
    elif kind == "overrides":
        from pipeline.train.config import Config

        for arg in args:  # a key named alone is a mention of it: the key is checked
            check_config(Config, [arg], None, whole=False) if "=" in arg else field_type(Config, arg[2:])
    elif kind == "train":
        check_accelerate(before)
        if "--help" not in args:
            from pipeline.train.config import Config

            check_config(Config, args, None)
    else:
        check_sbatch(kind.split(":", 1)[1], before, args)


def failures(page: Path, root: Path = ROOT) -> list[str]:
    """``page``'s commands that the program would refuse, each with the reason."""
    out = []
    for found in documented_commands(page, root):
        try:
            check(found)
        except (ConfigError, ValueError) as exc:
            out.append(f"{found}\n    -> {exc}")
    return out


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_parses(page):
    bad = failures(page)
    assert not bad, "commands the program would refuse:\n" + "\n".join(bad)


def test_the_readme_cluster_sequence_is_found():
    found = [" ".join(f.words) for f in documented_commands(ROOT / "README.md")]
    for needle in ("models fetch e5-small", "preprocess.sbatch submit", "augment.sbatch", "pipeline student",
                   "teacher.sbatch", "tokenize.sbatch", "doctor", "pretrain.sbatch", "pipeline eval",
                   "pipeline export"):  # fmt: skip
        assert any(needle.replace("pipeline ", "") in f for f in found), f"no README command with {needle!r}"


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "python -m pipeline train --config launch/configs/distill.yaml --train.lr=3e-5",
            "unknown config key 'train.lr'",
        ),
        (
            "accelerate launch launch/pretrain.py --config launch/configs/default.yaml --train.lr=3e-5",
            "unknown config key 'train.lr'",
        ),
        (
            "sbatch --nodes=2 launch/slurm/pretrain.sbatch --config launch/configs/nope.yaml",
            "--config launch/configs/nope.yaml: no such file",
        ),
        (
            "python -m pipeline train --config launch/configs/distill.yaml --optim.lr=fast",
            "optim.lr: expected a number",
        ),
        (
            "python -m pipeline train --config launch/configs/distill.yaml --train.max_samples=10",
            "train.max_steps (600) and train.max_samples (10) both set",
        ),
        (".venv/bin/python -m pipeline export RUN --out DIR --onnx_int9", "unknown config key 'onnx_int9'"),
        ("python -m pipeline exprot RUN", "no such command"),
        ("--train.lr=3e-5", "unknown config key 'train.lr'"),  # README's example of an override, once
        ("sbatch --array=0-1 launch/slurm/teacher.sbatch IN OUT M --bf17", "unknown config key 'bf17'"),
        (
            "accelerate launch --num_procs 2 launch/pretrain.py --config launch/configs/debug.yaml",
            "accelerate launch does not take --num_procs 2",
        ),
    ],
)
def test_a_wrong_command_is_found(tmp_path, line, message):
    page = tmp_path / "page.md"
    page.write_text(
        f"# A page\n\n```bash\n{line}   # a comment\n```\n\nInline: `{line}`.\n", encoding="utf-8"
    )
    bad = failures(page, tmp_path)
    assert len(bad) == 2 and all(message in b for b in bad), bad


def test_placeholders_and_shell_around_a_command_are_not_values():
    text = (
        "a=$(sbatch --parsable --dependency=afterok:$b launch/slurm/pipeline.sbatch eval RUN/model "
        '--suite "[sts]" --out DIR) && echo "$a" > job.txt   # chained\n'
    )
    [words] = [w for w in split_words(text) if target(w)]
    assert words[-4:] == ["--suite", "[sts]", "--out", "DIR"] and "echo" not in words
    check(Found("x.md", 1, tuple(words)))
    synopsis = "python -m pipeline export CHECKPOINT --out DIR [--onnx-int8] [--push-to-hub REPO [--dry-run]]"
    check(Found("x.md", 1, tuple(shlex.split(synopsis))))


def test_the_readme_lists_every_shipped_config():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = text[text.index("Shipped configs in `launch/configs/`") :].split("\n\n", 1)[0]
    missing = [p.name for p in sorted((ROOT / "launch" / "configs").iterdir()) if f"`{p.name}`" not in listed]
    assert not missing, f"README's list of shipped configs misses {missing}"
