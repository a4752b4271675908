"""Replica fault tolerance: a replica group that dies leaves the gradient average until it comes back.

torchft's design in a few hundred lines of our own (docs/architecture.md says why not torchft itself):

- **The lighthouse** (`Lighthouse`, `python -m titan_tpu.train.replica_ft --port P`) hosts a TCPStore
  and decides the quorum: the replica groups whose heartbeat counter moved in the last
  `heartbeat_timeout` seconds. A change of members (or of a member's incarnation: a group restarted
  under the same id) publishes a new quorum id, `quorum/<id>` = its members.
- **Each replica group** (`ReplicaFT`) heartbeats from a thread, and at the start of every step agrees
  with its current peers on the newest quorum id (one all-reduce MAX of the id each saw, so every
  member switches at the same step). On a change it builds a new gloo process group over the members
  (a PrefixStore per quorum id), then the members exchange their step counts and the lowest-ranked
  member with the highest step broadcasts its state (model and optimizer, `torch.save`d) to the ones
  behind: a rejoining group takes the current weights from a healthy peer.
- **The gradient average** is an all-reduce SUM / members on that group. A peer dying mid-step makes
  the collective fail (gloo sees the closed socket); the step is not committed (no optimizer step),
  the survivor waits for the lighthouse to drop the dead group and goes on alone, its step count
  rising while the peer is down.

Scope: one process per replica group (dp_shard 1). With dp_shard > 1 inside a group each rank of the
group would join a quorum of its own shard index (rank r of every group all-reducing the same shard
of the gradient, as torchft's ProcessGroupBabyGloo per local rank) and the group must agree to commit
a step only when all of its ranks' cross-replica all-reduces succeeded (one intra-group all-reduce of
the failure flag); neither is built here.
"""

from __future__ import annotations

import argparse
import io
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class Quorum:
    qid: int
    members: list[list[int]]  # [replica_id, incarnation], sorted by replica id

    def rank_of(self, replica_id: int, incarnation: int) -> int | None:
        return next((i for i, m in enumerate(self.members) if m == [replica_id, incarnation]), None)


def _read_quorum(store: dist.Store, qid: int) -> Quorum:
    return Quorum(qid, json.loads(store.get(f"quorum/{qid}")))


class Lighthouse:
    """Hosts the store; publishes a new quorum whenever the set of live (replica, incarnation) changes."""

    def __init__(self, port: int, max_replicas: int = 8, heartbeat_timeout: float = 1.0, min_replicas: int = 1,
                 initial_replicas: int = 1, name: str = "lighthouse"):
        self.name = name  # what its log lines start with (two lighthouses may print into one stderr)
        self.store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        self.port = self.store.port
        self.max_replicas, self.timeout, self.min_replicas = max_replicas, heartbeat_timeout, min_replicas
        self.initial_replicas = initial_replicas  # the first quorum waits for this many groups (a common start)
        self.store.set("quorum", "0")
        self.store.set("quorum/0", "[]")

    def run(self, stop: threading.Event | None = None, poll: float = 0.02) -> None:
        last_seen: dict[int, tuple[int, float]] = {}  # replica -> (heartbeat count, when it last moved)
        members: list[list[int]] = []
        qid, retries, retry_since = 0, 0, None
        while stop is None or not stop.is_set():
            now = time.monotonic()
            # A group asks for a new quorum when it could not build the quorum's process group or a
            # collective failed. The live set is published again under a new id, but only after a
            # heartbeat timeout, so that a member that died meanwhile is out of it; a member that is
            # only slow (a longer checkpoint save) stays in, and the groups meet in the new quorum.
            asked = self.store.add("retry", 0)
            if asked != retries:
                retries, retry_since = asked, retry_since or now
            if retry_since is not None and now - retry_since >= self.timeout:
                members, retry_since = [], None
            for r in range(self.max_replicas):
                if self.store.check([f"hb/{r}"]):
                    count = int(self.store.get(f"hb/{r}"))
                    if last_seen.get(r, (None, 0.0))[0] != count:
                        last_seen[r] = (count, now)
            live = [[r, int(self.store.get(f"inc/{r}"))] for r, (_, t) in sorted(last_seen.items())
                    if now - t < self.timeout]
            needed = self.initial_replicas if qid == 0 else self.min_replicas
            if live != members and len(live) >= needed:
                members, qid, retry_since = live, qid + 1, None  # a new quorum answers any retry asked before it
                self.store.set(f"quorum/{qid}", json.dumps(members))
                self.store.set("quorum", str(qid))
                print(f"{self.name}: quorum {qid} {members}", file=sys.stderr, flush=True)
            time.sleep(poll)


