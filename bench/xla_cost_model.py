"""What XLA's TPU cost model counts: its time estimate (cost analysis's `optimal_seconds`) of small
programs built for the purpose, each beside the number that says what it counts, in one run.

The compile reports record XLA's estimate of each recipe's step beside the planner's step time
(docs/tpu_recipes.md). To read that comparison one needs to know what the estimate is; its docs do
not say, so this measures its behaviour, compiling for a v5p:2x2x1 slice with libtpu's compile-only
client (no TPU; the numbers are the compiler's own):

- a large bf16 matmul: the matmul rate the model assumes, as a fraction of the chip's peak (the
  planner assumes `Hardware.efficiency` of it);
- an elementwise op on a large array: the memory bandwidth it assumes, against the planner's;
- an all-gather alone, and a matmul beside an independent all-gather: whether collectives cost
  time, and whether they overlap compute (the sum of the two alone) or not (their larger);
- a scan of 8 matmuls: a while loop's body counted once;
- a scanned stack's forward and gradient, compiled as the step is (one layer a trip), two layers a
  trip, and fully unrolled: how far the estimate as run (xla/numbers.py `loop_seconds`, from the
  first two) is from the unrolled program's own, and what the stacked weights' gradient costs;
- megablox's grouped matmul on a buffer 8 times the rows its groups cover: what XLA charges an MoE
  layer's experts for a dispatch buffer sized for the worst case.

    PYTHONPATH=$PWD .venv-tpu/bin/python bench/xla_cost_model.py     # writes bench/results/xla_cost_model.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench/results/xla_cost_model.json"


def main() -> None:
    os.environ.update({"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1"})
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from titan_tpu.graph.jax_devices import tpu_topology
    from titan_tpu.plan.hardware import HARDWARE
    from titan_tpu.xla.dump import Loop
    from titan_tpu.xla.numbers import loop_seconds

    v5p = HARDWARE["v5p"]
    mesh = Mesh(np.array(tpu_topology("v5p:2x2x1").devices), ("x",))

    def estimate(fn, shapes, specs=None, out=None) -> tuple[float, dict]:
        specs = specs or [P()] * len(shapes)
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
                for s, spec in zip(shapes, specs)]
        cost = jax.jit(fn, out_shardings=out).lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return cost["optimal_seconds"], cost

    results = {"topology": "v5p:2x2x1", "peak_flops": v5p.peak_flops, "planner_efficiency": v5p.efficiency,
               "memory_bandwidth": v5p.memory_bandwidth}
    n = 8192
    matmul_s, cost = estimate(lambda a, b: a @ b, [(n, n), (n, n)])
    results["matmul_fraction_of_peak"] = cost["flops"] / matmul_s / v5p.peak_flops
    print(f"matmul {n}^3 bf16: {matmul_s * 1e3:.3f} ms, {cost['flops'] / matmul_s / 1e12:.0f} TFLOP/s = "
          f"{results['matmul_fraction_of_peak']:.3f} of v5p's peak (the planner assumes {v5p.efficiency})")

    m = 64 * 1024 * 1024  # 128 MiB of bf16
    elementwise_s, cost = estimate(lambda x: x * 2 + 1, [(m,)])
    results["elementwise_fraction_of_bandwidth"] = cost["bytes accessed"] / elementwise_s / v5p.memory_bandwidth
    rate = cost["bytes accessed"] / elementwise_s
    print(f"elementwise on 128 MiB: {elementwise_s * 1e6:.0f} us, {rate / 1e9:.0f} GB/s = "
          f"{results['elementwise_fraction_of_bandwidth']:.3f} of the planner's {v5p.memory_bandwidth / 1e9:.0f}")

    whole = NamedSharding(mesh, P())
    gather_s, _ = estimate(lambda x: jax.lax.with_sharding_constraint(x, whole), [(m,)], [P("x")], whole)
    both_s, _ = estimate(lambda a, b, x: (a @ b, jax.lax.with_sharding_constraint(x, whole)),
                         [(n, n), (n, n), (m,)], [P(), P(), P("x")], (whole, whole))
    results.update(all_gather_seconds=gather_s, matmul_beside_all_gather_over_sum=both_s / (matmul_s + gather_s),
                   matmul_beside_all_gather_over_larger=both_s / max(matmul_s, gather_s))
    print(f"all-gather of 128 MiB over 4 chips: {gather_s * 1e6:.0f} us; beside an independent matmul the program "
          f"costs {results['matmul_beside_all_gather_over_sum']:.3f}x their sum, "
          f"{results['matmul_beside_all_gather_over_larger']:.3f}x the larger (1.000x the sum: no overlap counted)")

    def scanned(unroll):
        def f(a, b):
            def body(c, _):
                return (c @ b).astype(jnp.bfloat16), None
            return jax.lax.scan(body, a, None, length=8, unroll=unroll)[0]
        return f

    scan_s, _ = estimate(scanned(1), [(n, n), (n, n)])
    results["scan_of_8_matmuls_over_one"] = scan_s / matmul_s
    print(f"a scan of 8 matmuls: {results['scan_of_8_matmuls_over_one']:.3f}x one matmul (a loop's body once)")

    layers, d = 16, 2048

    def forward(a, ws, unroll):
        def body(c, w):
            return jnp.tanh(c @ w).astype(jnp.bfloat16), None
        return jax.lax.scan(body, a, ws, unroll=unroll)[0]

    def gradient(unroll):
        return lambda a, ws: jax.grad(lambda a, ws: forward(a, ws, unroll).astype(jnp.float32).sum(), 1)(a, ws)

    shapes = [(d, d), (layers, d, d)]
    for name, build in (("forward", lambda u: (lambda a, ws: forward(a, ws, u))), ("gradient", gradient)):
        once, _ = estimate(build(1), shapes)
        twice, _ = estimate(build(2), shapes)
        unrolled, _ = estimate(build(True), shapes)
        loops = [Loop(trips=layers, body_matmul_flops=1.0, inner_trips=())]
        if name == "gradient":  # the forward's loop and the backward's
            loops = loops * 2
        as_run = loop_seconds(once, twice, loops)
        results[f"stack_{name}_as_run_over_unrolled"] = as_run / unrolled
        print(f"a {layers}-layer stack's {name}: one layer a trip {once * 1e6:.0f} us, two {twice * 1e6:.0f} us, "
              f"as run (from those) {as_run * 1e6:.0f} us, fully unrolled {unrolled * 1e6:.0f} us: "
              f"{results[f'stack_{name}_as_run_over_unrolled']:.3f}x")

    # MoE experts: megablox's grouped matmul (the gmm the MoE recipes run) hands XLA its own cost
    # estimate, 2 m k n over the buffer's static rows m; its grid visits only the tiles the group
    # sizes cover, which are values of the step. A dispatch buffer sized for the worst case (ep x
    # the routed rows under ep) is priced whole.
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm

    one_chip = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])  # a Mosaic kernel is not partitioned

    def gmm_seconds(rows: int) -> float:
        args = [jax.ShapeDtypeStruct((rows, 1024), jnp.bfloat16, sharding=one_chip),
                jax.ShapeDtypeStruct((8, 1024, 512), jnp.bfloat16, sharding=one_chip),
                jax.ShapeDtypeStruct((8,), jnp.int32, sharding=one_chip)]
        cost = jax.jit(lambda x, w, sizes: gmm(x, w, sizes, jnp.bfloat16, (512, 128, 128))).lower(*args).compile()
        cost = cost.cost_analysis()
        return (cost[0] if isinstance(cost, (list, tuple)) else cost)["optimal_seconds"]

    results["gmm_8x_buffer_rows_over_1x"] = gmm_seconds(8 * 4096) / gmm_seconds(4096)
    print(f"megablox gmm of 8 experts, a buffer of 8 x 4096 rows against 4096 (the same rows in groups): "
          f"{results['gmm_8x_buffer_rows_over_1x']:.2f}x (priced at the buffer's rows, not the groups')")
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
