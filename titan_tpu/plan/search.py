"""`titan-tpu plan --search`: the planner run over the knobs a user would try, at a fixed global
batch, on one hardware; the configurations that fit, ranked by predicted tokens/s, and why the
others were rejected.

The space (each knob at the values below; `keep` holds a knob at the config's value):

    activation_checkpoint.mode        none, selective, full
    model.scan_layers                 false, true
    parallelism.reshard_after_forward true, false        (sharded layouts only; auto plans as one of them)
    parallelism.bucket_mb             0, 25, 256 and the config's (sharded or replicated layouts only)
    training.batch_size x grad_accum  every split of the sequences per data-parallel rank (the global
                                      batch, batch_size x grad_accum_steps x data-parallel ranks, is
                                      the config's, whatever tp a candidate has)
    parallelism.dp_replicate x dp_shard  every factorisation of the devices / (tp x cp) (cp is held)
    parallelism.tp                    on GPUs, every divisor of a node's GPUs (tp stays inside the
                                      NVLink node: parallel/fabric_terms.py), with unrolled blocks;
                                      elsewhere held at the config's value
    parallelism.ep                    divisors of the experts (MoE models)
    parallelism.pp                    1 and every power of two that divides the data-parallel devices and
                                      leaves each stage a layer of the stack it splits (native models
                                      without multi-token prediction, cp 1, not LoRA: what the trainer
                                      runs; MoE models with each ep, ep inside a stage), each
                                      with pp_microbatches pp and batch_size,
                                      and pp_repeats 1 (GPipe) and the smallest other divisor of the
                                      stage's layers (circular); scanned layers only, buckets and
                                      re-sharding held (a stage keeps its weights gathered)
    lora.enabled                      true, only where no full fine-tuning candidate fits (below)

Every candidate is a real Config (the config's own validation runs on it) planned by
`plan_config`; nothing here estimates anything the planner does not. A candidate is rejected for
divisibility (a micro-batch that does not divide the sequences per device, ep that does not
divide dp_shard), for what the code cannot run (any validation error) or for memory (the
planner's peak over the device's). Pipeline stages take data-parallel ranks: a pp candidate's
data-parallel ranks are devices / (tp x cp x pp), each with pp times the sequences, so the global
batch stays the config's; a stage gathers 1 / pp of the weights, once per step (not once per
micro-batch), at the cost of the bubble and the permutes (plan/pipeline_terms.py). The planner
cannot tell apart what it does not model (host overhead per micro-batch, compile time, scan's
steady-state cost): candidates within TIE of the best rate are ordered by fewer micro-batches,
then fewer changes to the config, then lower peak memory.

fp8 (the blocks' linears as fp8 matmuls, `[fp8]`) changes the numbers a run computes, so the search
never turns it on by itself: with `allow_fp8` (`plan --search --allow-fp8`) every candidate is also
planned with fp8.enabled true, on hardware with an fp8 peak (tpu7x, H100/H200, B200); elsewhere the
search says in one line that fp8 gains nothing there and plans without it. A config with fp8 on is
searched with it on.

LoRA changes what a run trains (the base frozen, a low-rank update learned), so the search never
trades full fine-tuning for it on speed: a config with lora.enabled is searched as LoRA, and one
without it is searched as full fine-tuning. Only when no full fine-tuning candidate fits does the
search plan the same space again with lora.enabled true (the config's [lora] rank and targets) and
rank those, saying so; `--keep lora.enabled` turns that fallback off.

A Transformers-backend model (model.name hf) is searched over what it runs: its own layer loop on
data-parallel axes, one piece to SimpleFSDP; tp, pp, scan_layers and re-sharding are held at the
config's values (`HF_HELD`). Its terms are measured once (plan/hf_terms.py) and shared by every candidate.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
from dataclasses import dataclass, field

from titan_tpu.config import Config
from titan_tpu.models.spec import model_spec
from titan_tpu.parallel.mesh import ParallelDims
from titan_tpu.parallel.pipeline import pipelined_layers
from titan_tpu.plan.fp8 import fp8_note, fp8_setting
from titan_tpu.plan.hardware import Hardware
from titan_tpu.plan.planner import plan_config
from titan_tpu.plan.result import Plan
from titan_tpu.plan.setting import TPU_NAMES, default_hardware, planning_machine
from titan_tpu.run.setup import prepare_run

__all__ = ["KNOBS", "Candidate", "SearchResult", "search", "format_search"]

# The searched config keys (what `keep` accepts).
KNOBS = ("activation_checkpoint.mode", "model.scan_layers", "parallelism.reshard_after_forward",
         "parallelism.bucket_mb", "training.batch_size", "parallelism.dp_replicate", "parallelism.tp", "parallelism.ep",
         "parallelism.pp", "lora.enabled")
# Every key a candidate sets, in the order its overrides are printed: dp_shard goes with
# dp_replicate, grad_accum_steps with batch_size.
_SET = ("activation_checkpoint.mode", "model.scan_layers", "training.batch_size", "training.grad_accum_steps",
        "parallelism.dp_replicate", "parallelism.dp_shard", "parallelism.tp", "parallelism.ep",
        "parallelism.pp", "parallelism.pp_microbatches", "parallelism.pp_repeats", "parallelism.reshard_after_forward",
        "parallelism.bucket_mb", "lora.enabled", "fp8.enabled")
# What an hf model cannot change (models/hf/spec.py refuses tp, cp and scanned layers, run/setup.py pp;
# one piece has nothing to re-shard after a layer): held, as --keep holds a knob.
HF_HELD = ("parallelism.tp", "parallelism.pp", "model.scan_layers", "parallelism.reshard_after_forward")
BUCKETS_MB = (0.0, 25.0, 256.0)
TIE = 0.005  # predicted rates this close (relative) are a tie: the planner cannot tell them apart


@dataclass
class Candidate:
    values: dict  # config key -> value, for every key in _SET (fp8.enabled where fp8 is searched)
    changes: list  # ["--key", "value", ...]: what differs from the config
    plan: Plan | None = None
    reason: str = ""  # why rejected ("" when it fits)
    detail: str = ""
    same_buckets: list = field(default_factory=list)  # other bucket_mb values that plan exactly the same

    def describe(self) -> str:
        v = self.values
        text = (f"{'fp8, ' if v.get('fp8.enabled') else ''}{'LoRA, ' if v['lora.enabled'] else ''}"
                f"AC {v['activation_checkpoint.mode']}, "
                f"{'scanned' if v['model.scan_layers'] else 'unrolled'}, "
                f"micro-batch {v['training.batch_size']} x accum {v['training.grad_accum_steps']}")
        r, s, tp = v["parallelism.dp_replicate"], v["parallelism.dp_shard"], v.get("parallelism.tp", 1)
        if tp > 1:
            text += f", tp {tp}"
        pp = v.get("parallelism.pp", 1)
        if pp > 1:
            repeats = v["parallelism.pp_repeats"]
            text += (f", pp {pp} ({v['parallelism.pp_microbatches'] or pp} micro-batches"
                     f"{f' x {repeats} repeats' if repeats > 1 else ''})")
        if r * s > 1 and pp > 1:
            return text + f", dp_replicate {r} x dp_shard {s}"  # a stage's weights are kept gathered: no buckets
        if r * s > 1:  # the layout's knobs act only on several devices
            ep = f", ep {v['parallelism.ep']}" if v["parallelism.ep"] > 1 else ""
            text += f", dp_replicate {r} x dp_shard {s}{ep}"
            if v["parallelism.bucket_mb"] <= 0:  # one collective per parameter: nothing to re-shard
                return text + ", no buckets"
            same = "".join(f" (= {_fmt(b)} MB)" for b in self.same_buckets)
            text += f", bucket {_fmt(v['parallelism.bucket_mb'])} MB{same}"
            if s > 1:
                text += {"true": ", re-shard", "false": ", keep gathered"}.get(v["parallelism.reshard_after_forward"],
                                                                                ", re-shard auto")
        return text


@dataclass
class SearchResult:
    hardware: Hardware
    devices: int
    sequences_per_device: int  # the config's, per data-parallel rank
    seq_len: int
    tp: int = 1  # the config's value: held, unless the search varies it (tps)
    tps: tuple = ()  # the tp values searched where more than the config's (GPUs: divisors of a node's GPUs)
    sequences: int = 0  # the global batch in sequences, every candidate's
    lora_fallback: bool = False  # no full fine-tuning candidate fit: `fitting` are LoRA's (module docstring)
    lora_rank: int = 0  # the config's lora.rank, which the fallback plans with
    fitting: list = field(default_factory=list)  # Candidates, best first
    rejected: dict = field(default_factory=dict)  # reason -> [Candidate]
    fp8_note: str = ""  # why fp8 was not searched although allowed ("" where it was, or was not asked for)

    @property
    def total(self) -> int:
        return len(self.fitting) + sum(len(c) for c in self.rejected.values())


def _fmt(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _get(cfg: Config, key: str):
    if key == "fp8.enabled":
        return fp8_setting(cfg)[0]
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_values(cfg: Config, devices: int, keep: set[str], hardware: Hardware) -> list[int]:
    """tp values to search: on a GPU node every divisor of its GPUs whose data-parallel ranks split
    the config's global batch evenly (tp inside the NVLink node, the fastest-varying axis:
    parallel/fabric_terms.py); elsewhere, or held, the config's."""
    p = cfg.parallelism
    if "parallelism.tp" in keep or not hardware.devices_per_node:
        return [p.tp]
    sequences = _global_sequences(cfg, devices)
    return [tp for tp in _divisors(hardware.devices_per_node)
            if devices % (tp * p.cp) == 0 and sequences % (devices // (tp * p.cp)) == 0]


def _space(cfg: Config, devices: int, keep: set[str], fp8: tuple[bool, ...] = (False,),
           tps: tuple[int, ...] | None = None, hardware: Hardware | None = None) -> list[dict]:
    """Every combination of knob values (a dict per candidate, each key of _SET). tps: the tp
    values (default: the config's); the global batch in sequences stays the config's, each tp's
    data-parallel ranks splitting it."""
    args = model_spec(cfg.model).args
    p = cfg.parallelism
    sequences = _global_sequences(cfg, devices)
    out = []
    for tp in tps or (p.tp,):
        for pp in _pp_values(cfg, args, keep, devices=devices // (tp * p.cp)):
            dp_devices = devices // (tp * p.cp * pp)  # context parallelism is held at the config's value
            if sequences % dp_devices:
                continue  # this layout's data-parallel ranks cannot split the global batch evenly
            per_rank = sequences // dp_devices
            out += _layout_space(cfg, args, keep, tp=tp, pp=pp, dp_devices=dp_devices, per_rank=per_rank)
    # fp8.enabled is a key of the candidates only where the search plans fp8 (search's allow_fp8)
    return out if fp8 == (False,) else [{**values, "fp8.enabled": on} for values in out for on in fp8]


def _global_sequences(cfg: Config, devices: int) -> int:
    """The config's sequences per step: batch_size x grad_accum_steps per data-parallel rank."""
    p = cfg.parallelism
    return cfg.training.batch_size * cfg.training.grad_accum_steps * (devices // (p.tp * p.cp * p.pp))


def _pp_values(cfg: Config, args, keep: set[str], *, devices: int) -> list[int]:
    """Pipeline stages to search on `devices` (those tp and cp leave): 1 and the powers of two that
    divide the devices and leave every stage a layer of the stack they split (`pipelined_layers`,
    padded to equal stages: parallel/pipeline.py), where the trainer runs stages (a native model
    without multi-token prediction, cp 1, not LoRA; on a TPU as the one lowered program); the
    config's own pp always."""
    p = cfg.parallelism
    if "parallelism.pp" in keep:
        return [p.pp]
    runs = not args.mtp_num_layers and p.cp == 1 and not cfg.lora.enabled
    powers = [2**i for i in range(1, devices.bit_length())
              if _keeps_layers(pipelined_layers(args), 2**i) and devices % 2**i == 0]
    return sorted({1, p.pp if devices % p.pp == 0 else 1, *(powers if runs else [])})


def _keeps_layers(n_layers: int, pp: int) -> bool:
    """Whether `pp` GPipe stages of `n_layers` padded to equal stages leave the last stage a layer."""
    rows = -(-n_layers // pp) * pp
    return rows - n_layers < rows // pp


def _pipeline_schedules(args, *, pp: int, batch_size: int) -> list[tuple[int, int]]:
    """(pp_microbatches, pp_repeats) to search for `pp` stages and micro-batches of `batch_size`
    rows: as many micro-batches as stages and one per row (the smallest bubble), GPipe and the
    smallest circular schedule; (0, 1) without stages."""
    if pp == 1:
        return [(0, 1)]
    micro = sorted({m for m in (pp, batch_size) if m >= pp and batch_size % m == 0})
    stage_layers = -(-pipelined_layers(args) // pp)  # a stage's rows, padding included
    repeats = [1] + [r for r in _divisors(stage_layers) if r > 1][:1]
    return [(m, r) for m in micro for r in repeats]


def _layout_space(cfg: Config, args, keep: set[str], *, tp: int, pp: int = 1, dp_devices: int,
                  per_rank: int) -> list[dict]:
    t, p = cfg.training, cfg.parallelism
    micro = sorted(set(_divisors(per_rank)) | {2**i for i in range(per_rank.bit_length()) if 2**i <= per_rank})
    if "training.batch_size" in keep:
        micro = [t.batch_size]
    layouts = [(r, dp_devices // r) for r in _divisors(dp_devices)]
    if "parallelism.dp_replicate" in keep:
        r = p.dp_replicate if dp_devices % p.dp_replicate == 0 else 1
        layouts = [(r, dp_devices // r)]
    eps = _divisors(args.moe.num_experts) if args.moe is not None and "parallelism.ep" not in keep else [p.ep]
    acs = [cfg.activation_checkpoint.mode] if "activation_checkpoint.mode" in keep else ["none", "selective", "full"]
    scans = [cfg.model.scan_layers] if "model.scan_layers" in keep else [False, True]
    if tp > 1:
        # Tensor parallelism runs scanned blocks too, but under dp_shard their stack is gathered
        # whole before the loop (docs/tensor_parallel.md, Limitations): the search keeps tp unrolled.
        scans = [False]
    if pp > 1:
        scans = [True]  # the stages split the scanned stack
    out = []
    for (r, s), ep, ac, scan, b in itertools.product(layouts, eps, acs, scans, micro):
        # Knobs that act only on some layouts are held at the config's value elsewhere: buckets on
        # several devices, re-sharding on a sharded axis with buckets (neither under pipeline
        # stages, whose weights are read once per step and kept).
        buckets = sorted(set(BUCKETS_MB) | {p.bucket_mb}) if r * s > 1 and pp == 1 and \
            "parallelism.bucket_mb" not in keep else [p.bucket_mb]
        reshards = ["true", "false"] if s > 1 and pp == 1 and "parallelism.reshard_after_forward" not in keep else \
            [p.reshard_after_forward]
        # Without buckets re-sharding does nothing: one candidate, at the config's value (or false
        # when the config says auto).
        unbucketed = p.reshard_after_forward if p.reshard_after_forward in reshards else "false"
        schedules = _pipeline_schedules(args, pp=pp, batch_size=b)
        for bucket, reshard, (micro_batches, repeats) in itertools.product(buckets, reshards, schedules):
            if bucket <= 0 and reshard != unbucketed and len(reshards) > 1:
                continue
            out.append({"activation_checkpoint.mode": ac, "model.scan_layers": scan,
                        "parallelism.reshard_after_forward": reshard, "parallelism.bucket_mb": bucket,
                        "training.batch_size": b, "training.grad_accum_steps": max(per_rank // b, 1),
                        "parallelism.dp_replicate": r, "parallelism.dp_shard": s, "parallelism.tp": tp,
                        "parallelism.pp": pp, "parallelism.pp_microbatches": micro_batches,
                        "parallelism.pp_repeats": repeats, "parallelism.ep": ep, "lora.enabled": cfg.lora.enabled})
    return out


def _candidate(base: Config, values: dict, *, sequences: int, devices: int, hardware: Hardware,
               chips: int | None) -> Candidate:
    changes = []
    for key in (key for key in _SET if key in values):
        # dp_shard -1 resolves to the devices dp_replicate leaves, whatever dp_replicate is.
        if key == "parallelism.dp_shard" and base.parallelism.dp_shard == -1:
            continue
        if values[key] != _get(base, key):
            changes += [f"--{key}", _fmt(values[key])]
    c = Candidate(values=values, changes=changes)
    b, ep, shard = values["training.batch_size"], values["parallelism.ep"], values["parallelism.dp_shard"]
    per_rank = sequences * values["parallelism.tp"] * base.parallelism.cp * values["parallelism.pp"] // devices
    if per_rank % b:
        c.reason, c.detail = "divisibility: micro-batch", f"micro-batch {b} does not divide {per_rank} sequences"
        return c
    if shard % ep:
        c.reason, c.detail = "divisibility: ep", f"ep {ep} does not divide dp_shard {shard}"
        return c
    # The sections a candidate sets are copied; the rest is shared with the config, read only.
    # fp8 is planned as a what-if (plan_config's fp8): the config's own [fp8] is left as it is.
    cfg = copy.copy(base)
    for section in {key.split(".")[0] for key in values if key != "fp8.enabled"}:
        setattr(cfg, section, copy.copy(getattr(base, section)))
    for key, value in values.items():
        if key == "fp8.enabled" or (key == "parallelism.dp_shard" and base.parallelism.dp_shard == -1):
            continue
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    try:
        with planning_machine():
            prepare_run(cfg)
        if values["parallelism.pp"] > 1:  # what the trainer's mesh runs with stages (cp refused)
            ParallelDims.from_config(cfg.parallelism, world_size=devices)
        # the planner's own refusals (the tp and cp layouts the code runs) reject a candidate the same way
        c.plan = plan_config(cfg, hardware, chips=chips, fp8=values.get("fp8.enabled"))
    except ValueError as e:
        message = str(e)
        c.reason = f"config: {message.split(';')[0]}"
        c.detail = message
        return c
    if not c.plan.fits:
        c.reason = "memory"
        c.detail = (f"peak {c.plan.peak_bytes / 1e9:.1f} GB at {c.plan.peak_phase} > {c.plan.capacity_bytes / 1e9:.1f} "
                    f"GB (+{c.plan.peak_bytes / c.plan.capacity_bytes - 1:.0%})")
    return c


def search(cfg: Config, hardware: Hardware | None = None, *, chips: int | None = None, keep=(),
           measure: bool = True, allow_fp8: bool = False) -> SearchResult:
    """Plan every candidate of the space around `cfg` (module docstring) on `hardware` (default:
    what the config names) and rank those that fit. Raises ValueError (one line) when none fits.
    allow_fp8: plan every candidate with fp8 on too, where the hardware has an fp8 peak (module docstring)."""
    unknown = sorted(set(keep) - set(KNOBS))
    if unknown:
        raise ValueError(f"--keep {unknown[0]} is not a searched knob; keep one of {', '.join(KNOBS)}")
    if not model_spec(cfg.model).plannable:  # an hf model: its measured terms, its own layer loop
        keep = (*keep, *HF_HELD)
    if hardware is None:
        hardware, named = default_hardware(cfg, measure=measure)
        chips = chips if chips is not None else named
    if hardware.name in TPU_NAMES and cfg.training.mode != "graph":
        raise ValueError("plan --search ranks by predicted speed, and eager mode on a TPU has no basis for one; "
                         "search with --training.mode graph (the TPU path)")
    p = cfg.parallelism
    devices = chips * hardware.devices_per_chip if chips is not None else \
        ParallelDims.from_config(p, world_size=None, runnable=False).world_size  # a CPU run: the ranks the mesh names
    if devices % (p.tp * p.cp):
        raise ValueError(f"--parallelism.tp x cp ({p.tp * p.cp}) must divide the {devices} devices searched; "
                         "choose divisors")
    per_device = cfg.training.batch_size * cfg.training.grad_accum_steps
    tps = _tp_values(cfg, devices, set(keep), hardware)
    result = SearchResult(hardware=hardware, devices=devices, sequences_per_device=per_device,
                          seq_len=cfg.training.seq_len, tp=p.tp, tps=tuple(tps) if tps != [p.tp] else (),
                          sequences=_global_sequences(cfg, devices))
    sequences = result.sequences
    fp8 = (fp8_setting(cfg)[0],)
    if allow_fp8 and not fp8[0]:
        result.fp8_note = fp8_note(hardware) or ""
        fp8 = (False,) if result.fp8_note else (False, True)
    for values in _space(cfg, devices, set(keep), fp8, tuple(tps), hardware):
        c = _candidate(cfg, values, sequences=sequences, devices=devices, hardware=hardware, chips=chips)
        if c.reason:
            result.rejected.setdefault(c.reason, []).append(c)
        else:
            result.fitting.append(c)
    if not result.fitting and not cfg.lora.enabled and "lora.enabled" not in keep:
        # Full fine-tuning fits nowhere: the same space with LoRA (module docstring).
        for values in _space(cfg, devices, set(keep), fp8, tuple(tps), hardware):
            c = _candidate(cfg, {**values, "lora.enabled": True}, sequences=sequences, devices=devices,
                           hardware=hardware, chips=chips)
            if not c.reason:
                result.fitting.append(c)
        result.lora_fallback, result.lora_rank = bool(result.fitting), cfg.lora.rank
    if not result.fitting:
        raise ValueError(_nothing_fits(result))
    best = max(c.plan.tokens_per_s for c in result.fitting)

    def rank(c: Candidate):
        # Rates within TIE of each other share a step of the log scale.
        step = math.floor(math.log(best / c.plan.tokens_per_s) / math.log1p(TIE))
        return step, c.values["training.grad_accum_steps"], len(c.changes), c.plan.peak_bytes

    result.fitting.sort(key=rank)
    result.fitting = _merge_same_buckets(result.fitting)
    return result


def _merge_same_buckets(ranked: list[Candidate]) -> list[Candidate]:
    """Candidates that differ only in bucket_mb and plan exactly the same (the same memory, step time
    and collectives: both sizes make the same buckets) are one configuration: the first in rank
    order stays, naming the other sizes."""
    kept, by_behaviour = [], {}
    for c in ranked:
        others = tuple((k, v) for k, v in c.values.items() if k != "parallelism.bucket_mb")
        collectives = tuple((x["kind"], x["axis"], x["calls"], round(x["bytes_per_step"]))
                            for x in c.plan.communication)
        key = (others, round(c.plan.peak_bytes), round(c.plan.time["step_s"], 9), collectives)
        if key in by_behaviour and c.values["parallelism.bucket_mb"] > 0:
            by_behaviour[key].same_buckets.append(c.values["parallelism.bucket_mb"])
            continue
        by_behaviour.setdefault(key, c)
        kept.append(c)
    return kept


def _nothing_fits(result: SearchResult) -> str:
    where = f"{result.devices} x {result.hardware.name} ({result.hardware.memory_bytes / 1e9:.1f} GB per device)"
    memory = result.rejected.get("memory", [])
    other = {k: len(v) for k, v in result.rejected.items() if k != "memory"}
    others = "; ".join(f"{n} {k}" for k, n in other.items())
    if memory:
        least = min(memory, key=lambda c: c.plan.peak_bytes)
        over = least.plan.peak_bytes / least.plan.capacity_bytes
        return (f"nothing fits on {where}: of {result.total} candidates {len(memory)} need more memory, the least "
                f"{least.plan.peak_bytes / 1e9:.1f} GB ({over:.2f}x the device, {least.describe()})"
                + (f"; {others}" if others else "") + "; use more devices, a smaller seq_len or a smaller model")
    return f"nothing runs on {where}: all {result.total} candidates rejected ({others})"


def format_search(result: SearchResult, *, top: int = 5) -> str:
    hw = result.hardware
    tps = f"tp {', '.join(map(str, result.tps))} searched (inside a node), " if result.tps else \
        f"tp {result.tp} held, " if result.tp > 1 else ""
    n, unit = (result.sequences, "step (the config's global batch)") if result.tps else \
        (result.sequences_per_device, f"{'data-parallel rank' if result.tp > 1 else 'device'} per step")
    lines = [f"search on {result.devices} x {hw.name} ({hw.memory_bytes / 1e9:.1f} GB per device): "
             f"{tps}{n} sequence{'s' if n != 1 else ''} of {result.seq_len} per {unit}; "
             f"{result.total} candidates, {len(result.fitting)} fit"]
    if result.fp8_note:
        lines.append(f"fp8 not searched: {result.fp8_note}")
    if result.lora_fallback:
        lines.append(f"full fine-tuning fits in none of them; with LoRA (lora.rank {result.lora_rank}, "
                     "the base frozen) these fit, ranked: LoRA trains an update, not every weight (docs/lora.md)")
    best = result.fitting[0].plan.tokens_per_s
    for i, c in enumerate(result.fitting[:top], 1):
        p = c.plan
        lines.append(f"{i}. {p.tokens_per_s:,.0f} tokens/s ({p.tokens_per_s / best:.3f} of #1), MFU {p.mfu:.1f}%, "
                     f"step {p.time['step_s']:.4g} s, peak {p.peak_bytes / 1e9:.2f} GB: {c.describe()}")
        lines.append(f"   overrides: {' '.join(c.changes) if c.changes else '(the config as it is)'}")
    ties = sum(1 for c in result.fitting if c.plan.tokens_per_s >= best * (1 - TIE))
    if ties > 1:
        lines.append(f"{ties} candidates predict within {TIE:.1%} of #1: the planner does not model host overhead "
                     "per micro-batch, compile time or scan's steady-state cost, so they are ordered by fewer "
                     "micro-batches, then fewer changes, then lower peak memory")
    if result.rejected:
        lines.append(f"rejected {sum(len(v) for v in result.rejected.values())}:")
        for reason, cands in sorted(result.rejected.items(), key=lambda kv: -len(kv[1])):
            example = min(cands, key=lambda c: c.plan.peak_bytes) if reason == "memory" else cands[0]
            lines.append(f"  {len(cands):>5} {reason} (e.g. {example.describe()}: {example.detail})")
    return "\n".join(lines)


def search_json(result: SearchResult, *, top: int = 5) -> str:
    def row(c: Candidate) -> dict:
        return {"values": c.values, "overrides": c.changes, "tokens_per_s": c.plan.tokens_per_s, "mfu": c.plan.mfu,
                "step_s": c.plan.time["step_s"], "peak_bytes": c.plan.peak_bytes}

    return json.dumps({
        "hardware": dataclasses.asdict(result.hardware), "devices": result.devices,
        "sequences_per_device": result.sequences_per_device, "seq_len": result.seq_len, "tp": result.tp,
        "tps_searched": list(result.tps),
        "candidates": result.total, "fitting": len(result.fitting), "lora_fallback": result.lora_fallback,
        "fp8_note": result.fp8_note,
        "best": [row(c) for c in result.fitting[:top]],
        "rejected": {reason: {"count": len(cands), "example": cands[0].describe(), "detail": cands[0].detail}
                     for reason, cands in result.rejected.items()},
    }, indent=2)