def check_lighthouse(host: str, port: int, timeout: float, *, replicas: int) -> None:
    """A one-line error when nothing listens at host:port (rather than the store client's retries and
    C++ traces)."""
    from titan_tpu.errors import RunError

    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise RunError(f"fault_tolerance.lighthouse {host}:{port} does not answer ({e.strerror or e}): start it first "
                       f"with titan-tpu lighthouse --port {port} --replicas {replicas}") from e


@dataclass
class FTStats:
    quorum_changes: int = 0
    failed_steps: int = 0  # steps whose cross-replica all-reduce failed (not committed)
    recovered_from: list[int] = field(default_factory=list)  # replica ids this group took state from


class ReplicaFT:
    """One replica group's side: quorum, cross-replica gradient average, recovery from a peer.

    `state_fn()` returns the state a rejoining group needs (model, optimizer, step);
    `load_fn(state)` installs it. Use: `ft.start_step()` before forward, `ft.allreduce_grads(params)`
    after backward; commit (optimizer step) only when it returned True.
    """

    def __init__(self, host: str, port: int, replica_id: int, state_fn, load_fn,
                 timeout: float = 5.0, heartbeat_every: float = 0.05, connect_timeout: float = 60.0,
                 name: str | None = None):
        self.replica_id, self.state_fn, self.load_fn = replica_id, state_fn, load_fn
        self.name = name or f"replica {replica_id}"  # what its log lines start with
        self.timeout = timedelta(seconds=timeout)
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=connect_timeout))
        self.incarnation = self.store.add(f"inc/{replica_id}", 1)
        self.stats = FTStats()
        self.pg, self.quorum, self.step = None, Quorum(-1, []), 0
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat, args=(host, port, heartbeat_every), daemon=True)
        self._hb.start()

    def _heartbeat(self, host: str, port: int, every: float) -> None:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
        while not self._stop.is_set():
            store.add(f"hb/{self.replica_id}", 1)
            time.sleep(every)

    def close(self) -> None:
        """Stop heartbeating (the lighthouse drops this group) and release the quorum's process group
        now, while the interpreter is whole (gloo's threads must not be torn down at exit)."""
        self._stop.set()
        self._hb.join()
        self.pg = None

    @property
    def members(self) -> int:
        return len(self.quorum.members)

    def _newest_qid(self) -> int:
        return int(self.store.get("quorum"))

    def _wait_for_quorum(self, newer_than: int) -> Quorum:
        """Block until the lighthouse publishes a quorum newer than `newer_than` that includes this group."""
        while True:
            qid = self._newest_qid()
            if qid > newer_than:
                q = _read_quorum(self.store, qid)
                if q.rank_of(self.replica_id, self.incarnation) is not None:
                    return q
            time.sleep(0.02)

    def start_step(self) -> None:
        """Agree with the peers on the newest quorum; on a change rebuild the group and recover if behind."""
        while True:
            try:
                if self.pg is None:
                    self._join(self._wait_for_quorum(self.quorum.qid))
                    return
                seen = self._max_qid() if self.members > 1 else self._newest_qid()
                if seen == self.quorum.qid:
                    return
                q = _read_quorum(self.store, seen)
                if q.rank_of(self.replica_id, self.incarnation) is None:  # dropped (too slow): rejoin
                    q = self._wait_for_quorum(q.qid)
                self._join(q)
                return
            except RuntimeError as e:
                self._lost_peer(e)

    def _max_qid(self) -> int:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        t = torch.tensor([self._newest_qid()], dtype=torch.int64)
        self.pg.allreduce([t], opts).wait()
        return int(t)

    def _join(self, q: Quorum) -> None:
        rank = q.rank_of(self.replica_id, self.incarnation)
        prefix = dist.PrefixStore(f"pg/{q.qid}", self.store)
        self.quorum = q
        try:
            self.pg = dist.ProcessGroupGloo(prefix, rank, len(q.members), self.timeout)
        except RuntimeError:  # a member never came (it died, or took another quorum): ask for a new one
            self.store.add("retry", 1)
            raise
        self.stats.quorum_changes += 1
        print(f"{self.name}: quorum {q.qid} {q.members} at step {self.step}", file=sys.stderr, flush=True)
        steps = torch.zeros(len(q.members), dtype=torch.int64)
        steps[rank] = self.step
        self.pg.allreduce([steps]).wait()
        src = int(torch.argmax(steps))  # first rank holding the highest step
        if int(steps.min()) == int(steps.max()):
            return
        if rank == src:
            buf = io.BytesIO()
            torch.save(self.state_fn(), buf)
            payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size, src)
        if rank != src:
            payload = torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(payload, src)
        if rank != src:
            state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)
            self.load_fn(state)
            self.step = int(steps[src])
            self.stats.recovered_from.append(q.members[src][0])
            print(f"{self.name}: took step {self.step} from replica {q.members[src][0]}",
                  file=sys.stderr, flush=True)

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([t], opts).wait()

    def _lost_peer(self, error: Exception) -> None:
        """A collective failed: wait for the lighthouse to publish the next quorum, join it."""
        print(f"{self.name}: quorum {self.quorum.qid} failed at step {self.step}: "
              f"{str(error).splitlines()[0][:200]}", file=sys.stderr, flush=True)
        self.stats.failed_steps += 1
        self.pg = None
        self.store.add("retry", 1)  # a peer that only timed out is still alive: the quorum must change anyway

    def allreduce_grads(self, params) -> bool:
        """Average the parameters' gradients over the quorum; False (do not commit) when a peer died mid-step."""
        return self.average([p.grad for p in params if p.grad is not None])

    def average(self, grads: list[torch.Tensor]) -> bool:
        """Average `grads` in place over the quorum (one flat all-reduce); False (do not commit) when
        a peer died mid-step."""
        if self.members <= 1:
            return True
        flat = torch.cat([g.reshape(-1) for g in grads])
        try:
            self.pg.allreduce([flat]).wait()
        except RuntimeError as e:
            self._lost_peer(e)
            return False
        flat /= self.members
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return True


