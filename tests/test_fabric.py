"""The fabric each collective of a plan crosses (plan/fabric.py, parallel/fabric_terms.py): which
mesh axis leaves its node or slice, the rate its ring runs at there, the source of that rate, and
the multi-slice TPU mesh (parallelism.slices) that lays dp_replicate across slices over DCN."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_tpu.cli import main
from titan_tpu.parallel.fabric_terms import fewest_members_in_a_domain, ring_bandwidth
from titan_tpu.parallel.plan_terms import Layout
from titan_tpu.plan import plan_config, resolve_hardware
from titan_tpu.plan.fabric import axis_rates
from titan_tpu.plan.hardware import HARDWARE
from titan_tpu.plan.search import search
from titan_tpu.plan.setting import for_planning

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
H100, V5P = HARDWARE["h100"], HARDWARE["v5p"]


def test_fsdp_across_nodes_runs_at_one_nic_and_tp_stays_on_nvlink():
    """405B's H100 layout: tp 8 fills each node, so each dp_shard group has one GPU per node and its
    ring runs at that GPU's one 400 Gb/s NIC (50 GB/s), not NVLink's 450."""
    rates = axis_rates(H100, Layout(dp_shard=16, tp=8))
    assert (rates["tp"].fabric, rates["tp"].bandwidth) == ("NVLink", H100.interconnect_bandwidth)
    assert (rates["dp_shard"].fabric, rates["dp_shard"].bandwidth) == ("InfiniBand", 400e9 / 8)
    assert rates["dp_shard"].source == H100.network_source and "ConnectX-7" in H100.network_source
    assert rates["tp"].source == H100.source and "NVLink" in H100.source


def test_a_ring_over_whole_nodes_uses_every_nic_of_the_node():
    # dp_shard 16 over 2 nodes, tp 1: eight members per node, eight NICs carry the boundary (400 GB/s),
    # under NVLink's 450.
    assert axis_rates(H100, Layout(dp_shard=16))["dp_shard"].bandwidth == pytest.approx(8 * 50e9)
    # Inside one node nothing leaves it; dp_replicate across 2 nodes with dp_shard 8 inside: one GPU per node.
    rates = axis_rates(H100, Layout(dp_replicate=2, dp_shard=8))
    assert rates["dp_shard"].fabric == "NVLink" and rates["dp_replicate"].fabric == "InfiniBand"
    assert rates["dp_replicate"].bandwidth == pytest.approx(50e9)
    # tp 16 spans two nodes: 8 members per node.
    assert axis_rates(H100, Layout(tp=16))["tp"].fabric == "InfiniBand"


def test_the_worst_group_decides_where_groups_straddle_nodes_unevenly():
    # 12 GPUs (one and a half nodes) of 3 groups of 4, stride 3: group 0 is ranks 0, 3, 6, 9 (node 0:
    # 3 of them, node 1: 1). Its worst domain holds one member.
    assert fewest_members_in_a_domain(stride=3, size=4, domain=8, world=12) == 1
    assert fewest_members_in_a_domain(stride=1, size=4, domain=8, world=16) == 4  # inside a node
    bandwidth, crosses = ring_bandwidth(stride=3, size=4, domain=8, world=12, inside=450e9, across=50e9)
    assert crosses and bandwidth == 50e9


def test_dp_replicate_across_slices_crosses_dcn_and_the_rest_stays_on_ici():
    rates = axis_rates(V5P, Layout(dp_replicate=2, dp_shard=64), slices=2)
    assert (rates["dp_replicate"].fabric, rates["dp_replicate"].bandwidth) == ("DCN", 50e9 / 8)
    assert "DCN" in rates["dp_replicate"].source and rates["dp_replicate"].source.startswith("https://")
    assert (rates["dp_shard"].fabric, rates["dp_shard"].bandwidth) == ("ICI", V5P.interconnect_bandwidth)
    # One slice: everything on ICI, as before slices.
    assert {r.fabric for r in axis_rates(V5P, Layout(dp_replicate=2, dp_shard=64)).values()} == {"ICI"}
    # 4 replicas over 2 slices: two replicas in each slice, so the DCN boundary carries two chips' share.
    rates = axis_rates(V5P, Layout(dp_replicate=4, dp_shard=32), slices=2)
    assert rates["dp_replicate"].fabric == "DCN" and rates["dp_replicate"].bandwidth == pytest.approx(2 * 50e9 / 8)
    # The CPU is one machine: gloo everywhere.
    cpu = resolve_hardware("cpu", measure=False)[0]
    assert {r.fabric for r in axis_rates(cpu, Layout(dp_shard=4)).values()} == {"gloo"}


def test_multi_slice_plan_of_a_v5p_recipe_times_its_all_reduce_on_dcn():
    recipe = CONFIGS / "llama3_8b_multislice_tpu.toml"
    plan = plan_config(for_planning(recipe))
    assert plan.devices == 128 and plan.mesh["slices"] == 2 and plan.fits
    by_axis = {c["axis"]: c for c in plan.communication}
    replicate, shard = by_axis["dp_replicate"], by_axis["dp_shard"]
    assert (replicate["fabric"], replicate["bandwidth"]) == ("DCN", 50e9 / 8) and "DCN" in replicate["source"]
    assert (shard["fabric"], shard["bandwidth"]) == ("ICI", 600e9)
    comm = sum(c["bytes_per_step"] / c["bandwidth"] for c in plan.communication)
    assert plan.time["collectives_s"] == pytest.approx(comm)
    # The same mesh in one slice (all of it ICI) moves the same bytes, faster.
    one = plan_config(for_planning(recipe, ["--parallelism.slices", "1"]))
    assert [c["bytes_per_step"] for c in one.communication] == [c["bytes_per_step"] for c in plan.communication]
    assert one.time["collectives_s"] < plan.time["collectives_s"]
    # Slices move one term: XLA's schedule for two slices holds the logits and their gradient through
    # the backward loop, behind the DCN all-reduce (plan/memory.py _xla_loss_held_over_dcn).
    assert plan.peak_bytes - one.peak_bytes == pytest.approx(2 * plan.memory["loss_peak"])


def test_plan_prints_each_terms_fabric_and_its_source(capsys):
    assert main(["plan", "--config", str(CONFIGS / "llama3_405b_h100_tp.toml")]) == 0
    out = capsys.readouterr().out
    gathers = [line for line in out.splitlines() if line.strip().startswith("all_gather ") and "dp_shard" in line]
    assert gathers and all("50 GB/s (InfiniBand)" in line for line in gathers)
    assert f"  InfiniBand: {H100.network_source}" in out and "  NVLink: " in out
    assert main(["plan", "--config", str(CONFIGS / "llama3_8b_multislice_tpu.toml"), "--json"]) == 0
    terms = json.loads(capsys.readouterr().out)["communication"]
    assert {(c["axis"], c["fabric"]) for c in terms} == {("dp_shard", "ICI"), ("dp_replicate", "DCN")}
    assert all(c["source"].startswith("https://") for c in terms)


def test_hardware_names_one_slice_of_several(capsys):
    """--hardware v5p-128 with parallelism.slices 2 is two v5p-128 slices (128 chips), as MaxText's
    compile_topology names one slice."""
    assert main(["plan", "--config", str(CONFIGS / "llama3_8b_multislice_tpu.toml"), "--hardware", "v5p-128",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"] == 128


@pytest.mark.parametrize("overrides,hardware,message", [
    (["--parallelism.slices", "2", "--parallelism.dp_replicate", "3", "--parallelism.dp_shard", "2"], None,
     "set parallelism.dp_replicate to a multiple of it"),
    (["--parallelism.slices", "2", "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "8"], "h100",
     "parallelism.slices = 2 names TPU slices; on h100 set it to 1"),
    (["--parallelism.slices", "2", "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "64"], "v4-128",
     "whose DCN bandwidth no vendor page states"),
])
def test_bad_slices_are_one_line(capsys, overrides, hardware, message):
    recipe = "llama3_405b_h100_tp" if hardware == "h100" else "llama3_8b_multislice_tpu"
    argv = ["plan", "--config", str(CONFIGS / f"{recipe}.toml"), *overrides]
    if hardware and hardware != "h100":
        argv += ["--hardware", hardware]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_search_varies_tp_inside_a_gpu_node():
    """On GPUs the search tries every tp that fits in a node (the config's global batch held): the
    70B H100 recipe's 32 GPUs try tp 1 to 8, each candidate a plan of its overrides."""
    # 32 sequences a step (accumulated 8 times at tp 8), so tp 1's 32 data-parallel ranks can split them
    result = search(for_planning(CONFIGS / "llama3_70b_h100_tp.toml", ["--training.grad_accum_steps", "8"]),
                    measure=False)
    assert result.tps == (1, 2, 4, 8) and result.fitting
    tried = {c.values["parallelism.tp"] for cs in [result.fitting, *result.rejected.values()] for c in cs}
    assert tried == {1, 2, 4, 8}
    assert {c.values["parallelism.tp"] for c in result.fitting} == {1, 2, 4, 8}
    for c in result.fitting:
        values = c.values
        assert values["parallelism.dp_replicate"] * values["parallelism.dp_shard"] * values["parallelism.tp"] * \
            values["parallelism.pp"] == 32
        assert c.plan.batch["tokens_per_step"] == result.sequences * result.seq_len  # the global batch, held
    tp_rows = [c for c in result.fitting if c.values["parallelism.tp"] > 1 and c.values["parallelism.pp"] == 1]
    assert all(not c.values["model.scan_layers"] for c in tp_rows)  # tp runs unrolled blocks under dp_shard
    # Tensor parallelism over 8 stays on NVLink; FSDP across the nodes crosses InfiniBand.
    fabrics = {(t["axis"], t["fabric"]) for c in tp_rows if c.values["parallelism.tp"] == 8
               for t in c.plan.communication}
    assert ("tp", "NVLink") in fabrics and ("dp_shard", "InfiniBand") in fabrics
    # TPUs hold tp at the config's value: their ICI has no node to keep it in.
    assert not search(for_planning(CONFIGS / "qwen3_8b_graph_tpu.toml"), measure=False).tps


def test_search_from_a_tpu_recipe_finds_full_training_on_512_h100(capsys):
    """Llama 3 405B's TPU recipe (tp 1) on 512 H100s: with tp searched, full-training layouts fit (at
    tp 1 and 2 among them); the first is the plan of its printed overrides, timed on NVLink and
    InfiniBand."""
    cfg = for_planning(CONFIGS / "llama3_405b_tpu.toml")
    hardware, chips = resolve_hardware("h100-512")
    result = search(cfg, hardware, chips=chips, measure=False)
    assert result.fitting and not result.lora_fallback and result.tps == (1, 2, 4, 8)
    assert {c.values["parallelism.tp"] for c in result.fitting} > {1}
    best = result.fitting[0]
    again = plan_config(for_planning(CONFIGS / "llama3_405b_tpu.toml", best.changes), hardware, chips=chips)
    assert again.fits and again.tokens_per_s == pytest.approx(best.plan.tokens_per_s)
    assert {t["fabric"] for t in again.communication} <= {"NVLink", "InfiniBand"}


def test_training_across_slices_is_refused_in_one_line(tmp_path):
    """Planned and compiled, not launched: a run with slices > 1 says so before it starts anything."""
    from titan_tpu.config import build_config
    from titan_tpu.loops import assemble

    cfg = build_config(CONFIGS / "llama3_debug.toml",
                       ["--parallelism.slices", "2", "--parallelism.dp_replicate", "2", "--training.device", "cpu",
                        "--output_dir", str(tmp_path / "run")])
    with pytest.raises(ValueError) as refused:
        assemble(cfg)
    assert "\n" not in str(refused.value) and "does not start a multi-slice run" in str(refused.value)
    assert not (tmp_path / "run").exists()
