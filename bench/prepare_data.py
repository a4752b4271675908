"""`titan-tpu prepare-data` throughput against the `tokenizers` library's own `encode_batch`.

Both tokenize the same documents (the standard library's .py files, as many MB as --mb) with
the same byte-level BPE and the same parallelism N (--workers):

* peer: `Tokenizer.encode_batch_fast` on the whole list in memory, in one process whose Rust
  thread pool has N threads (RAYON_NUM_THREADS=N): tokenization alone, nothing read or written;
* ours: `build_shards` with N worker processes, reading the documents from a parquet file and
  writing finished token shards (chunk files, index, rename), i.e. the whole prepare step.

Each runs in a fresh process, alternating, --rounds times; the ratio is the median of the
per-round ratios ours / peer (MB of text per second). Target: >= 0.8.

    python bench/prepare_data.py                 # 48 MB, 2 workers, 3 rounds
    python bench/prepare_data.py --mb 128 --workers 4

Until 2026-12-01 the script asked for 24 MB but the standard library held 11 MB, cut by prepare-data
into 3 chunks of 4 MB for 2 workers: the run measured the last chunk's wait as much as the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _documents(mb: int) -> list[str]:
    """``mb`` MB of Python source: the standard library's files (about 11 MB here), then copies of
    them, each with a line naming its copy, until the size is reached."""
    from titan_tpu.data import iter_documents

    files = list(iter_documents(None, max_bytes=mb << 20))
    docs, nbytes = list(files), sum(len(d.encode()) for d in files)
    while nbytes < mb << 20:
        doc = files[len(docs) % len(files)] + f"\n# copy {len(docs)}\n"
        docs.append(doc)
        nbytes += len(doc.encode())
    return docs


def _setup(work: Path, mb: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from titan_tpu.data import train_bpe_tokenizer

    docs = _documents(mb)
    pq.write_table(pa.table({"text": docs}), work / "docs.parquet")
    train_bpe_tokenizer(docs[:2000], vocab_size=8192, save_path=work / "tokenizer.json")


def _peer(work: Path) -> float:
    import pyarrow.parquet as pq
    import tokenizers

    docs = pq.read_table(work / "docs.parquet").column("text").to_pylist()
    tok = tokenizers.Tokenizer.from_file(str(work / "tokenizer.json"))
    nbytes = sum(len(d.encode()) for d in docs)
    t0 = time.perf_counter()
    tok.encode_batch_fast(docs, add_special_tokens=False)
    return nbytes / (time.perf_counter() - t0) / 1e6


def _ours(work: Path, workers: int) -> float:
    from titan_tpu.data.prepare import build_shards
    from titan_tpu.data.sources import iter_records
    from titan_tpu.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(work / "tokenizer.json")
    out = work / "shards"
    shutil.rmtree(out, ignore_errors=True)
    import pyarrow.parquet as pq

    nbytes = sum(len(d.encode()) for d in pq.read_table(work / "docs.parquet").column("text").to_pylist())
    t0 = time.perf_counter()
    build_shards(iter_records([work / "docs.parquet"], field="text"), tokenizer, out, workers=workers,
                 log=lambda m: None)
    return nbytes / (time.perf_counter() - t0) / 1e6


def _child(kind: str, work: Path, workers: int) -> float:
    env = dict(os.environ, RAYON_NUM_THREADS=str(workers))
    done = subprocess.run([sys.executable, __file__, "--child", kind, "--work", str(work), "--workers", str(workers)],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["mb_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=48)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=["peer", "ours"])
    parser.add_argument("--work")
    args = parser.parse_args()
    if args.child:
        work = Path(args.work)
        rate = _peer(work) if args.child == "peer" else _ours(work, args.workers)
        print(json.dumps({"mb_per_s": rate}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _setup(work, args.mb)
        ratios = []
        print(f"{args.mb} MB of Python source (the stdlib's, repeated), {args.workers} process(es)/threads; "
              f"MB/s of text")
        for r in range(args.rounds):
            peer = _child("peer", work, args.workers)
            ours = _child("ours", work, args.workers)
            ratios.append(ours / peer)
            print(f"round {r + 1}: tokenizers encode_batch {peer:.2f}  prepare-data {ours:.2f}  "
                  f"ratio {ours / peer:.2f}")
        print(f"prepare-data / encode_batch: {statistics.median(ratios):.2f} (median of {args.rounds}; target >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
