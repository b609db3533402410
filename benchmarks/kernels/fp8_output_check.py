"""Check flashinfer's FP8 fused output (trtllm_allreduce_fusion, kARResidualRMSNormFP8Quant)
element by element against two references, using flashinfer and torch only.

    python -m arfusion.benchmarks.kernels.fp8_output_check [--ranks-share-gpu]

Two ranks over a gloo group (one per GPU, or both on GPU 0 with ``--ranks-share-gpu``: run it
under CUDA MPS), hidden 4096, bf16, scale 0.05. For each case (tokens, one-shot / two-shot, PDL
on / off) the kernel runs three times on the same inputs, ``quant_out`` pre-filled with e4m3 NaN
(0x7F) so that an element never written stays NaN, and rank 0 prints, per reference, how many
elements differ, how many of those are 0 in the kernel's output, and how many stayed unwritten:

- ``one rounding``: ``e4m3(bf16(norm(fp32(x_0) + fp32(x_1) + fp32(residual))) / scale)``, the
  partial sums and the residual added in fp32 and rounded once;
- ``rounding points``: the unfused path's rounding points (`fusion.reference`): the all-reduced
  sum rounded to bf16, then the residual added in fp32 and rounded to bf16, the norm in fp32
  rounded to bf16, then ``e4m3(normed * (1 / scale))``, the quantisation flashinfer documents.

Also printed: whether the positions that differ move between the three runs (a race would move
them) and, against ``rounding points``, the largest difference in e4m3 ulps.
"""
from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EPS = 1e-6
HIDDEN, SCALE = 4096, 0.05
E4M3_NAN = 0x7F
PATTERN_RESIDUAL_RMS_NORM_FP8 = 2


def case_inputs(world: int, tokens: int, seed: int, dev: torch.device) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Every rank's partial sum, the residual and the norm weight (bf16, random, seeded)."""
    parts = [torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed * 100 + r)) for r in range(world)]
    shared = torch.Generator().manual_seed(seed * 100 + 99)
    residual = torch.randn(tokens, HIDDEN, generator=shared)
    weight = 1 + 0.2 * torch.randn(HIDDEN, generator=shared)
    return [p.to(dev, torch.bfloat16) for p in parts], residual.to(dev, torch.bfloat16), weight.to(dev, torch.bfloat16)


def norm(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(torch.bfloat16)


def one_rounding(parts: list, residual: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    normed = norm(sum(p.float() for p in parts) + residual.float(), weight)
    return (normed.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def rounding_points(parts: list, residual: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    reduced = sum(p.float() for p in parts).to(torch.bfloat16)
    residual_out = (reduced.float() + residual.float()).to(torch.bfloat16)
    normed = norm(residual_out.float(), weight)
    return (normed.float() * (1.0 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn)


def e4m3_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| in units of e4m3's spacing at the larger magnitude (3 mantissa bits)."""
    af, bf = a.float(), b.float()
    ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(af.abs(), bf.abs()).clamp_min(2 ** -6))) - 3)
    return ((af - bf).abs() / ulp).max().item()


def worker(rank: int, world: int, port: int, share_gpu: bool) -> None:
    import flashinfer.comm as fi_comm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", 0 if share_gpu else rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    ws = fi_comm.create_allreduce_fusion_workspace(backend="trtllm", world_size=world, rank=rank, max_token_num=1024,
                                                   hidden_dim=HIDDEN, dtype=torch.bfloat16, group=group)
    scale = torch.tensor([SCALE], device=dev, dtype=torch.float32)
    for tokens in (1, 8, 64, 256, 1024):
        parts, residual, weight = case_inputs(world, tokens, tokens, dev)
        references = {"one rounding": one_rounding(parts, residual, weight, scale),
                      "rounding points": rounding_points(parts, residual, weight, scale)}
        for one_shot in (True, False):
            if not one_shot and tokens <= world:
                continue  # two-shot needs more tokens than ranks
            for pdl in (True, False):
                outputs = []
                for _ in range(3):
                    quant = torch.full((tokens, HIDDEN), E4M3_NAN, dtype=torch.uint8, device=dev)
                    quant = quant.view(torch.float8_e4m3fn)
                    fi_comm.allreduce_fusion(input=parts[rank].clone(), workspace=ws,
                                             pattern=PATTERN_RESIDUAL_RMS_NORM_FP8, launch_with_pdl=pdl,
                                             trigger_completion_at_end=True, use_oneshot=one_shot,
                                             residual_in=residual.clone(), rms_gamma=weight, rms_eps=EPS,
                                             residual_out=torch.empty_like(residual), quant_out=quant,
                                             scale_factor=scale)
                    torch.cuda.synchronize()
                    outputs.append(quant.float())
                if rank != 0:
                    continue
                cells = []
                for name, want in references.items():
                    w = want.float()
                    diffs = [(q != w) & ~torch.isnan(q) for q in outputs]
                    moved = not all(torch.equal(diffs[0], d) for d in diffs[1:])
                    q = outputs[0]
                    cells.append(f"{name}: differ {int(diffs[0].sum())}, of which 0 in the kernel "
                                 f"{int((diffs[0] & (q == 0)).sum())}, positions move {moved}")
                unwritten = int(torch.isnan(outputs[0]).sum())
                worst = e4m3_ulps(outputs[0], references["rounding points"])
                print(f"T={tokens} {'one' if one_shot else 'two'}-shot pdl={pdl}: unwritten {unwritten}; "
                      + "; ".join(cells) + f"; max ulps vs rounding points {worst:g}", flush=True)
    ws.destroy()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks-share-gpu", action="store_true", help="both ranks on GPU 0 (run under MPS)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args.ranks_share_gpu), nprocs=2, join=True)


if __name__ == "__main__":
    main()
