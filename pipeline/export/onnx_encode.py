"""Encode with an exported folder's ONNX model: numpy, tokenizers and onnxruntime only (no torch).

    from pipeline.export.onnx_encode import OnnxEncoder

    encoder = OnnxEncoder("runs/sample/model")                        # onnx/model.onnx
    encoder = OnnxEncoder("runs/sample/model", "onnx/model_qint8_avx512_vnni.onnx")   # int8
    queries = encoder.encode(["怎么还花呗"])                            # the folder's default prompt
    documents = encoder.encode(["花呗的还款方式……"], prompt_name="passage")

It reads the folder as sentence-transformers does: ``tokenizer.json`` (truncated at
``sentence_bert_config.json``'s ``max_seq_length``), the prompts of ``config_sentence_transformers.json``
(put before each text and pooled over, ``include_prompt``), the Pooling module (cls or mean), a Dense
module (weights in its ``model.safetensors``, identity or tanh) between Normalize modules, and returns
L2-normalised float32 rows. Importing this module imports no torch (tests/test_export_onnx.py checks),
so a service can depend on ``onnxruntime`` alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ONNX_FILE = "onnx/model.onnx"
INT8_FILE = "onnx/model_qint8_avx512_vnni.onnx"


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


class OnnxEncoder:
    def __init__(self, folder: str | Path, file_name: str = ONNX_FILE, threads: int | None = None) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        folder = Path(folder)
        self.folder = folder
        modules = _read(folder / "modules.json")
        kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
        if "WeightedLayerPooling" in kinds:
            raise ValueError(
                f"{folder}: first_last_avg pooling needs every layer; the ONNX export has the last"
            )
        by_kind = {k: m for k, m in zip(kinds, modules)}
        pooling = _read(folder / by_kind["Pooling"]["path"] / "config.json")
        self.pooling = "cls" if pooling.get("pooling_mode_cls_token") else "mean"
        self.max_length = int(_read(folder / "sentence_bert_config.json").get("max_seq_length") or 512)
        settings = _read(folder / "config_sentence_transformers.json")
        self.prompts: dict[str, str] = dict(settings.get("prompts") or {})
        self.default_prompt_name: str | None = settings.get("default_prompt_name")
        self.dense: tuple[np.ndarray, np.ndarray | None, str] | None = None
        self.normalize_before_dense = False
        if "Dense" in by_kind:
            from safetensors.numpy import load_file

            dense_dir = folder / by_kind["Dense"]["path"]
            config, tensors = (
                _read(dense_dir / "config.json"),
                load_file(str(dense_dir / "model.safetensors")),
            )
            activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
            self.dense = (tensors["linear.weight"], tensors.get("linear.bias"), activation.rsplit(".", 1)[-1])
            self.normalize_before_dense = kinds[kinds.index("Dense") - 1] == "Normalize"
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_length)
        pad = _read(folder / "tokenizer_config.json").get("pad_token") or "[PAD]"
        pad = pad.get("content") if isinstance(pad, dict) else pad
        self.tokenizer.enable_padding(pad_id=self.tokenizer.token_to_id(pad) or 0, pad_token=pad)
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(
            str(folder / file_name), options, providers=["CPUExecutionProvider"]
        )
        self.input_names = [i.name for i in self.session.get_inputs()]

    def prompt(self, prompt_name: str | None) -> str:
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            raise ValueError(f"prompt {name!r} is not one of the folder's prompts {sorted(self.prompts)}")
        return self.prompts[name]

    def encode(
        self, texts: Sequence[str], prompt_name: str | None = None, batch_size: int = 32
    ) -> np.ndarray:
        """(N, dim) float32, L2-normalised; ``prompt_name`` picks a prompt (default: the folder's)."""
        prefix = self.prompt(prompt_name)
        out = []
        for start in range(0, len(texts), batch_size):
            encodings = self.tokenizer.encode_batch([prefix + t for t in texts[start : start + batch_size]])
            ids = np.array([e.ids for e in encodings], dtype=np.int64)  # (B, T)
            mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)  # (B, T)
            feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
            states = self.session.run(["last_hidden_state"], {k: feed[k] for k in self.input_names})[0]
            out.append(self.head(states, mask))
        return np.concatenate(out) if out else np.zeros((0, self.dim), np.float32)

    @property
    def dim(self) -> int:
        return (
            int(self.dense[0].shape[0])
            if self.dense is not None
            else int(self.session.get_outputs()[0].shape[-1])
        )

    def head(self, states: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Pooling -> [Normalize -> Dense] -> Normalize, on (B, T, H) states; (B, dim) float32."""
        if self.pooling == "cls":
            x = states[:, 0].astype(np.float32)
        else:
            m = mask[..., None].astype(np.float32)  # (B, T, 1)
            x = (states * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
        if self.dense is not None:
            weight, bias, activation = self.dense
            if self.normalize_before_dense:
                x = x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)
            x = x @ weight.T + (bias if bias is not None else 0)
            if activation == "Tanh":
                x = np.tanh(x)
        return (x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)).astype(np.float32)
