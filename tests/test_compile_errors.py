"""titan-tpu compile's one-line failures: the host-memory guard (xla/numbers.py
host_memory_guard; XLA's TPU compile of a large step can need more host memory than the machine
has, and the kernel's OOM killer would end it, or another process, without a word), and the reason
a compile child process gives its parent (certify, the recipe table) among libtpu's logging."""

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/meminfo")
def test_a_compile_that_runs_the_machine_out_of_memory_stops_with_one_line():
    # A floor above any machine's memory: the first look finds too little left.
    code = textwrap.dedent("""
        import time
        from titan_tpu.xla.numbers import host_memory_guard
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
    from titan_tpu.xla.numbers import host_memory_guard

    with host_memory_guard(floor=0, interval=0.01):
        total = sum(range(1000))
    assert total == 499500


def test_a_child_compile_s_reason_is_its_own_line_not_libtpu_s_logging():
    from titan_tpu.tools.compile_cmd import child_error_line

    noise = ("E0000 00:00:1796.1 common_lib.cc:906] INVALID_ARGUMENT: Error: unexpected worker hostname\n"
             "WARNING: Logging before InitGoogle() is written to STDERR\n=== Source Location Trace: ===\n")
    ours = noise + "error: XLA's TPU compiler rejected the step: RESOURCE_EXHAUSTED: E1000: out of HBM\n"
    assert child_error_line(ours) == "XLA's TPU compiler rejected the step: RESOURCE_EXHAUSTED: E1000: out of HBM"
    aborted = noise + "F1204 20:55:12.254484   26884 fusion_util.cc:2634] Check failed: Sublane window\n" \
                      "E1204 20:55:12.8 process_state.cc:796] RAW: Raising signal 6 with default behavior\n"
    assert child_error_line(aborted) == "libtpu aborted the compile: Check failed: Sublane window"
