"""The JAX path's step on this CPU against graph mode with Inductor and against eager, in one process.

Three steps of the llama3 debug model built by the trainer's own assembly (`Components`) from one
config, differing only in how the step runs: eager (autograd), graph mode compiled by Inductor, and
`--compile.backend jax` (our lowering's one program, run by XLA:CPU through JAX, one device). They
take the same batch, interleaved round by round (each round one step of each, the order rotating),
and the script prints each one's tokens per second from its median step time, the ratios of the
JAX path to the other two, and where the JAX path's step time goes: the compiled program alone
(run on the step's own state, waited for) against the whole step (the batch and scalars made into
device arrays, the token count, the loss and norm read back).

    PYTHONPATH=$PWD TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv-tpu/bin/python bench/jax_speed.py
    ... bench/jax_speed.py --dtype bfloat16 --batch 8 --seq 256 --rounds 10

Runs in .venv-tpu (jax). No target: the numbers and where the time goes, for one CPU (named in the
output, with whether it has bf16 instructions).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# XLA's threads and torch's share the cores: idle OpenMP threads must sleep, not spin (read when torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from graph_accum import cpu_name  # noqa: E402 - the same CPU line as the other benches

MODES = {"eager": ["--training.mode", "eager"],
         "inductor": ["--training.mode", "graph", "--compile.backend", "inductor"],
         "jax": ["--training.mode", "graph", "--compile.backend", "jax"]}


def components(mode: str, args, tmp: Path):
    from titan_tpu.components.build import Components
    from titan_tpu.config import build_config
    from titan_tpu.kinds import kind_of
    from titan_tpu.run.setup import prepare_run

    overrides = ["--output_dir", str(tmp / mode), "--training.device", "cpu", "--model.dtype", args.dtype,
                 "--training.batch_size", str(args.batch), "--training.seq_len", str(args.seq),
                 "--data.cache_dir", str(tmp / "cache"), "--data.max_bytes", "2000000", "--checkpoint.enabled",
                 "false", *MODES[mode]]
    cfg = build_config(str(REPO / "configs/llama3_debug.toml"), overrides)
    with contextlib.redirect_stdout(io.StringIO()):
        return Components(prepare_run(cfg), kind_of(cfg))


class ProgramAlone:
    """The JAX step's compiled program alone, fed the step's own state and a fixed batch, waited
    for: one call per round, interleaved with the whole steps."""

    def __init__(self, step, batch):
        import numpy as np

        from titan_tpu.data.batch import as_batch, flatten

        self.step, self.program = step, step.programs["step"]
        tensors = flatten(as_batch(batch))[0]
        self.fixed = dict(batch=[step._global(t) for t in tensors],
                          num_tokens=[step._global(np.asarray(1, np.int32))],
                          step=[step._global(np.asarray(1.0, np.float32))],
                          lr=[step._global(np.asarray(1e-4, np.float32))])

    def __call__(self) -> float:
        import jax

        layout, state = self.program.step.captured.layout, self.step._device
        flat = layout.flatten_inputs(params=state["params"], exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"],
                                     buffers=state["buffers"], **self.fixed)
        start = time.perf_counter()
        out = jax.block_until_ready(self.program(flat))
        seconds = time.perf_counter() - start
        groups = layout.unflatten_outputs(out)  # the donated state replaced by its new values
        self.step._device = {**state, "params": groups["params"], "exp_avg": groups["exp_avg"],
                             "exp_avg_sq": groups["exp_avg_sq"]}
        return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from titan_tpu.jax_start import start_jax

    start_jax("cpu", rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="jax_speed_") as tmp:
        built = {mode: components(mode, args, Path(tmp)) for mode in MODES}
        batch = built["eager"].train_loader.next_batch()
        times = {mode: [] for mode in MODES}
        for mode, c in built.items():
            c.step_fn([batch], 1e-4)  # the first step: state made, anything lazy done
        jax_step = built["jax"].step_fn
        alone, program_times = ProgramAlone(jax_step, batch), []
        for r in range(args.rounds):
            order = list(MODES)[r % 3:] + list(MODES)[:r % 3]
            for mode in order:
                start = time.perf_counter()
                built[mode].step_fn([batch], 1e-4)
                times[mode].append(time.perf_counter() - start)
            program_times.append(alone())
        program = statistics.median(program_times)
    tokens = args.batch * args.seq
    median = {mode: statistics.median(t) for mode, t in times.items()}
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "dtype": args.dtype, "batch": args.batch,
              "seq": args.seq, "rounds": args.rounds,
              "tokens_per_s": {mode: tokens / s for mode, s in median.items()},
              "jax_vs_inductor": median["inductor"] / median["jax"], "jax_vs_eager": median["eager"] / median["jax"],
              "jax_step_s": median["jax"], "jax_program_s": program,
              "jax_compile_s": jax_step.compile_seconds,
              "inductor_compile_s": built["inductor"].compile_stats["compile_s"]}
    print(f"{result['cpu']}, {result['threads']} threads, llama3 debug {args.dtype}, {args.batch} x {args.seq} tokens "
          f"per step, median of {args.rounds} interleaved rounds:")
    for mode, rate in result["tokens_per_s"].items():
        print(f"  {mode:9s} {rate:9,.0f} tokens/s  ({median[mode] * 1e3:.0f} ms per step)")
    print(f"  JAX path / Inductor {result['jax_vs_inductor']:.2f}x, JAX path / eager {result['jax_vs_eager']:.2f}x")
    print(f"  the JAX step's {median['jax'] * 1e3:.0f} ms: the compiled program alone {program * 1e3:.0f} ms, so "
          f"{(median['jax'] - program) * 1e3:+.0f} ms for the rest (inputs made device arrays, the token count, "
          "results read back; within the rounds' spread when near 0)")
    print(f"  compile: JAX (lowering + XLA) {result['jax_compile_s']:.1f} s, "
          f"Inductor {result['inductor_compile_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
