"""`titan-tpu launch`: each host's share of a run derived from the flags, the environment GKE gives a
TPU pod, or a Cloud TPU VM's metadata (titan_tpu/tools/launch.py). The run it starts on two "hosts"
of this machine is in test_train_dist.py."""

import sys

import pytest

from titan_tpu.tools.launch import derive_layout, launch_environment, local_tpu_chips, parser, torchrun_argv

# A Cloud TPU VM's metadata for host 1 of a v5p-16 (2 hosts of 4 chips), as the server answers it:
# tpu-env's lines, and the endpoints in the older name:id:address form.
V5P_16 = {
    "tpu-env": "ACCELERATOR_TYPE: 'v5p-16'\nCHIPS_PER_HOST_BOUNDS: '2,2,1'\nHOST_BOUNDS: '1,1,2'\n"
               "TOPOLOGY: '2x2x2'\nWORKER_ID: '1'\n",
    "worker-network-endpoints": "t1v-n-0:0:10.130.0.5,t1v-n-1:1:10.130.0.6",
    "agent-worker-number": "1",
}


def layout(argv=(), environ=None, *, metadata=None, tpu_chips=0, gpus=0):
    asked = []

    def ask(key):
        asked.append(key)
        return (metadata or {}).get(key)

    args = parser().parse_args([*argv, "train"])
    got = derive_layout(args, environ or {}, metadata=ask, tpu_chips=tpu_chips, gpus=lambda: gpus)
    return got, asked


