"""The run's per-process peak memory: a component's own peak, its children's, and the whole tree's."""

from __future__ import annotations

import subprocess
import sys
import time

from swarmrl.memory_peaks import MemoryPeaks

MIB = 1 << 20
# Allocates `n` MiB (touched, so resident), frees it, then starts a child that allocates 64 MiB and waits.
HOLDER = """
import subprocess, sys, time
n = int(sys.argv[1])
block = bytearray(n << 20)
del block
child = subprocess.Popen([sys.executable, "-c", \
"import time; b = bytearray(64 << 20); print('up', flush=True); time.sleep(60)"],
                         stdout=subprocess.PIPE)
child.stdout.readline()
print("ready", flush=True)
time.sleep(60)
"""


def test_peaks_are_the_high_water_mark_by_component_and_children_are_counted_under_their_parent():
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "300"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        peaks = MemoryPeaks()
        peaks.sample({"worker-0": holder.pid})
        first = dict(peaks.own)
        peaks.sample({"worker-0": holder.pid})  # within the period: not sampled again
        report = peaks.report()
    finally:
        holder.kill()
        holder.wait()
    assert first == peaks.own
    # The 300 MiB was freed before the sample: only the kernel's high-water mark still shows it.
    assert peaks.own["worker-0"] >= 300 * MIB
    worker = report["components"]["worker-0"]
    assert worker["child_processes"] == 1 and worker["children_peak_gib"] >= 64 * MIB / (1 << 30)
    assert report["components"]["driver"]["peak_gib"] > 0  # this process, the root
    assert report["tree_peak_gib"] * (1 << 30) >= 64 * MIB
    assert any("worker-0" in line for line in peaks.summary_lines())


def test_a_process_that_ended_keeps_its_last_sampled_peak():
    proc = subprocess.Popen([sys.executable, "-c",
        "b = bytearray(100 << 20); import time; print('up', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    peaks = MemoryPeaks(period_s=0.0)
    peaks.sample({"relay-0": proc.pid})
    proc.kill()
    proc.wait()
    time.sleep(0.1)
    peaks.sample({"relay-0": proc.pid})
    assert peaks.own["relay-0"] >= 100 * MIB
