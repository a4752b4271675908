"""Where the time of an eager training step goes: torch's profiler over three steps (after two
warm-up steps), self CPU time per op, grouped by the product's categories (titan_tpu/train/profiling.py,
the same table `[profiling] enabled = true` prints in a run). It is how the planner's time model was
checked (docs/planner.md, "Speed"): matmuls against the compute term, the rest against the
elementwise term.

    python bench/step_profile.py configs/qwen3_moe_debug.toml
    python bench/step_profile.py configs/llama3_debug.toml --training.seq_len 512

Arguments after the config are the trainer's overrides. Run it alone on the machine (a timing).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from titan_tpu.config import build_config
from titan_tpu.models.registry import build_model
from titan_tpu.models.spec import model_spec
from titan_tpu.train.optim import AdamW
from titan_tpu.train.profiling import format_table, time_by_category
from titan_tpu.train.step import EagerStep


def main(argv: list[str]) -> int:
    cfg = build_config(argv[0], argv[1:])
    t = cfg.training
    args = dataclasses.replace(model_spec(cfg.model).args, max_seq_len=t.seq_len)
    model = build_model(args, seed=0, scan_layers=cfg.model.scan_layers, ac_mode=cfg.activation_checkpoint.mode,
                        kernels=cfg.kernels)
    optimizer = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    step = EagerStep(model, optimizer, max_norm=t.max_norm)
    tokens = torch.randint(0, args.vocab_size, (t.batch_size, t.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    for _ in range(2):
        step([batch], 1e-4)
    steps = 3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step([batch], 1e-4)
    rows = sorted(((e.key, e.self_cpu_time_total / steps / 1e3, e.count // steps) for e in prof.key_averages()),
                  key=lambda r: -r[1])
    total = sum(ms for _, ms, _ in rows)
    print(format_table(time_by_category(prof.events(), steps=steps, device=False),
                       title=f"{argv[0]} {' '.join(argv[1:])}: {total:.1f} ms of self CPU time per step "
                             f"({t.batch_size * t.seq_len} tokens)"))
    print("largest ops:")
    for op, ms, count in rows[:15]:
        print(f"  {op:60s} {ms:8.2f} ms  x{count}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
