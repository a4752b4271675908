"""What XLA's own dump of a compiled program says: what it holds at its memory peak (the answer to
"which term is it?") and where its compile spent its time.

XLA's TPU compiler writes, with ``XLA_FLAGS=--xla_dump_to=DIR``, per program: the buffer
assignment (each value's shape and size), the live ranges with the values alive at the peak
(``*after_optimizations-live-range.txt``, "Live ranges at N (peak)"), and the optimized HLO
whose instructions carry the JAX op name that made them (``metadata={op_name="..."}``: the
lowering's named scopes, graph/jax_lowering.py, put our module path there). `peak_values` joins
the three: every value alive at the peak, largest first, with its shape and where it came from.
That peak section leaves out what a while loop carries (a scanned model's layer-input stack);
`placed_values` reads the temporaries' allocation itself (each value's offset, size and live
range, the loop carries too) and `live_in_allocation` the values alive at one moment of it.

`matmul_flops` counts the multiply-adds of the optimized program's dots and convolutions (XLA's
TPU compiler turns most dots into convolutions), each instruction once, as XLA's cost analysis counts
a loop body once: the matmul work XLA will run, beside cost analysis's total, which also counts
every elementwise op (under expert parallelism mostly the worst-case dispatch buffers' elementwise
work, which our formula, matmuls only, leaves out).

`compile_stages` reads the dump's file times: XLA writes the program before its passes, after them
(with the buffer assignment), and after generating the TPU code, so the differences are the time of
its HLO passes and of its code generation.

No jax import: the dump is plain text, so `titan-tpu compile --dump` and the planner's tests read
it alike.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Loop", "PeakValue", "PlacedValue", "compile_stages", "computation_runs", "f8_dots", "format_peak",
           "live_in_allocation", "loop_trip_count", "matmul_flops", "optimized_hlo", "peak_values", "placed_values",
           "program_loops", "tpu_programs"]


@dataclass(frozen=True)
class PeakValue:
    bytes: int
    name: str  # the HLO value, e.g. "fusion.648{1}"
    shape: str  # e.g. "bf16[32,4,8192,4096]"
    origin: str  # the JAX op name that made it (its named scopes), or "" when unknown


def tpu_programs(dump: str | Path) -> set[str]:
    """The TPU programs XLA has dumped into `dump` so far, as file prefixes (not the CPU-side
    helpers JAX compiles for staging). Taken before and after a compile, the difference is its
    program."""
    return {str(f).removesuffix("-live-range.txt") for f in Path(dump).glob("*after_optimizations-live-range.txt")
            if ".cpu_" not in f.name}


def _program(dump: str | Path) -> str:
    """A program's file prefix: `dump` itself when it is one, else the largest program in it."""
    if Path(str(dump) + "-live-range.txt").exists():
        return str(dump)
    programs = tpu_programs(dump)
    if not programs:
        raise FileNotFoundError(f"{dump}: no XLA live-range dump; compile with XLA_FLAGS=--xla_dump_to={dump}")
    return max(programs, key=lambda p: Path(p + "-live-range.txt").stat().st_size)


def optimized_hlo(program: str | Path) -> str:
    """The optimized HLO of a dumped program (what XLA will run: its collectives, its fusions)."""
    return Path(_program(program) + ".txt").read_text()


_SHAPE = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=\d+,offset=\d+\): (.*)$")
_LAYOUT = re.compile(r"\{[^{}]*\}")  # tiling/layout annotations: f32[2,3]{1,0:T(8,128)} -> f32[2,3]


def _shapes(prefix: str) -> dict[str, str]:
    shapes = {}
    for line in Path(prefix + "-buffer-assignment.txt").read_text().splitlines():
        m = _SHAPE.match(line)
        if m:
            shape = m.group(2)
            while _LAYOUT.search(shape):
                shape = _LAYOUT.sub("", shape)
            shapes[m.group(1)] = shape
    return shapes


