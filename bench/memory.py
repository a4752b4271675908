"""Per-rank parameter + optimizer-state memory under SimpleFSDP fully_shard, 1, 2 and 4 ranks.

Each rank builds the model on the meta device, materialises it sharded (materialize_and_init)
and creates the AdamW state; the bytes it then stores locally (parameter shards + both moments)
are compared with the unsharded single-process total. Runs on local gloo ranks on the CPU.

    python bench/memory.py                          # llama3 debug flavor, 1 / 2 / 4 ranks
    python bench/memory.py --flavor 1B --ranks 1 8  # any flavor (the 1B needs ~15 GB of RAM per rank)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from dist_utils import run_distributed  # noqa: E402  (shared with the multi-process tests)

from titan_tpu.models.common.transformer import Transformer  # noqa: E402
from titan_tpu.models.registry import get_model_args  # noqa: E402
from titan_tpu.parallel.mesh import ParallelDims  # noqa: E402
from titan_tpu.parallel.simple_fsdp import MixedPrecision, local_bytes, materialize_and_init  # noqa: E402
from titan_tpu.train.optim import AdamW  # noqa: E402


def measure(name: str, flavor: str) -> dict:
    """Bytes of parameters and AdamW state stored on this rank."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims(world_size=world_size)
    mesh = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(get_model_args(name, flavor))
    model = materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                 seed=0)
    optimizer = AdamW(dict(model.named_parameters()))
    moments = [t for key in ("exp_avg", "exp_avg_sq") for t in optimizer.state[key].values()]
    return {"params": local_bytes(model.parameters()), "optimizer": local_bytes(moments)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="llama3")
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    a = parser.parse_args()

    unsharded = None
    print(f"{a.name}/{a.flavor}, fp32, fully_shard; bytes stored per rank (max over ranks)")
    print(f"{'ranks':>5} {'params MiB':>11} {'optimizer MiB':>14} {'total MiB':>10} {'vs unsharded':>13}")
    for ranks in a.ranks:
        if ranks == 1:
            per_rank = [measure(a.name, a.flavor)]
        else:
            per_rank = run_distributed(measure, world_size=ranks, args=(a.name, a.flavor), timeout_s=600)
        worst = max(per_rank, key=lambda r: r["params"] + r["optimizer"])
        total = worst["params"] + worst["optimizer"]
        if unsharded is None:
            unsharded = total if ranks == 1 else measure(a.name, a.flavor)["params"] * 3
        mib = 2**20
        print(f"{ranks:>5} {worst['params'] / mib:>11.2f} {worst['optimizer'] / mib:>14.2f} {total / mib:>10.2f} "
              f"{total / unsharded:>13.3f}")


if __name__ == "__main__":
    main()