def main(argv: list[str] | None = None) -> None:
    """`titan-tpu lighthouse` (or python -m titan_tpu.train.replica_ft): runs until killed."""
    parser = argparse.ArgumentParser(
        prog="titan-tpu lighthouse",
        description="The replica groups' lighthouse: decides which groups average gradients each step "
                    "(docs/fault_tolerance.md). Start it first, then each group with --fault_tolerance.enabled true.")
    parser.add_argument("--port", type=int, default=29510, help="the port the groups' fault_tolerance.lighthouse names")
    parser.add_argument("--replicas", type=int, default=1,
                        help="groups the first quorum waits for (a common start; later quorums take the live ones)")
    parser.add_argument("--max-replicas", type=int, default=8, help="the highest replica id + 1 it looks for")
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0,
                        help="seconds without a heartbeat after which a group is dead (above any step's jitter)")
    parser.add_argument("--min-replicas", type=int, default=1, help="the fewest groups a quorum may have")
    args = parser.parse_args(argv)
    if not 1 <= args.replicas <= args.max_replicas:
        raise ValueError(f"--replicas {args.replicas} must be in [1, --max-replicas {args.max_replicas}]")
    lh = Lighthouse(args.port, max(args.max_replicas, args.replicas), args.heartbeat_timeout, args.min_replicas,
                    args.replicas)
    print(f"lighthouse on port {lh.port}", flush=True)
    lh.run()


if __name__ == "__main__":
    main()