def _origins(prefix: str) -> dict[str, str]:
    """Instruction name -> op_name; an instruction without one (a copy XLA added) takes its first
    operand's."""
    origin, operand = {}, {}
    for line in Path(prefix + ".txt").read_text().splitlines():
        head = line.split(", metadata=")[0]
        while _LAYOUT.search(head):
            head = _LAYOUT.sub("", head)
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (?:\(.*?\)|\S+) [\w\-]+\((%[\w.\-]+)?", head)
        if not m:
            continue
        name = m.group(1)
        op = re.search(r'op_name="((?:[^"\\]|\\.)*)"', line)
        if op:
            origin[name] = op.group(1).replace('\\"', '"')
        elif m.group(2):
            operand[name] = m.group(2)[1:]
    for name, source in operand.items():
        seen = {name}
        while source not in origin and source in operand and source not in seen:
            seen.add(source)
            source = operand[source]
        origin.setdefault(name, origin.get(source, ""))
    return origin


def compile_stages(program: str | Path) -> dict[str, float]:
    """Seconds XLA spent on a dumped program: "hlo_passes" (its optimizations, to the buffer
    assignment) and "codegen" (the TPU code generated after them), from the dump files' times."""
    prefix = _program(program)
    times = {}
    for stage, suffix in (("start", ".before_optimizations.txt"),
                          ("assigned", ".after_optimizations-buffer-assignment.txt"),
                          ("end", ".after_codegen.txt")):
        path = Path(prefix.removesuffix(".after_optimizations") + suffix)
        if path.exists():
            times[stage] = path.stat().st_mtime
    if len(times) < 3:
        return {}
    return {"hlo_passes": times["assigned"] - times["start"], "codegen": times["end"] - times["assigned"]}


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (\w[\w\-]*)\(([^)]*)\)(.*)$")


def matmul_flops(program: str | Path, *, as_run: bool = False) -> float:
    """2 x the multiply-adds of every dot and convolution in a dumped program's optimized HLO (a
    prefix from `tpu_programs`, or a dump directory: its largest program): a dot's output elements
    times its contracted size; a convolution's only over the window taps that fall inside its
    input (XLA expresses batched and outer products as convolutions with padded windows, whose
    padding multiplies nothing). Nothing inside a custom call (a Pallas kernel). Each instruction
    once, as XLA's cost analysis counts a loop body once; as_run: each as many times as its
    computation runs (a while loop's body times its trip count, `computation_runs`)."""
    text = optimized_hlo(program)
    computations, _entry = _computations(text)
    runs = computation_runs(text) if as_run else {}
    shapes = _shapes_of(text)
    return sum(runs.get(name, 1) * _matmuls(lines, shapes) for name, lines in computations.items())


