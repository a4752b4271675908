"""Run every multi-process test many times in a row and count passes per test.

    python tests/stress.py                 # every test marked `multiprocess`, 20 rounds
    python tests/stress.py -n 5 -k scan    # 5 rounds of the marked tests matching "scan"
    make stress ARGS="-n 5"

A test that spawns ranks (tests/dist_utils.run_distributed) or runs training processes (torchrun,
kill -9) can fail one run in ten for reasons a single run never shows: process start-up and
teardown, sockets, threads, signals. Before such a test is committed, run it here; 20 of 20 is the
bar. Each round is one fresh pytest session over all the selected tests, in the suite's order (so
what a test inherits from the ones before it is the same as in `make test`); the outcome of every
test is read back from pytest's JUnit XML report. Logs of failed rounds are kept in --log-dir.

Exit status: 0 when every selected test passed every round, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _outcomes(junit_xml: Path) -> dict[str, str]:
    """test id -> "passed" | "failed" | "skipped" from one JUnit XML report."""
    outcomes = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[test_id] = "failed"
        elif case.find("skipped") is not None:
            outcomes[test_id] = "skipped"
        else:
            outcomes[test_id] = "passed"
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--rounds", type=int, default=20, help="how many times to run each test (20)")
    parser.add_argument("-k", default="", help="only tests matching this pytest -k expression")
    parser.add_argument("-m", default="multiprocess", help="pytest marker expression selecting the tests")
    parser.add_argument("--log-dir", default=str(ROOT / "outputs" / "stress"),
                        help="where the logs of failed rounds go (outputs/stress)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("-n must be >= 1")

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    select = ["-m", args.m] + (["-k", args.k] if args.k else [])
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    started = time.monotonic()
    for round_number in range(1, args.rounds + 1):
        report = log_dir / f"round-{round_number:03d}.xml"
        round_start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *select,
                               f"--junitxml={report}", "tests"],
                              cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONFAULTHANDLER="1"))
        outcomes = _outcomes(report) if report.exists() else {}
        if not outcomes:
            print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
            print(f"round {round_number}: pytest selected no tests or crashed (exit {done.returncode})")
            return 1
        for test_id, outcome in outcomes.items():
            counts[test_id][outcome] += 1
        failed = sorted(t for t, o in outcomes.items() if o == "failed")
        if failed:
            log = log_dir / f"round-{round_number:03d}.log"
            log.write_text(done.stdout + done.stderr)
            print(f"round {round_number}/{args.rounds}: {len(failed)} failed ({', '.join(failed)}); log: {log}",
                  flush=True)
        else:
            report.unlink()
            print(f"round {round_number}/{args.rounds}: {len(outcomes)} passed in "
                  f"{time.monotonic() - round_start:.0f} s", flush=True)

    print(f"\n{'passed':>8} {'failed':>7}  test   ({args.rounds} rounds, {time.monotonic() - started:.0f} s)")
    for test_id in sorted(counts):
        c = counts[test_id]
        print(f"{c['passed']:>5}/{args.rounds:<2} {c['failed']:>7}  {test_id}")
    return 0 if all(c["failed"] == 0 for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
