"""SDPA's flash and math kernels on CPU, forward + backward and forward alone, at a training batch's
shapes: why a CPU bf16 training forward computes attention with the math kernel
(``pipeline.train.build.autocast_bf16_on_cpu``) while inference keeps the flash kernel.

Each cell times ``scaled_dot_product_attention`` (with a boolean padding mask, as the encoder passes one)
and, with ``--backward``, the backward of its sum; median of ``--repeats`` after 2 warm-up calls. The
error column is the largest absolute difference of the output and q's gradient from a float64 math
reference on the same inputs.

    .venv/bin/python benchmarks/cpu_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from _common import table, timed
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def attention(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    grad: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    q, k, v = (t.detach().requires_grad_(grad is not None) for t in (q, k, v))
    with sdpa_kernel(KERNELS[kernel]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if grad is None:
        return out, None
    out.backward(grad)
    return out, q.grad


def cell(
    kernel: str, dtype: torch.dtype, shape: tuple[int, int, int, int], backward: bool, repeats: int
) -> dict[str, float]:
    b, h, t, d = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) for _ in range(4))
    mask = torch.ones(b, 1, t, t, dtype=torch.bool)
    mask[: b // 2, ..., t - t // 4 :] = False  # half the rows padded by a quarter
    ref_out, ref_grad = attention("math", q, k, v, mask, grad if backward else None)
    q, k, v, g = (x.to(dtype) for x in (q, k, v, grad))
    results = []  # the last call's output and q's gradient
    times = [timed(lambda: results.append(attention(kernel, q, k, v, mask, g if backward else None)))
             for _ in range(repeats + 2)][2:]  # fmt: skip
    out, q_grad = results[-1]
    err = (out.double() - ref_out).abs().max().item()
    if backward:
        err = max(err, (q_grad.double() - ref_grad).abs().max().item())
    return {"ms": 1e3 * statistics.median(times), "err": err}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64, help="sequences")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head_dim", type=int, default=32)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 24, 32, 48, 64, 128])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.batch} x {args.heads} heads x "
        f"{args.head_dim}; median ms of {args.repeats} (largest error against float64)"
    )
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for backward in (True, False):
            for t in args.lengths:
                shape = (args.batch, args.heads, t, args.head_dim)
                r = {k: cell(k, dtype, shape, backward, args.repeats) for k in KERNELS}
                rows.append([
                    str(dtype)[6:], "forward+backward" if backward else "forward", t,
                    *(f"{r[k]['ms']:.2f} ({r[k]['err']:.0e})" for k in KERNELS),
                    f"{r['flash']['ms'] / r['math']['ms']:.2f}",
                ])  # fmt: skip
    print(table(["dtype", "pass", "tokens", "flash ms (error)", "math ms (error)", "flash / math"], rows))


if __name__ == "__main__":
    main()