_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{\s*$")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def loop_trip_count(instruction: str, computations: dict[str, list[str]]) -> int | None:
    """How many times a while instruction of the optimized HLO runs its body: the trip count XLA
    knows (backend_config known_trip_count) or, as a lax.scan's loop reads, the constant its
    condition compares a counter from 0 against (`i < N`); None when it is neither."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%([\w.\-]+)", instruction).group(1)
    lines = computations.get(condition, [])
    constants = dict(re.findall(r"%([\w.\-]+) = s32\[\]\S* constant\((\d+)\)", "\n".join(lines)))
    for line in lines:
        m = re.search(r"ROOT %\S+ = pred\[\]\S* compare\(%[\w.\-]+, %([\w.\-]+)\), direction=LT", line)
        if m and m.group(1) in constants:
            return int(constants[m.group(1)])
    return None


@dataclass(frozen=True)
class Loop:
    trips: int  # how many times its body runs per run of the program
    body_matmul_flops: float  # its body's dots and convolutions, one trip (what the body calls counted in)
    inner_trips: tuple[int, ...]  # the trip counts of the loops its body runs (a kernel's loop over rows)


def program_loops(text: str) -> list[Loop]:
    """The while loops of an optimized HLO module that run once per program run (a scanned layer
    stack's forward and backward loops), with their trip counts (`loop_trip_count`; an unknown one
    counts 1)."""
    computations, _entry = _computations(text)
    runs, shapes = computation_runs(text), _shapes_of(text)
    loops = []
    for name, lines in computations.items():
        if runs.get(name) != 1:
            continue
        for line in lines:
            if " while(" not in line:
                continue
            body = re.search(r"body=%([\w.\-]+)", line).group(1)
            inside = _called_from(body, computations)
            inner = tuple(sorted(loop_trip_count(instruction, computations) or 1 for called in inside
                                 for instruction in computations[called] if " while(" in instruction))
            loops.append(Loop(trips=loop_trip_count(line, computations) or 1, inner_trips=inner,
                              body_matmul_flops=sum(_matmuls(computations[called], shapes)
                                                    for called in inside)))
    return loops


def _called_from(name: str, computations: dict[str, list[str]]) -> list[str]:
    """`name` and every computation it calls, directly or not, each once."""
    seen, todo = [], [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in computations:
            continue
        seen.append(current)
        for line in computations[current]:
            todo += [called for _kind, called in _CALLED.findall(line)]
            for branches in _BRANCHES.findall(line):
                todo += re.findall(r"%([\w.\-]+)", branches)
    return seen


def _shapes_of(text: str) -> dict[str, list[int]]:
    """Every instruction's output dims, by name (names are unique in a module)."""
    shapes = {}
    for line in text.splitlines():
        m = _INSTRUCTION.match(line.split(", metadata=")[0])
        if m:
            shapes[m.group(1)] = [int(d) for d in m.group(3).split(",") if d]
    return shapes


def _matmuls(lines: list[str], shapes: dict[str, list[int]]) -> float:
    """2 x the multiply-adds of the dots and convolutions among `lines` (`matmul_flops`)."""
    total = 0.0
    for line in lines:
        m = _INSTRUCTION.match(line.split(", metadata=")[0])
        if not m or m.group(4) not in ("dot", "convolution"):
            continue
        out = [int(d) for d in m.group(3).split(",") if d]
        lhs, rhs = re.findall(r"%([\w.\-]+)", m.group(5))
        if m.group(4) == "dot":
            contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", m.group(6)).group(1)
            total += 2.0 * math.prod(out) * math.prod(shapes[lhs][int(d)] for d in contracted.split(",") if d)
        else:
            total += 2.0 * _convolution_macs(out, shapes[lhs], shapes[rhs], m.group(6))
    return total


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    """(An optimized HLO module's computations: name -> its instruction lines, the entry's name)."""
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            computations[current] = []
            entry = current if line.startswith("ENTRY ") else entry
        elif current is not None and line.strip() != "}":
            computations[current].append(line)
    return computations, entry


def computation_runs(text: str) -> dict[str, int]:
    """How many times each computation of an optimized HLO module runs per run of the program: the
    entry once, a while loop's body its trip count times its caller's count (`loop_trip_count`; an
    unknown trip count counts once), anything else called (a fusion, a reduction's function, each
    branch of a conditional) as often as its caller."""
    computations, entry = _computations(text)
    runs: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        runs[name] = runs.get(name, 0) + times
        for line in computations.get(name, []):
            trips = (loop_trip_count(line, computations) or 1) if " while(" in line else 1
            for kind, called in _CALLED.findall(line):
                visit(called, times * (trips if kind == "body" else 1))
            for branches in _BRANCHES.findall(line):
                for called in re.findall(r"%([\w.\-]+)", branches):
                    visit(called, times)

    if entry is not None:
        visit(entry, 1)
    return runs


def _convolution_macs(out: list[int], lhs: list[int], rhs: list[int], attributes: str) -> int:
    """Multiply-adds of one HLO convolution: output batch x output features x input features per
    group x, per spatial dimension, the (output position, window tap) pairs whose input index is
    inside the input (not in its padding, and on a dilated input's real elements)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attributes).groups()
    lhs_l, rhs_l, out_l = labels
    spatial = sorted(c for c in lhs_l if c.isdigit())
    window = _window(re.search(r"window=\{([^}]*)\}", attributes), len(spatial))
    macs = out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")]
    for axis, d in enumerate(spatial):
        n, k, o = lhs[lhs_l.index(d)], rhs[rhs_l.index(d)], out[out_l.index(d)]
        stride, (low, _high), lhs_dilate, rhs_dilate = (window[key][axis] for key in ("stride", "pad", "lhs_dilate",
                                                                                         "rhs_dilate"))
        dilated = (n - 1) * lhs_dilate + 1
        pairs = 0
        for tap in range(k):
            first = tap * rhs_dilate - low  # the input index output position 0 reads at this tap
            if lhs_dilate == 1:  # positions p with 0 <= first + p * stride <= n - 1
                pairs += max(0, min(o - 1, (dilated - 1 - first) // stride) - max(0, -(first // stride)) + 1)
            else:  # and on one of a dilated input's real elements
                pairs += sum(1 for p in range(o) if 0 <= first + p * stride < dilated
                             and (first + p * stride) % lhs_dilate == 0)
        macs *= pairs
    return macs


def _window(match, rank: int) -> dict[str, list]:
    """An HLO convolution's window attributes per spatial dimension, with XLA's defaults."""
    fields = dict(item.split("=", 1) for item in match.group(1).split()) if match else {}

    def numbers(key: str, default: int) -> list[int]:
        return [int(x) for x in fields[key].split("x")] if key in fields else [default] * rank

    pads = [tuple(int(x) for x in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else \
        [(0, 0)] * rank
    return {"stride": numbers("stride", 1), "pad": pads, "lhs_dilate": numbers("lhs_dilate", 1),
            "rhs_dilate": numbers("rhs_dilate", 1)}


def peak_values(dump: str | Path) -> list[PeakValue]:
    """The values alive at XLA's memory peak of a dumped program (a prefix from `tpu_programs`, or a
    dump directory: its largest program), largest first."""
    prefix = _program(dump)
    text = Path(prefix + "-live-range.txt").read_text()
    start = text.find("(peak):")
    if start < 0:
        raise ValueError(f"{prefix}-live-range.txt has no peak section (libtpu changed its dump format)")
    shapes, origins = _shapes(prefix), _origins(prefix)
    values = []
    for line in text[start:].splitlines()[1:]:
        m = re.match(r"\s+(\S+): (\d+) bytes", line)
        if not m:
            break
        name = m.group(1)
        instruction = name.split("{")[0]
        shape = shapes.get(name) or shapes.get(name.removesuffix("{}"), "")
        values.append(PeakValue(bytes=int(m.group(2)), name=name, shape=shape,
                                origin=_short(origins.get(instruction, ""))))
    return sorted(values, key=lambda v: -v.bytes)


@dataclass(frozen=True)
class PlacedValue:
    name: str  # the HLO value, e.g. "fusion.256{1}"
    bytes: int
    offset: int  # where XLA placed it in its temporaries' allocation
    shape: str
    live: tuple[int, int] | None  # its live range in the program's instruction order; None where the
    # live-range file has none


_PLACED = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+),.*preallocated-temp")


def placed_values(dump: str | Path) -> list[PlacedValue]:
    """The values XLA placed in its temporaries (the largest preallocated-temp allocation of the
    buffer assignment: what the compile report calls temporaries), with their offsets and live
    ranges, highest end first. The peak section of the live-range file lists the values alive at one
    moment of the entry computation and leaves out what a while loop carries (the layer-input
    stack of a scanned model): the allocation holds those too, so its top shows what sets its size."""
    prefix = _program(dump)
    live = {}
    for line in Path(prefix + "-live-range.txt").read_text().splitlines():
        m = re.match(r"\s+(\S+):(\d+)-(\d+)$", line)
        if m:
            live[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    allocations: dict[int, list] = {}
    sizes, current = {}, None
    for line in Path(prefix + "-buffer-assignment.txt").read_text().splitlines():
        if line.startswith("allocation "):
            m = _ALLOCATION.match(line)
            current = int(m.group(1)) if m else None
            if m:
                sizes[current], allocations[current] = int(m.group(2)), []
            continue
        m = _PLACED.match(line)
        if m and current is not None:
            name, shape = m.group(1), m.group(4)
            while _LAYOUT.search(shape):
                shape = _LAYOUT.sub("", shape)
            key = name if "{" in name else name + "{}"
            allocations[current].append(PlacedValue(name=name, bytes=int(m.group(2)), offset=int(m.group(3)),
                                                    shape=shape, live=live.get(key) or live.get(name)))
    if not sizes:
        return []
    largest = max(sizes, key=sizes.get)
    return sorted(allocations[largest], key=lambda v: -(v.offset + v.bytes))


def live_in_allocation(values: list[PlacedValue], at: int | None = None) -> tuple[int, list[PlacedValue]]:
    """(moment, the placed values alive then, largest first): at `at`, or at the moment with the most
    bytes alive among those with a live range."""
    ranged = [v for v in values if v.live is not None]
    if at is None:
        moments = sorted({t for v in ranged for t in v.live})
        at = max(moments, key=lambda t: sum(v.bytes for v in ranged if v.live[0] <= t <= v.live[1]), default=0)
    alive = [v for v in ranged if v.live[0] <= at <= v.live[1]]
    return at, sorted(alive, key=lambda v: -v.bytes)


def _short(op_name: str) -> str:
    """An op name without the jit/shard_map wrappers and a kernel's JSON arguments."""
    op_name = re.sub(r"\{\"op\".*\}", "", op_name)
    return op_name.replace("jit(local)/shard_map/", "")


