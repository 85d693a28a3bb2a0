"""Where W^T's bytes go wrong on a GPU, if they do: the weight quantizer's own W^T (``wt_with("quantizer")``)
and W^T transposed after it by each byte transpose (``transpose_with``), each against torch's ``.t()`` of W's
bytes, on ``kernels.fp8._wt_exact``'s stacks, repeated; then ``_wt_exact`` itself, repeated.

On an H200 on 2026-11-29 ``_wt_exact`` said True in a bench process (the quantizer's W^T was then timed and
chosen) and False in a test process running beside seven others on the same GPU. One JSON line per finding;
the last line sums them up.

    python3 docs/experiments/wt_exact_check.py [--repeats 20] [--warps 4,8,16]
"""

from __future__ import annotations

import argparse
import json

import torch

from jetrl_cli.kernels import fp8
from jetrl_cli.precision import gemm
from jetrl_cli.kernels.layouts import scale_buffer


def stacks(device):
    g = torch.Generator().manual_seed(0)
    s = [[(torch.randn(256, 384, generator=g) * 0.02).to(device), torch.randn(144, 384, generator=g).to(device)],
         [torch.randn(160, 208, generator=g).to(device)]]
    s[0][1][3, 7] = float("nan")
    return s


def wrong_bytes(wt: torch.Tensor, w: torch.Tensor) -> dict | None:
    """Where W^T's bytes differ from torch's transpose of W's (None: equal)."""
    got, want = wt.view(torch.uint8), w.view(torch.uint8).t()
    got = got[: want.shape[0], : want.shape[1]]
    bad = got != want
    if not bool(bad.any()):
        return None
    rows = bad.any(1).nonzero().flatten().tolist()
    cols = bad.any(0).nonzero().flatten().tolist()
    return {"bytes": int(bad.sum()), "of": bad.numel(), "rows": rows[:16], "n_rows": len(rows), "cols": cols[:16],
            "n_cols": len(cols)}


def check(device, way, transpose, fill, one_buffer) -> list[dict]:
    found = []
    for i, stack in enumerate(stacks(device)):
        with fp8.wt_with("after"), fp8.transpose_with("torch"):
            held = fp8.quantize_weight_stack(stack, transposed=True)
        for q in held:
            if fill is not None:
                q.data.view(torch.uint8).fill_(fill)
                scale_buffer(q).view(torch.uint8).fill_(fill)
        with fp8.wt_with(way), fp8.transpose_with(transpose):
            if one_buffer:
                with fp8.stacks_in_one_buffer():
                    w, wt = fp8.quantize_weight_stacks([stack], transposed=True)[0]
            else:
                w, wt = fp8.quantize_weight_stack(stack, transposed=True, held=held if fill is not None else None)
        bad = wrong_bytes(wt.data, w.data)
        if bad:
            found.append({"stack": i, "way": way, "transpose": transpose, "fill": fill, "one_buffer": one_buffer,
                          **bad})
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (TRITON_INTERPRET=1)")
    ap.add_argument("--warps", default="", help="e.g. 4,8,16: only the quantizer's W^T, launched at each")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.warps:  # the quantizer's W^T at each launch (``tile_warps``), against the transpose of its W
        for w in (int(x) for x in args.warps.split(",")):
            with fp8.tile_warps(w):
                found = [f for _ in range(args.repeats) for f in check(dev, "quantizer", "torch", None, False)]
            print(json.dumps({"warps": w, "checks": 2 * args.repeats, "wrong": len(found),
                              "first": found[0] if found else None}), flush=True)
        return
    counts: dict[str, int] = {}
    runs = 0
    for r in range(args.repeats):
        for way, transposes in (("quantizer", ("torch",)), ("after", fp8.TRANSPOSE_WAYS)):
            for transpose in transposes:
                for fill, one in ((None, False), (0x00, False), (0xFF, False), (0x5A, False), (None, True)):
                    runs += 1
                    for f in check(dev, way, transpose, fill, one):
                        key = f"{way}/{transpose}"
                        counts[key] = counts.get(key, 0) + 1
                        if counts[key] <= 6:
                            print(json.dumps({"repeat": r, **f}), flush=True)
    exact = []
    for _ in range(args.repeats):
        gemm._KERNELS.clear()
        exact.append(bool(fp8._wt_exact(dev)))
    print(json.dumps({"checks": runs, "wrong": counts, "wt_exact": exact}), flush=True)


if __name__ == "__main__":
    main()
