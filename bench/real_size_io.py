"""Host memory of Hugging Face weights in and out at a real size: Llama 3 8B's shapes.

1. `make`: a synthetic Hugging Face directory of Llama 3 8B (random bf16, seeded per tensor,
   16 GB in four shard files with an index, as the Hub shards it).
2. `load`: each of 4 ranks of a dp_shard 4 run builds its shard of the model (fp32 master weights,
   as a run holds them; no optimizer) and loads the directory (`checkpoint.initial_load_path`'s path,
   models/spec.py `load_hf_weights`), one fresh process per rank, one after another (four at
   once would not fit this 24 GiB machine beside their own shares; each process is one rank of a
   fake 4-rank world, components/world.py `fake_world`). Printed per rank: its share (the bytes
   of its local weights), its peak RSS, and the check that every local block is bitwise the
   block torch's own sharding (`distribute_tensor`) cuts from the tensor read whole by one
   process.
3. `convert`: `titan-tpu convert --hf-dir --to-checkpoint` (here into float32, a run's master
   weights: the import's placeholders say float32) and `convert --to-hf` of that checkpoint in
   bfloat16, each in a fresh process with its peak RSS above its baseline (the RSS after
   imports), and the export checked bitwise against the directory it came from.

    .venv/bin/python bench/real_size_io.py --dir /tmp/io8b               # all three, about 64 GB of disk
    .venv/bin/python bench/real_size_io.py --dir /tmp/io8b --steps load   # one step (make first)
    .venv/bin/python bench/real_size_io.py --dir /tmp/iodebug --flavor debug  # the bench itself, in seconds

Goals (docs/huggingface.md): a rank's peak at most its share + 2 GB; an export's at most its
baseline + 4 GB.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
WORLD = 4
FLAVOR = "8B"  # --flavor debug: the same steps in seconds (a check of the bench itself)


def rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def peak_rss() -> int:
    """This process's peak RSS since it started, or since the last `reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build_rank_model(cfg, world: int):
    """The model of this rank as a run builds it (models/spec.py `build`: sharded, float32 master
    weights, initialised piece by piece), without the optimizer: its moments are the run's, not the
    load's."""
    import torch
    import torch.distributed as dist

    from titan_tpu.components.program import build_model
    from titan_tpu.components.world import Place
    from titan_tpu.run.resolved import Reshard, Target, resolve_run
    from titan_tpu.run.setup import RunSetup

    run = resolve_run(RunSetup.resolved(cfg), Target(world_size=world))
    run = run.with_reshard(run.reshard or Reshard(True, "the save and load do not run the step"))
    return build_model(run, Place.of(run, rank=dist.get_rank() if dist.is_initialized() else 0,
                                     device=torch.device("cpu")))


def _config(world: int):
    from titan_tpu.config import build_config

    return build_config(ROOT / "configs" / "llama3_debug.toml",
                        ["--model.flavor", FLAVOR, "--training.device", "cpu", "--parallelism.dp_shard", str(world),
                         "--model.dtype", "bfloat16"])


class Seeded:
    """A random bf16 tensor of `shape`, the same for the same key (its crc32 seeds it)."""

    def __init__(self, key: str, shape: tuple[int, ...]):
        self.key, self.shape, self._whole = key, shape, None

    def read(self, index):
        import torch

        if self._whole is None:
            gen = torch.Generator().manual_seed(zlib.crc32(self.key.encode()))
            self._whole = (torch.randn(self.shape, generator=gen) * 0.02).to(torch.bfloat16)
        block = self._whole[index]
        if all(s.start == 0 and s.stop == n for s, n in zip(index, self.shape)) or index[0].stop == self.shape[0]:
            self._whole = None  # the writer has read its last rows
        return block


def make(directory: Path) -> None:
    import torch

    from titan_tpu.models.hub.adapter import native_param_shapes
    from titan_tpu.models.hub.checkpoint import save_hf_sources
    from titan_tpu.models.spec import model_spec

    spec = model_spec(_config(1).model)
    sources = {key: Seeded(key, shape) for key, shape in native_param_shapes(spec.args).items()}
    start = time.perf_counter()
    out = save_hf_sources(directory / "hf", name=spec.name, args=spec.args, sources=sources, dtype=torch.bfloat16,
                          max_shard_bytes=5 * 10**9, overwrite=True)
    files = sorted(out.glob("*.safetensors"))
    print(f"make: {out}: {len(files)} shards, {sum(f.stat().st_size for f in files) / GB:.2f} GB "
          f"in {time.perf_counter() - start:.0f} s", flush=True)