def format_peak(values: list[PeakValue], *, top: int = 15) -> str:
    total = sum(v.bytes for v in values)
    lines = [f"XLA's live values at its peak: {total / 2**30:.3f} GiB in {len(values)} values; the largest:"]
    for v in values[:top]:
        lines.append(f"  {v.bytes / 2**30:8.3f} GiB  {v.shape:32s} {v.origin or v.name}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(format_peak(peak_values(sys.argv[1]), top=int(sys.argv[2]) if len(sys.argv) > 2 else 30))


_HLO_VALUE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (\w+)\[", re.M)
_HLO_MATMUL = re.compile(r"= \w+\[[^\]]*\][^=]*? (?:dot|convolution|ragged-dot)\(([^)]*)\)")
_HLO_OPERAND = re.compile(r"(?:(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+)?%([\w.\-]+)")
_STABLEHLO_MATMUL = re.compile(r"(?:stablehlo\.(?:dot_general|convolution)|chlo\.ragged_dot)\b[^\n]*?:\s*"
                               r"\(tensor<(?:[\d?]+x)*(\w+)>, tensor<(?:[\d?]+x)*(\w+)>[,)]")


def f8_dots(text: str) -> int:
    """How many matmuls of a program take float8 operands (both of them): `dot` or `convolution` (XLA's
    TPU passes turn a dot into a convolution) in HLO text, whose operands are named values looked up by
    the type their definition gave them (or typed inline); or `stablehlo.dot_general` in StableHLO.
    Grouped matmuls count too (`ragged-dot` in HLO, `chlo.ragged_dot` in StableHLO: fp8 MoE experts).
    A matmul inside a loop body counts once, as XLA's cost analysis counts it."""
    if "stablehlo." in text and "HloModule" not in text:
        return sum(a.startswith("f8") and b.startswith("f8") for a, b in _STABLEHLO_MATMUL.findall(text))
    types = {name: dtype for name, dtype in _HLO_VALUE.findall(text)}
    count = 0
    for operands in _HLO_MATMUL.findall(text):
        # each operand "%name", or typed inline "f8e4m3fn[16,32]{1,0} %name"
        dtypes = [typed or types.get(name, "") for typed, name in _HLO_OPERAND.findall(operands)][:2]
        count += len(dtypes) == 2 and all(d.startswith("f8") for d in dtypes)
    return count
