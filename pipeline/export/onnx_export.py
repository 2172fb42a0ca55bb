"""``export --onnx [--onnx-int8]``: the transformer as ONNX beside the PyTorch weights, checked at export.

Written where sentence-transformers' ``backend="onnx"`` looks (``onnx/model.onnx``; the int8 variant
``onnx/model_qint8_avx512_vnni.onnx``, the name its ``export_dynamic_quantized_onnx_model`` gives an
avx512_vnni dynamic quantisation), with the I/O names of optimum's feature-extraction export: inputs
``input_ids``, ``attention_mask`` (and ``token_type_ids`` if the model takes them), output
``last_hidden_state``; batch and sequence axes dynamic. Pooling, Dense and Normalize stay the folder's
sentence-transformers modules, so the ONNX file replaces only the transformer.

Exported with the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) at opset 17 from the
eager attention path (sdpa's fused kernel has no ONNX form in that exporter); int8 is onnxruntime's
``quantize_dynamic`` (weights int8 per channel, activations quantised at run time). Both files are
encoded with :class:`pipeline.export.onnx_encode.OnnxEncoder` on a sample and compared with the PyTorch
encoder: fp32 must reach cosine >= ``FP32_MIN_COSINE`` on every sentence, int8 >= ``INT8_MIN_COSINE``
(a lossy format: the figure is written into the card), or the export fails.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import InputError
from pipeline.export.onnx_encode import INT8_FILE, ONNX_FILE, OnnxEncoder

log = logging.getLogger(__name__)

FP32_MIN_COSINE = 0.9999
INT8_MIN_COSINE = 0.95
OPSET = 17


class _LastHiddenState:
    """Wraps the backbone so that the traced graph has exactly the optimum feature-extraction I/O."""

    @staticmethod
    def build(backbone: Any, with_token_types: bool) -> Any:
        import torch

        class Body(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.backbone = backbone

            def forward(self, input_ids, attention_mask, token_type_ids=None):  # noqa: ANN001
                kwargs = {"token_type_ids": token_type_ids} if with_token_types else {}
                return self.backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]

        return Body().eval()


def takes_token_types(backbone: Any) -> bool:
    import inspect

    return "token_type_ids" in inspect.signature(backbone.forward).parameters


def export_onnx(encoder: Any, path: Path) -> bool:
    """Write the transformer of ``encoder`` to ``path``; returns whether it takes token_type_ids."""
    import torch

    backbone = encoder.backbone
    if encoder.pooling == "first_last_avg":
        raise InputError(
            "--onnx: first_last_avg pooling reads every layer, and sentence-transformers' ONNX backend gives "
            "only the last; export a cls or mean pooled model"
        )
    with_types = takes_token_types(backbone)
    batch = encoder.tokenizer(["今天天气很好", "一个男人在弹吉他，旁边有一只狗在睡觉。"], padding=True,
                              return_tensors="pt")  # fmt: skip
    inputs = [batch["input_ids"], batch["attention_mask"]]
    names = ["input_ids", "attention_mask"]
    if with_types:
        inputs.append(batch.get("token_type_ids", torch.zeros_like(batch["input_ids"])))
        names.append("token_type_ids")
    axes = {name: {0: "batch_size", 1: "sequence_length"} for name in names}
    axes["last_hidden_state"] = {0: "batch_size", 1: "sequence_length"}
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = getattr(backbone.config, "_attn_implementation", None)
    dtype = next(backbone.parameters()).dtype
    backbone.float()
    try:
        if previous is not None and previous != "eager":
            backbone.set_attn_implementation("eager")
        with torch.no_grad():
            torch.onnx.export(
                _LastHiddenState.build(backbone, with_types), tuple(inputs), str(path), input_names=names,
                output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=OPSET, dynamo=False,
            )  # fmt: skip
    finally:
        if previous is not None and previous != "eager":
            backbone.set_attn_implementation(previous)
        backbone.to(dtype)
    return with_types


def quantize_int8(source: Path, target: Path) -> None:
    """Dynamic int8 quantisation (onnxruntime): weights int8 per channel, activations uint8 at run time."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()  # the quantizer logs a line per tensor at INFO on the root logger
    level = root.level
    root.setLevel(max(level, logging.WARNING))
    try:
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=True,
                         reduce_range=False)  # fmt: skip
    finally:
        root.setLevel(level)


def vnni() -> str:
    """Which int8 dot-product instructions this CPU has, as the card says where the int8 file was checked:
    onnxruntime's int8 kernels use VNNI where present, and AVX2's VPMADDUBSW, whose 16-bit sums can
    saturate, elsewhere (onnxruntime's quantization docs)."""
    import torch

    caps = getattr(torch.cpu, "get_capabilities", dict)()
    names = (("avx512_vnni", "AVX512-VNNI"), ("avx_vnni", "AVX-VNNI"))
    found = [name for key, name in names if caps.get(key)]
    return " and ".join(found) if found else "no VNNI (AVX2's 16-bit sums)"


def compare(folder: Path, file_name: str, sentences: list[str], reference: np.ndarray) -> dict[str, float]:
    """Cosine of the ONNX vectors of ``sentences`` with ``reference`` (the PyTorch encoder's)."""
    got = OnnxEncoder(folder, file_name).encode(sentences)
    cosines = (got * reference).sum(axis=1)  # both are unit rows
    return {"min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean())}


def require_onnx() -> None:
    """Fail before any work when the packages --onnx needs are missing."""
    import importlib.util

    missing = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"--onnx needs {' and '.join(missing)}: pip install -e '.[onnx]' (or drop --onnx)")


def write_onnx(encoder: Any, folder: Path, int8: bool, sentences: list[str]) -> dict[str, Any]:
    """ONNX (and int8) files in ``folder/onnx/``, each checked against ``encoder`` on ``sentences``."""
    require_onnx()
    start = time.perf_counter()
    reference = encoder.encode(sentences)  # (N, dim), the PyTorch vectors, prompt included
    token_types = export_onnx(encoder, folder / ONNX_FILE)
    files = [{"file": ONNX_FILE, "kind": "fp32", **compare(folder, ONNX_FILE, sentences, reference)}]
    if files[0]["min_cosine"] < FP32_MIN_COSINE:
        raise InputError(
            f"the ONNX export does not reproduce the PyTorch vectors: min cosine "
            f"{files[0]['min_cosine']:.6f} < "
            f"{FP32_MIN_COSINE} on {len(sentences)} sentences; report this with the model"
        )
    if int8:
        quantize_int8(folder / ONNX_FILE, folder / INT8_FILE)
        files.append({"file": INT8_FILE, "kind": "int8 (dynamic, per channel)", "checked_with": vnni(),
                      **compare(folder, INT8_FILE, sentences, reference)})  # fmt: skip
        if files[1]["min_cosine"] < INT8_MIN_COSINE:
            raise InputError(
                f"the int8 ONNX model is too far from the PyTorch vectors: min cosine "
                f"{files[1]['min_cosine']:.4f} < {INT8_MIN_COSINE}; export without --onnx-int8"
            )
    for entry in files:
        entry["bytes"] = (folder / entry["file"]).stat().st_size
        log.info("%s: min cosine %.6f, mean %.6f to PyTorch on %d sentences", entry["file"],
                 entry["min_cosine"], entry["mean_cosine"], len(sentences))  # fmt: skip
    return {"files": files, "sentences": len(sentences), "token_type_ids": token_types, "opset": OPSET,
            "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
