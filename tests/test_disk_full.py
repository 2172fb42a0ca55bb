"""A full disk: atomic_write and the checkpointer refuse before writing when the free space is below the
last file's (checkpoint's) size, and on ENOSPC mid-write they remove the partial file, keep the previous
one, and raise one DiskFullError naming the directory and the space needed. On a small tmpfs (root)."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest
import torch

from pipeline.io import EXIT_CODE_DISK_FULL, DiskFullError, atomic_write_bytes
from pipeline.train.checkpoint import Checkpointer, verify_checkpoint


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs("1m")``: a tmpfs of that size under tmp_path (skipped where mounting is not allowed)."""
    mounted = []

    def mount(size: str):
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True
        )
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=True)


@pytest.fixture
def small_disk(mount_tmpfs):
    return mount_tmpfs("1m")


def fill(directory, leave: int) -> None:
    """A filler file that leaves about ``leave`` bytes free."""
    import shutil

    free = shutil.disk_usage(directory).free
    with open(directory / f"filler-{uuid.uuid4().hex[:6]}", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def test_enospc_mid_write_removes_the_partial_file_and_keeps_the_old_one(small_disk):
    target = small_disk / "data" / "shard.bin"
    target.parent.mkdir()
    atomic_write_bytes(target, b"old" * 100)
    with pytest.raises(DiskFullError) as exc:
        atomic_write_bytes(target, b"x" * (2 << 20))  # 2 MiB on a 1 MiB disk: fails while writing
    message = str(exc.value)
    assert str(target.parent) in message and "disk full" in message and "needed" in message
    assert "\n" not in message and exc.value.exit_code == EXIT_CODE_DISK_FULL == 74
    assert target.read_bytes() == b"old" * 100  # the previous file is intact
    assert [p.name for p in target.parent.iterdir()] == ["shard.bin"]  # no partial temporary left


def test_a_write_is_refused_before_it_starts_when_the_last_one_would_not_fit(small_disk):
    out = small_disk / "shards"
    out.mkdir()
    atomic_write_bytes(out / "shard-00000.tar", b"s" * 300_000)
    fill(small_disk, leave=100_000)
    written = []

    def write(tmp):
        written.append(tmp)
        tmp.write_bytes(b"s" * 10)

    from pipeline.io import atomic_write

    with pytest.raises(
        DiskFullError,
        match=rf"not enough disk space in {out} for shard-00001.tar: .* free, about 293 KiB needed",
    ):
        atomic_write(out / "shard-00001.tar", write)
    assert written == []  # refused before anything was written
    atomic_write_bytes(out / "manifest.json", b"{}")  # another kind of file (its own size) still goes


class Model(torch.nn.Module):
    """What the checkpointer needs of an encoder: a backbone and save_pretrained (safetensors)."""

    def __init__(self, n):
        super().__init__()
        self.backbone = torch.nn.Linear(n, 1, bias=False)

    def save_pretrained(self, directory):
        from safetensors.torch import save_file

        directory.mkdir(parents=True)
        save_file(self.backbone.state_dict(), directory / "model.safetensors")


class State:
    def __init__(self, n):
        self.t = torch.randn(n)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, state):
        self.t = state["t"]