def load_rank(directory: Path, rank: int) -> dict:
    """One rank of a fake 4-rank world: build, load, measure, then check."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from titan_tpu.components.world import fake_world
    from titan_tpu.models.hub.checkpoint import hf_native_sources
    from titan_tpu.models.hub.sources import full_index
    from titan_tpu.models.spec import model_spec

    cfg = _config(WORLD)
    spec = model_spec(cfg.model)
    with fake_world(WORLD, rank):
        baseline = rss_now()
        model = build_rank_model(cfg, WORLD)
        init_peak = peak_rss()  # initialising holds one piece (the embedding) at full size
        state = model.state_dict()
        share = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in state.values())
        # What initialising freed but the C allocator kept is given back first: not the load's.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        built = rss_now()
        reset_peak_rss()
        start = time.perf_counter()
        spec.load_hf_weights(model, directory / "hf")
        seconds = time.perf_counter() - start
        peak = peak_rss()
        # The check, after the measurement: each weight read whole by this one process, cut as torch cuts it.
        _, _, sources = hf_native_sources(directory / "hf")
        mismatched = []
        for key, value in model.state_dict().items():
            whole = sources[key].read(full_index(sources[key].shape)).to(value.dtype)
            expected = distribute_tensor(whole, value.device_mesh, value.placements, src_data_rank=None).to_local() \
                if isinstance(value, DTensor) else whole
            local = value.to_local() if isinstance(value, DTensor) else value
            if not torch.equal(local, expected):
                mismatched.append(key)
    return {"rank": rank, "share_gb": share / GB, "baseline_gb": baseline / GB, "built_gb": built / GB,
            "init_peak_gb": init_peak / GB, "peak_gb": peak / GB, "load_s": seconds, "tensors": len(state),
            "mismatched": mismatched}


def convert(directory: Path, which: str) -> dict:
    """`convert --hf-dir --to-checkpoint` (float32) or `convert --to-hf` (bfloat16) in this process."""
    import torch

    import titan_tpu.convert  # noqa: F401  the imports count in the baseline, not in the conversion
    import titan_tpu.train.checkpoint_sources  # noqa: F401
    from titan_tpu.cli import main

    baseline = rss_now()
    start = time.perf_counter()
    if which == "import":
        # A run's checkpoint holds float32 master weights: the import's placeholders ask for float32.
        import titan_tpu.train.checkpoint_sources as sources_module

        real = sources_module.placeholder
        sources_module.placeholder = lambda source: real(source).to(torch.float32)
        assert main(["convert", "--hf-dir", str(directory / "hf"), "--to-checkpoint", str(directory / "ckpt"),
                     "--overwrite"]) == 0
    else:
        assert main(["convert", "--checkpoint", str(directory / "ckpt"), "--to-hf", str(directory / "export"),
                     "--overwrite"]) == 0
    return {"step": which, "baseline_gb": baseline / GB, "peak_gb": peak_rss() / GB,
            "seconds": time.perf_counter() - start}


def compare_export(directory: Path) -> list[str]:
    """Tensors of the export that differ from the directory they came from (one at a time)."""
    import torch
    from safetensors import safe_open

    def tensors(d: Path) -> dict[str, Path]:
        if not (d / "model.safetensors.index.json").is_file():  # one file
            with safe_open(str(d / "model.safetensors"), "pt") as f:
                return {k: d / "model.safetensors" for k in f.keys()}
        index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        return {k: d / f for k, f in index.items()}

    original, exported = tensors(directory / "hf"), tensors(directory / "export")
    assert original.keys() == exported.keys()
    differ = []
    for key in original:
        with safe_open(str(original[key]), "pt") as a, safe_open(str(exported[key]), "pt") as b:
            if not torch.equal(a.get_tensor(key), b.get_tensor(key)):
                differ.append(key)
    return differ


def _in_a_fresh_process(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="where the 16 + 32 + 16 GB of files go")
    parser.add_argument("--steps", default="make,load,convert", help="comma-separated: make, load, convert")
    parser.add_argument("--flavor", default="8B", help="the Llama 3 flavor (default 8B)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a child: one rank's load
    parser.add_argument("--convert", choices=["import", "export"], help=argparse.SUPPRESS)  # a child: one conversion
    args = parser.parse_args()
    global FLAVOR
    FLAVOR = args.flavor
    if args.rank is not None:
        print(json.dumps(load_rank(args.dir, args.rank)))
        return 0
    if args.convert is not None:
        print(json.dumps(convert(args.dir, args.convert)))
        return 0
    steps = args.steps.split(",")
    print(f"# {cpu_name()}, {Path('/proc/meminfo').read_text().split()[1]} kB of memory", flush=True)
    ok = True
    if "make" in steps:
        make(args.dir)
    if "load" in steps:
        for rank in range(WORLD):
            r = _in_a_fresh_process(["--dir", str(args.dir), "--flavor", FLAVOR, "--rank", str(rank)])
            over = r["peak_gb"] - r["share_gb"]
            good = over <= 2.0 and not r["mismatched"]
            ok &= good
            print(f"load rank {rank}/{WORLD}: share {r['share_gb']:.2f} GB, RSS {r['built_gb']:.2f} GB before the load "
                  f"(initialising peaked at {r['init_peak_gb']:.2f}), peak RSS while loading {r['peak_gb']:.2f} GB "
                  f"(share + {over:.2f} GB; goal <= share + 2), load {r['load_s']:.0f} s, "
                  f"{r['tensors'] - len(r['mismatched'])}/{r['tensors']} tensors bitwise equal to a whole-tensor "
                  f"load: {'ok' if good else 'FAIL'}", flush=True)
    if "convert" in steps:
        for which in ("import", "export"):
            r = _in_a_fresh_process(["--dir", str(args.dir), "--flavor", FLAVOR, "--convert", which])
            over = r["peak_gb"] - r["baseline_gb"]
            good = over <= 4.0
            ok &= good
            label = "--hf-dir --to-checkpoint (float32)" if which == "import" else "--to-hf (bfloat16)"
            print(f"convert {label}: peak RSS {r['peak_gb']:.2f} GB, baseline {r['baseline_gb']:.2f} GB "
                  f"(+{over:.2f} GB; goal <= +4), {r['seconds']:.0f} s: {'ok' if good else 'FAIL'}", flush=True)
        differ = compare_export(args.dir)
        ok &= not differ
        print(f"export: every tensor bitwise equal to the directory it came from: "
              f"{'ok' if not differ else 'FAIL ' + ', '.join(differ[:5])}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
