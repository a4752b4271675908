"""Replica fault tolerance, measured: 2 replica groups on CPU (gloo), one killed (kill -9) at random steps.

    python bench/replica_ft.py --steps 400 --faults 4 --seed 0

Runs a lighthouse (a thread here), an uninterrupted reference run of 2 groups and a run whose
group 1 is killed `--faults` times at random steps and restarted once the survivor stepped
`--down-steps` alone; reports per fault the
survivor's stall (its step across the fault), the steps the survivor took alone, the time from the
kill to the restarted group's first committed step, and the final loss of both runs.
`worker` is also what tests/test_replica_ft.py runs.

Each group is one process training a small MLP on its own batch per step (data keyed by step and
replica id), AdamW; train/replica_ft.py averages the gradients across the quorum.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _batch(step: int, replica: int, n: int = 64):
    import torch
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def worker(port: int, replica: int, steps: int, out: str, step_sleep: float, timeout: float,
           together_last: int = 10, name: str | None = None) -> None:
    """Trains until `steps`; the last `together_last` steps are taken only with a peer (a group alone
    waits there): how long a killed group takes to start again varies with the machine's load, and a
    survivor that finished the run meanwhile would leave its peer nobody to rejoin."""
    import torch

    from titan_tpu.train.replica_ft import ReplicaFT
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every group starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def state():
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(s):
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])

    ft = ReplicaFT("127.0.0.1", port, replica, state, load, timeout=timeout, name=name)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    log = open(out + ".jsonl", "a", buffering=1)
    while ft.step < steps:
        ft.start_step()
        if ft.members == 1 and ft.step >= steps - together_last:  # alone near the end: wait for the peer
            time.sleep(0.02)
            continue
        x, y = _batch(ft.step, replica)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if ft.allreduce_grads(model.parameters()):
            opt.step()
            ft.step += 1
            log.write(json.dumps({"step": ft.step, "loss": loss.item(), "members": ft.members,
                                  "t": time.time(), "pid": os.getpid(),
                                  "recovered_from": ft.stats.recovered_from}) + "\n")
        time.sleep(step_sleep)
    ex, ey = _batch(10**6, 0, 1024)
    with torch.no_grad():
        eval_loss = torch.nn.functional.mse_loss(model(ex), ey).item()
    torch.save({"model": model.state_dict(), "eval_loss": eval_loss, "failed_steps": ft.stats.failed_steps},
               out + ".pt")
    ft.close()
    log.close()
    os._exit(0)  # skip the interpreter's teardown of gloo's threads (it can abort: "terminate called ...")


def start_lighthouse(heartbeat_timeout: float, name: str = "lighthouse"):
    from titan_tpu.train.replica_ft import Lighthouse
    lh = Lighthouse(0, max_replicas=4, heartbeat_timeout=heartbeat_timeout, initial_replicas=2, name=name)
    stop = threading.Event()
    threading.Thread(target=lh.run, args=(stop,), daemon=True).start()
    return lh, stop


def spawn(port: int, replica: int, steps: int, out: Path, step_sleep: float, name: str, timeout: float = 5.0):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "bench" / "replica_ft.py"), "--worker", "--port", str(port),
           "--replica", str(replica), "--steps", str(steps), "--out", str(out),
           "--step-sleep", str(step_sleep), "--timeout", str(timeout), "--name", name]
    return subprocess.Popen(cmd, env=env)


def records(out: Path) -> list[dict]:
    path = Path(str(out) + ".jsonl")
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_step(out: Path) -> int:
    r = records(out)
    return r[-1]["step"] if r else 0


def wait_until(cond, timeout: float, poll: float = 0.02) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("condition not met in time")
        time.sleep(poll)


def run_pair(work: Path, name: str, steps: int, kill_steps: list[int], step_sleep: float,
             down_steps: int, heartbeat_timeout: float = 0.5) -> dict:
    """Two groups; group 1 is killed at each of `kill_steps` and restarted once group 0 stepped `down_steps` alone."""
    lh, stop = start_lighthouse(heartbeat_timeout, name=f"{name} lighthouse")
    out0, out1 = work / f"{name}-r0", work / f"{name}-r1"
    p0, p1 = (spawn(lh.port, r, steps, out, step_sleep, f"{name} replica {r}") for r, out in ((0, out0), (1, out1)))
    faults = []
    for k in kill_steps:
        wait_until(lambda: last_step(out1) >= k, 120)
        os.kill(p1.pid, signal.SIGKILL)
        p1.wait()
        t_kill, killed_at = time.time(), last_step(out1)
        survivor_at = last_step(out0)
        wait_until(lambda: last_step(out0) >= survivor_at + down_steps, 120)
        alone = last_step(out0) - survivor_at
        p1, t_restart = spawn(lh.port, 1, steps, out1, step_sleep, f"{name} replica 1"), time.time()
        wait_until(lambda: any(r["pid"] == p1.pid for r in records(out1)), 120)
        first = next(r for r in records(out1) if r["pid"] == p1.pid)
        faults.append({"killed_at": killed_at, "survivor_steps_while_down": alone,
                       "restart_to_rejoined_step_s": first["t"] - t_restart,
                       "survivor_stall_s": _stall(records(out0), t_kill), "rejoined_at": first["step"],
                       "recovered_from": first["recovered_from"]})
    assert p0.wait(timeout=300) == 0 and p1.wait(timeout=300) == 0
    stop.set()
    return {"faults": faults, "r0": records(out0), "r1": records(out1),
            "final0": Path(str(out0) + ".pt"), "final1": Path(str(out1) + ".pt")}


def _stall(recs: list[dict], t_kill: float) -> float:
    """The survivor's step across the peer's death: from its last commit before the kill to its next one."""
    before = max(r["t"] for r in recs if r["t"] <= t_kill)
    return min(r["t"] for r in recs if r["t"] > t_kill) - before


def main(argv=None) -> None:
    import torch
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--port", type=int)
    parser.add_argument("--replica", type=int)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out")
    parser.add_argument("--step-sleep", type=float, default=0.04)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--together-last", type=int, default=10,
                        help="(worker) the last steps a group takes only with its peer")
    parser.add_argument("--name", help="(worker) what its log lines start with")
    parser.add_argument("--faults", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--down-steps", type=int, default=10)
    parser.add_argument("--work", default="/tmp/replica_ft_bench")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.port, args.replica, args.steps, args.out, args.step_sleep, args.timeout,
                      args.together_last, args.name)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for f in work.glob("*"):
        f.unlink()
    rng = random.Random(args.seed)
    span = args.steps // (args.faults + 1)
    kills = sorted(rng.randint(i * span + 5, (i + 1) * span - args.down_steps - 5) for i in range(args.faults))
    t0 = time.time()
    ref = run_pair(work, "ref", args.steps, [], args.step_sleep, args.down_steps)
    t_ref = time.time() - t0
    t0 = time.time()
    run = run_pair(work, "ft", args.steps, kills, args.step_sleep, args.down_steps)
    t_ft = time.time() - t0
    f0, f1, fr = (torch.load(run["final0"]), torch.load(run["final1"]), torch.load(ref["final0"]))
    same = all(torch.equal(f0["model"][k], f1["model"][k]) for k in f0["model"])
    print(f"kills at steps {kills}; wall {t_ft:.1f} s (reference {t_ref:.1f} s)")
    for f in run["faults"]:
        print(f"  killed at {f['killed_at']}: survivor stepped {f['survivor_steps_while_down']} steps alone, "
              f"its step across the fault {f['survivor_stall_s']:.2f} s; restart to the rejoined group's first step "
              f"{f['restart_to_rejoined_step_s']:.2f} s "
              f"(rejoined at step {f['rejoined_at']}, state from replica {f['recovered_from']})")
    print(f"survivor's uncommitted steps "
          f"{f0['failed_steps']}; weights identical at the end: {same}; eval loss {f0['eval_loss']:.5f} "
          f"(uninterrupted {fr['eval_loss']:.5f})")


if __name__ == "__main__":
    main()
