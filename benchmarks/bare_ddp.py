"""The baseline `training_overhead` compares the flow with: a bare torchrun DDP script training the
same model (the project's ``Decoder``) on the same token file with the same batch, optimizer
and precision, and nothing else (no Prefect, worker, engine, storage layer or checkpoint).
Rank 0 prints one JSON line: steady-state tokens/s (steps after the first) and the per-step times.

    torchrun --nproc-per-node 2 benchmarks/bare_ddp.py --model gpt-nano --data tokens.bin \
        --global-batch 8 --micro-batch 2 --seq-len 128 --steps 20 --precision fp32
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from frenzy_prefect.profiling.model import resolve_model
from frenzy_prefect.spec.request import OptimizerSettings
from frenzy_prefect.training.decoder import Decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="a local uint16 token file")
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    spec = resolve_model(args.model, seq_len=args.seq_len)
    model = DistributedDataParallel(Decoder(spec), gradient_as_bucket_view=True)
    settings = OptimizerSettings()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
    tokens = np.memmap(args.data, dtype=np.uint16, mode="r")
    generator = torch.Generator().manual_seed(rank)
    accumulation = args.global_batch // (world * args.micro_batch)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(tokens) - args.seq_len - 1, (args.micro_batch,), generator=generator).tolist()
        windows = torch.from_numpy(np.stack([tokens[s : s + args.seq_len + 1].astype(np.int64) for s in starts]))
        return windows[:, :-1], windows[:, 1:]

    step_s = []
    for _ in range(args.steps):
        began = time.perf_counter()
        for i in range(accumulation):
            x, y = batch()
            last = i == accumulation - 1
            with model.no_sync() if not last else torch.enable_grad():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                    loss = model(x, y) / accumulation
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        step_s.append(time.perf_counter() - began)
    if rank == 0:
        steady = step_s[1:]
        rate = len(steady) * args.global_batch * args.seq_len / sum(steady)
        print(json.dumps({"tokens_per_s": rate, "step_s": step_s}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
