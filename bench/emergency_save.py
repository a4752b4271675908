"""How long SIGTERM's saves take: the local tier against the persistent checkpoint, and a resume from the local tier.

    python bench/emergency_save.py [--hidden 1024] [--layers 8] [--vocab 32000] [--work DIR]

One process builds a Llama-shaped model of the Transformers backend (fp32 master weights and two
AdamW moments: 12 bytes per parameter in a checkpoint), takes one step, then writes the local tier
(checkpoint.local_dir: /dev/shm, host memory) and the persistent checkpoint (DCP into the output
directory, every file fsynced), each timed, and prints their seconds and ratio. A second trainer then
resumes from the local tier alone (the persistent checkpoint moved aside) and its model and
optimizer state must equal the first's bit for bit.

Memory: the model, its moments and a copy in /dev/shm (about 3 x 12 bytes per parameter). The
default is 166 M parameters (a 2 GB checkpoint).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from titan_tpu.config import build_config  # noqa: E402
from titan_tpu.loops import Loop, assemble  # noqa: E402


def trainer(work: Path, args, local_dir: Path) -> Loop:
    overrides = {
        "output_dir": work / "run", "data.cache_dir": work / "cache", "data.max_bytes": 300_000,
        "training.device": "cpu", "training.deterministic": "true", "training.batch_size": 1, "training.seq_len": 64,
        "training.steps": 2, "model.name": "hf", "model.hf_config": "llama",
        "model.hf_overrides": f"hidden_size={args.hidden},intermediate_size={4 * args.hidden},"
                              f"num_hidden_layers={args.layers},num_attention_heads=16,num_key_value_heads=16,"
                              f"vocab_size={args.vocab}",
        "metrics.console": "false", "metrics.tensorboard": "false", "validation.enabled": "false",
        "checkpoint.local_dir": local_dir, "checkpoint.local_interval": 1,
    }
    return assemble(build_config(None, [x for k, v in overrides.items() for x in (f"--{k}", str(v))]))


def state_tensors(t: Loop) -> dict[str, torch.Tensor]:
    sd = t.state_dict()
    out = {f"model.{k}": v for k, v in sd["model"].items()}
    for group in ("exp_avg", "exp_avg_sq"):
        out.update({f"{group}.{k}": v for k, v in sd["optimizer"][group].items()})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--work", help="working directory (default: a temporary one, removed)")
    args = parser.parse_args()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="emergency_save_"))
    local_dir = Path(tempfile.mkdtemp(prefix="emergency_save_", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        first = trainer(work, args, local_dir)
        first.saving.maybe_resume()
        first.train_step()
        params = sum(p.numel() for p in first.components.model.parameters())
        start = time.perf_counter()
        first.saving.save_local_tier()
        local = time.perf_counter() - start
        start = time.perf_counter()
        first.saving.save_checkpoint()
        persistent = time.perf_counter() - start
        size = sum(f.stat().st_size for f in (work / "run" / "checkpoints").rglob("*") if f.is_file())
        local_size = sum(f.stat().st_size for f in local_dir.rglob("*") if f.is_file())
        want = {k: v.detach().clone() for k, v in state_tensors(first).items()}
        del first
        shutil.move(work / "run" / "checkpoints", work / "aside")  # only the local tier is left
        second = trainer(work, args, local_dir)
        from_local = second.saving.maybe_resume()
        got = state_tensors(second)
        bitwise = from_local and second.step == 1 and all(torch.equal(got[k], v) for k, v in want.items())
        print(f"{params / 1e6:.0f} M parameters, checkpoint {size / 1e9:.2f} GB (local tier "
              f"{local_size / 1e9:.2f} GB): local tier {local:.2f} s "
              f"({local_dir.parent}), persistent checkpoint {persistent:.2f} s ({work}), persistent / local "
              f"{persistent / local:.1f}x; resumed from the local tier bitwise: {'yes' if bitwise else 'NO'}",
              flush=True)
        return 0 if bitwise else 1
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