def test_checkpoint_save_on_a_full_disk_keeps_the_previous_checkpoint(small_disk, monkeypatch):
    ckpt = Checkpointer(small_disk / "run", keep_last=2)
    model, state = Model(30_000), State(30_000)  # ~240 kB a checkpoint
    first = ckpt.save(1, model, {"s": state}, {}, {"step": 1})
    size = ckpt.newest_size()
    assert size > 200_000

    fill(small_disk, leave=size // 2)  # the pre-write check: less free than the last checkpoint
    with pytest.raises(
        DiskFullError, match=rf"not enough disk space in {ckpt.dir} for checkpoint step-00000002"
    ):
        ckpt.save(2, model, {"s": state}, {}, {"step": 2})
    assert ckpt.checkpoints() == [first] and not list(ckpt.dir.glob(".tmp-*"))

    monkeypatch.setattr(Checkpointer, "newest_size", lambda self: 0)  # no estimate: ENOSPC while writing
    with pytest.raises(DiskFullError) as exc:
        ckpt.save(2, model, {"s": state}, {}, {"step": 2})
    message = str(exc.value)
    assert message.startswith(f"disk full in {ckpt.dir} while writing checkpoint step-00000002")
    assert "the previous ones are intact" in message and "\n" not in message
    assert "more than " in message  # no estimate: what was written is a lower bound, not the need
    assert ckpt.checkpoints() == [first] and not list(ckpt.dir.glob(".tmp-*"))
    assert ckpt.latest() == first and verify_checkpoint(first)["step"] == 1
    assert (ckpt.dir / "latest").read_text().strip() == first.name

    loaded, loaded_model = State(30_000), Model(30_000)
    ckpt.load(first, loaded_model, {"s": loaded}, {})
    assert torch.equal(loaded.t, state.t) and torch.equal(loaded_model.backbone.weight, model.backbone.weight)


def test_the_disk_full_message_gives_the_previous_checkpoints_true_size(tmp_path, monkeypatch):
    """Saved without a size estimate (benchmarks/faults.py's odd runs), the message said the previous
    checkpoint "takes 0 KiB": it read the estimate. It measures the files now."""
    from pipeline.io import format_size
    from pipeline.train.checkpoint import checkpoint_bytes

    ckpt = Checkpointer(tmp_path / "run")
    first = ckpt.save(1, Model(30_000), {"s": State(30_000)}, {}, {"step": 1})
    size = checkpoint_bytes(first)
    monkeypatch.setattr(Checkpointer, "newest_size", lambda self: 0)
    message = ckpt._disk_full_message("step-00000002", "No space left on device", 4096)
    assert f"{first.name} takes {format_size(size)}" in message and size > 200_000
    assert "more than 4 KiB needed" in message


def test_an_error_line_is_written_whole(monkeypatch):
    """Two ranks' error lines ran together ("...intacterror: not enough disk space..."): ``print`` wrote
    the text and its newline separately. The line and its newline go out in one write."""
    import io

    from pipeline.errors import write_error_line

    class Stream(io.StringIO):
        writes: list[str] = []

        def write(self, text):
            self.writes.append(text)
            return super().write(text)

    stream = Stream()
    monkeypatch.setattr("sys.stderr", stream)
    write_error_line(DiskFullError("disk full in /x; the previous checkpoints are intact"))
    assert stream.writes == ["error: disk full in /x; the previous checkpoints are intact\n"]


@pytest.mark.parametrize("when", ["before the write", "while writing"])
def test_training_stops_with_one_line_and_resumes_exactly_once_space_is_freed(
    tmp_path, tiny_shards, mount_tmpfs, capsys, monkeypatch, when
):
    """The disk fills after the step-2 checkpoint: the step-4 save fails (refused by the free-space check,
    or by ENOSPC while writing when there is no estimate): exit 74, one line naming the checkpoint
    directory, step-2 intact; after freeing space the same command resumes from step 2 and ends with the
    parameters, queue and cursor of an uninterrupted run."""
    import sys

    from accelerate.state import AcceleratorState

    from pipeline.train.config import PROJECT_ROOT

    sys.path.insert(0, str(PROJECT_ROOT / "launch"))
    from pretrain import main

    shards = tiny_shards([[40, 24], [32]], num_variants=3)
    disk = mount_tmpfs("32m")

    def argv(run_dir):
        return [
            "--config", str(PROJECT_ROOT / "launch" / "configs" / "debug.yaml"), f"--data.shards={shards}",
            f"--run_dir={run_dir}", "--train.max_steps=6", "--checkpoint.every_steps=2",
            "--loss=[{luse: {temperature: 0.05, queue_size: 32, momentum: 0.9}}]",
            "--train.debug_dump=true", "--train.eval_max_pairs=16",
        ]  # fmt: skip

    def dump(run_dir):
        return json.loads((run_dir / "debug" / "rank0.json").read_text())

    AcceleratorState._reset_state(True)
    assert main(argv(tmp_path / "ref")) == 0

    filled = []

    def fill_after_step_3(t, batch):
        if t.state.step == 3 and not filled:
            fill(disk, leave=64_000)
            filled.append(next(disk.glob("filler-*")))

    if when == "while writing":
        monkeypatch.setattr(Checkpointer, "newest_size", lambda self: 0)
    run_dir = disk / "run"
    AcceleratorState._reset_state(True)
    capsys.readouterr()
    assert main(argv(run_dir), fill_after_step_3) == EXIT_CODE_DISK_FULL
    errors = [
        x[x.index("error:") :] for x in capsys.readouterr().err.splitlines() if "error:" in x
    ]  # after tqdm's \r
    assert len(errors) == 1 and str(run_dir / "checkpoints") in errors[0] and "step-00000004" in errors[0]
    assert " needed" in errors[0]
    ckpt = Checkpointer(run_dir)
    assert [p.name for p in ckpt.checkpoints()] == ["step-00000002"] and not list(ckpt.dir.glob(".tmp-*"))
    verify_checkpoint(ckpt.latest())

    monkeypatch.undo()
    filled[0].unlink()  # space freed: the same command resumes from step 2
    AcceleratorState._reset_state(True)
    assert main(argv(run_dir)) == 0
    got, ref = dump(run_dir), dump(tmp_path / "ref")
    for key in ("param_checksum", "queue_checksum", "cursor", "step", "samples_seen"):
        assert got[key] == ref[key], key


def test_preprocess_on_a_full_disk_is_one_line_naming_the_output(mount_tmpfs, tmp_path):
    """Preprocess's split pass streams its work files (not through atomic_write): the CLI still turns the
    ENOSPC into one line naming the output directory, exit 74."""
    import sys

    from pipeline.resources import SAMPLE_CORPUS

    out = mount_tmpfs("1m") / "out"
    cmd = [sys.executable, "-m", "pipeline", "preprocess", str(SAMPLE_CORPUS), f"--out={out}", "--workers=2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [x[x.index("error:") :] for x in done.stderr.splitlines() if "error:" in x]
    assert done.returncode == EXIT_CODE_DISK_FULL, done.stderr[-2000:]
    assert len(errors) == 1 and f"disk full in {out}" in errors[0] and "Traceback" not in done.stderr


def test_a_disk_full_error_is_recognised_down_the_exception_chain():
    """torch.save raises RuntimeError('unexpected pos ...') while handling the ENOSPC of its write."""
    import errno

    from pipeline.io import is_disk_full

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 301312 vs 301264")
    except RuntimeError as exc:
        chained = exc
    assert is_disk_full(chained) and not is_disk_full(RuntimeError("unexpected pos 1 vs 2"))


@pytest.mark.parametrize("tensorboard", [False, True])
def test_metrics_on_a_full_disk_are_held_back_whole_and_written_when_space_returns(
    small_disk, caplog, tensorboard
):
    """Logging never stops training: on ENOSPC the records wait in memory, the file keeps only whole
    lines, one warning names the directory; once space is freed every record lands, in order."""
    import logging

    from pipeline.train.metrics import MetricsLogger

    run_dir = small_disk / "run"
    run_dir.mkdir()
    metrics = MetricsLogger(run_dir, enabled=True, tensorboard=tensorboard)
    metrics.log({"event": "train", "step": 1, "loss": 1.0}, step=1)
    fill(small_disk, leave=0)
    filler = next(small_disk.glob("filler-*"))
    padding = "x" * 6000  # larger than any leftover fragment of a block: a write cannot fit
    with caplog.at_level(logging.WARNING, logger="pipeline.train.metrics"):
        for step in (2, 3, 4):
            metrics.log({"event": "train", "step": step, "loss": 1.0 / step, "note": padding}, step=step)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all(str(run_dir) in w and "disk full" in w for w in warnings)
    assert len([w for w in warnings if "metrics.jsonl" in w]) == 1
    on_disk = metrics.path.read_text(encoding="utf-8")
    assert on_disk.endswith("\n") and [json.loads(x)["step"] for x in on_disk.splitlines()] == [1]
    assert len(metrics.pending) == 3

    filler.unlink()
    metrics.log({"event": "train", "step": 5, "loss": 0.2}, step=5)
    metrics.close()
    steps = [json.loads(x)["step"] for x in metrics.path.read_text(encoding="utf-8").splitlines()]
    assert steps == [1, 2, 3, 4, 5] and not metrics.pending