def test_a_tpu_vm_derives_everything_from_its_metadata():
    got, _ = layout(metadata=V5P_16, tpu_chips=4)
    assert (got.nnodes, got.node_rank, got.master_addr, got.nproc_per_node) == (2, 1, "10.130.0.5", 4)
    assert got.process_bounds == "2,2,2"  # the slice's chips, one process each
    assert got.hostnames == ("10.130.0.5", "10.130.0.6")
    assert "metadata" in got.describe() and "TPU_PROCESS_BOUNDS 2,2,2" in got.describe()
    run = torchrun_argv(got, ["train", "--config", "r.toml"])
    assert run[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert run[3:] == ["--nproc_per_node", "4", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.130.0.5",
                       "--master_port", "29500", "-m", "titan_tpu", "train", "--config", "r.toml"]
    env = launch_environment(got, {})
    assert env["TPU_PROCESS_BOUNDS"] == "2,2,2" and env["TPU_WORKER_HOSTNAMES"] == "10.130.0.5,10.130.0.6"
    assert (env["NNODES"], env["NODE_RANK"], env["MASTER_ADDR"]) == ("2", "1", "10.130.0.5")


def test_gke_variables_win_over_the_metadata_and_the_flags_over_both():
    gke = {"TPU_WORKER_HOSTNAMES": "pod-0.svc,pod-1.svc,pod-2.svc,pod-3.svc", "TPU_WORKER_ID": "2",
           "TPU_TOPOLOGY": "4x4"}
    got, _ = layout(environ=gke, metadata=V5P_16, tpu_chips=4)
    assert (got.nnodes, got.node_rank, got.master_addr) == (4, 2, "pod-0.svc")
    assert got.process_bounds == "4,4,1" and got.nproc_per_node == 4  # v6e-16: 4 hosts of 4 chips
    got, _ = layout(["--node-rank", "3", "--master-port", "1234"], environ=gke, tpu_chips=4)
    assert (got.node_rank, got.master_port) == (3, 1234)
    assert got.sources["hosts"].startswith("--nnodes/--node-rank/--master-addr with TPU_WORKER_HOSTNAMES")
    # an indexed Job's index stands in for TPU_WORKER_ID; a process grid the user set is kept
    got, _ = layout(environ={"TPU_WORKER_HOSTNAMES": "a,b", "JOB_COMPLETION_INDEX": "1",
                             "TPU_PROCESS_BOUNDS": "2,2,2"}, tpu_chips=4)
    assert got.node_rank == 1 and got.process_bounds == "2,2,2" and "kept" in got.sources["bounds"]


def test_without_accelerators_or_a_host_list_it_is_one_host_and_asks_no_server():
    got, asked = layout()
    assert (got.nnodes, got.node_rank, got.nproc_per_node, got.process_bounds) == (1, 0, 1, None)
    assert asked == []  # no TPU chips: no metadata server to wait for
    assert "--standalone" in torchrun_argv(got, ["train"])
    got, _ = layout(gpus=8)
    assert got.nproc_per_node == 8 and "CUDA" in got.sources["nproc"]
    # one name in TPU_WORKER_HOSTNAMES (a one-host TPU VM sets it) is one host
    got, _ = layout(environ={"TPU_WORKER_HOSTNAMES": "localhost"}, tpu_chips=4)
    assert got.nnodes == 1 and got.nproc_per_node == 4 and got.process_bounds is None


def test_explicit_hosts_on_cpus(tmp_path):
    got, _ = layout(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--nproc-per-node", "2"])
    assert (got.nnodes, got.node_rank, got.master_addr, got.nproc_per_node) == (2, 1, "10.0.0.1", 2)
    assert got.process_bounds is None  # no TPU: libtpu's grid is not needed
    env = launch_environment(got, {})
    assert (env["NNODES"], env["NODE_RANK"], env["MASTER_ADDR"]) == ("2", "1", "10.0.0.1")
    assert "TPU_WORKER_HOSTNAMES" not in env  # host 0 alone is no host list (torch-tpu counts its names)


@pytest.mark.parametrize("argv, environ, tpu_chips, message", [
    (["--nnodes", "2", "--master-addr", "h0"], {}, 0, "this host's index is unknown: pass --node-rank (0..1)"),
    (["--nnodes", "2", "--node-rank", "1"], {}, 0, "needs host 0's address: pass --master-addr"),
    (["--nnodes", "3"], {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0"}, 0, "lists 2 hosts"),
    (["--node-rank", "2"], {"TPU_WORKER_HOSTNAMES": "a,b"}, 0, "index 2 is outside 0..1"),
    ([], {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "x"}, 0, "TPU_WORKER_ID is 'x', not a host index"),
    ([], {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0"}, 4, "the slice's chip grid is unknown: pass --topology"),
    (["--topology", "2x2"], {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0"}, 4,
     "TPU_PROCESS_BOUNDS 2,2,1 is 4 chips, but 2 hosts x 4 processes is 8"),
    (["--topology", "2by2"], {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0"}, 4, "not a chip grid"),
])
def test_what_cannot_be_derived_is_one_line_naming_the_flag(argv, environ, tpu_chips, message):
    with pytest.raises(ValueError, match="launch") as e:
        layout(argv, environ, tpu_chips=tpu_chips)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_tpu_chips_are_counted_from_dev(tmp_path):
    assert local_tpu_chips(tmp_path) == 0
    (tmp_path / "vfio").mkdir()
    for name in ("0", "1", "2", "3", "vfio"):  # v5p: /dev/vfio/N per chip beside the vfio control node
        (tmp_path / "vfio" / name).touch()
    assert local_tpu_chips(tmp_path) == 4
    for n in range(8):
        (tmp_path / f"accel{n}").touch()
    assert local_tpu_chips(tmp_path) == 8


def test_the_command_line_answers_a_missing_command_in_one_line(capsys):
    from titan_tpu.cli import main

    assert main(["launch", "--nnodes", "1"]) == 2
    assert "launch needs a titan-tpu command to start" in capsys.readouterr().err
    assert main(["launch", "--dry-run", "--nproc-per-node", "2", "train", "--config", "c.toml"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("launch: one host") and "2 process(es) here (--nproc-per-node)" in out[0]
    assert out[-1].endswith("--nproc_per_node 2 --standalone -m titan_tpu train --config c.toml")
