"""Shipped configs validate; config mistakes fail before training with one line; multi-process runs."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from _train_data import make_shards

from pipeline.cli import main as cli_main
from pipeline.config import load_config
from pipeline.train.config import PROJECT_ROOT, Config

CONFIGS = sorted((PROJECT_ROOT / "launch" / "configs").glob("*.yaml"))
CONFIGS += sorted((PROJECT_ROOT / "benchmarks" / "luse_trial").glob("*.yaml"))  # the LUSE trial's arms
DEBUG = PROJECT_ROOT / "launch" / "configs" / "debug.yaml"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    make_shards(d, [[32], [32]], num_variants=2)
    return d


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_config_validates(path):
    cfg = load_config(Config, path)
    # a contrastive objective needs a positive view; distillation alone reads one view per sentence
    assert cfg.num_views() >= (2 if cfg.terms().main is not None else 1)
    assert cfg.model.scratch_config is None or (PROJECT_ROOT / cfg.model.scratch_config).is_file()
    if cfg.train.deepspeed_config:
        assert (PROJECT_ROOT / cfg.train.deepspeed_config).is_file()


def test_deepspeed_and_accelerate_files_parse():
    import yaml

    for p in (PROJECT_ROOT / "launch" / "deepspeed").glob("*.json"):
        assert json.loads(p.read_text())["zero_optimization"]["stage"] in (1, 2)
    for p in (PROJECT_ROOT / "launch" / "accelerate").glob("*.yaml"):
        assert yaml.safe_load(p.read_text())["distributed_type"]


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "--loss=[{luse: {temperature: 0.05, queue_size: 20, momentum: 0.0}}]",
            "queue size 20 must be a multiple of the global batch (16",
        ),
        ("--data.num_variants=3", "data.num_variants=3 but the shards in"),
        ("--train.grad_accum_steps=3", "must be divisible by train.grad_accum_steps (3)"),
    ],
)
def test_config_mistakes_fail_before_training_with_one_line(tmp_path, shards, capsys, override, message):
    argv = [
        "train",
        "--config",
        str(DEBUG),
        f"--data.shards={shards}",
        f"--run_dir={tmp_path / 'run'}",
        override,
    ]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "run" / "model").exists()


def test_world_size_check(shards):
    from pipeline.errors import ConfigError
    from pipeline.shards import read_shard_set
    from pipeline.train.plan import check_against_data

    cfg = load_config(Config, DEBUG, {"data.shards": str(shards)})
    check_against_data(cfg, read_shard_set(shards), 2)
    with pytest.raises(ConfigError, match=r"world size x grad_accum_steps \(3 x 1 = 3\)"):
        check_against_data(cfg, read_shard_set(shards), 3)


def test_missing_shards_cli_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "train",
            "--config",
            str(DEBUG),
            f"--data.shards={tmp_path / 'none'}",
            f"--run_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"error: data.shards: {tmp_path / 'none'} is not a directory" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:  # torchrun's --master_port 0 leaves the workers waiting for ever
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path, shards, *extra, steps=16):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(PROJECT_ROOT / ".cache" / "torch_extensions"))
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        str(PROJECT_ROOT / "launch" / "pretrain.py"),
        "--config",
        str(DEBUG),
        f"--data.shards={shards}",
        f"--run_dir={run_dir}",
        f"--train.max_steps={steps}",
        "--train.debug_dump",
        *extra,
    ]
    # own session, so that a hung run is killed with its worker processes, not just the launcher
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=PROJECT_ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stderr[-3000:]
    dumps = [json.loads((run_dir / "debug" / f"rank{r}.json").read_text()) for r in range(2)]
    losses = [
        json.loads(line)["loss"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    return dumps, losses


@pytest.mark.slow
def test_two_process_ddp_run_keeps_ranks_identical(tmp_path, shards):
    dumps, losses = _torchrun(tmp_path, shards, steps=16)
    assert [d["world_size"] for d in dumps] == [2, 2]
    assert [d["distributed_type"] for d in dumps] == ["MULTI_CPU", "MULTI_CPU"]
    assert dumps[0]["param_checksum"] == dumps[1]["param_checksum"]
    assert dumps[0]["queue_checksum"] == dumps[1]["queue_checksum"] and dumps[0]["queue_fill"] == 32
    assert dumps[0]["cursor"] == dumps[1]["cursor"] and dumps[0]["samples_seen"] == 16 * 16
    assert len(losses) == 16 and all(x == x and abs(x) < 1e6 for x in losses)
    # the queue is full from step 3 on (32 keys, 16 per step); compare after that
    early, late = sum(losses[2:5]) / 3, sum(losses[-3:]) / 3
    assert late < early - 0.05, losses


# A two-process DeepSpeed ZeRO-2 run keeping its ranks identical: tests/test_resume.py checks it on the
# run its ZeRO-2 resume test needs anyway.


def test_pretrain_py_help_lists_the_training_options():
    proc = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "launch" / "pretrain.py"), "--help"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: accelerate launch launch/pretrain.py" in proc.stdout and "--loss" in proc.stdout
