"""Compiled kernels are cached per instruction set: a kernel inductor built under one CPU capability
crashes a process that loads it under another (seen: AVX2-capped kernels reused on an AMX machine)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from pipeline.model import compile as compile_mod


def _unset(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "placeholder")  # restored at teardown
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")


def test_a_folder_the_user_set_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert compile_mod.kernel_cache_dir() == str(tmp_path)


def test_each_capability_gets_its_own_folder(monkeypatch):
    import torch._inductor.cpu_vec_isa as vec

    folders = []
    for capability, isa in (("AVX2", "avx2"), ("AVX512", "avx512 avx512_vnni amx_tile")):
        _unset(monkeypatch)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(vec, "pick_vec_isa", lambda i=isa: i)
        folders.append(compile_mod.kernel_cache_dir())
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == folders[-1]  # compile workers inherit it
    assert folders[0] != folders[1]
    assert os.path.basename(folders[0]) == "avx2-avx2"
    assert os.path.dirname(folders[0]) == os.path.dirname(folders[1])


def test_the_default_folder_inductor_wrote_itself_counts_as_unset(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    _unset(monkeypatch)
    assert cache_dir() == os.path.abspath(default_cache_dir())  # what a trace before any compile leaves set
    folder = compile_mod.kernel_cache_dir()
    assert os.path.dirname(folder) == os.path.abspath(default_cache_dir())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX2 is an x86-64 capability")
def test_a_capped_process_uses_the_capped_folder():
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    code = "from pipeline.model.compile import kernel_cache_dir; print(kernel_cache_dir())"
    capped = subprocess.run([sys.executable, "-c", code], env={**env, "ATEN_CPU_CAPABILITY": "avx2"},
                            capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert os.path.basename(capped) == "avx2-avx2"
