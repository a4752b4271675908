"""titan-tpu compile's host-memory guard (tools/compile_cmd.py host_memory_guard): XLA's TPU compile
of a large MoE step can need more host memory than the machine has; the guard ends the process
with one line saying so, where the kernel's OOM killer would end it (or another) without a word."""

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/meminfo")
def test_a_compile_that_runs_the_machine_out_of_memory_stops_with_one_line():
    # A floor above any machine's memory: the first look finds too little left.
    code = textwrap.dedent("""
        import time
        from titan_tpu.tools.compile_cmd import host_memory_guard
        with host_memory_guard(floor=1 << 60, interval=0.05):
            time.sleep(30)
        print("not stopped")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "not stopped" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: XLA's TPU compile of this step needs more host memory than this machine has")
    assert "GiB" in lines[0] and "compile it on a machine with more memory" in lines[0]


def test_the_guard_lets_a_compile_that_fits_finish():
    from titan_tpu.tools.compile_cmd import host_memory_guard

    with host_memory_guard(floor=0, interval=0.01):
        total = sum(range(1000))
    assert total == 499500
