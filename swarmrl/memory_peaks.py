"""Peak memory of every process of a run, by component: what a real-size run needs from its machine.

The kernel keeps each process's resident high-water mark (VmHWM in /proc/<pid>/status), so sampling
every few seconds loses nothing of a live process's peak; a process that ends between two samples keeps
the peak of its last sample. The sum of current RSS over the driver's process tree, sampled, is the
machine-wide peak (processes peak at different times, so the sum of peaks overstates it). With a local
Ray, the actors are the driver's descendants (the raylet starts them); on a remote cluster only the
processes on this host are seen.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import psutil

GIB = float(1 << 30)


def _hwm_bytes(proc: psutil.Process) -> int:
    """VmHWM: the process's resident peak (Linux); its current RSS elsewhere."""
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return proc.memory_info().rss


@dataclass
class MemoryPeaks:
    root_pid: int = field(default_factory=os.getpid)
    period_s: float = 2.0
    own: dict[str, int] = field(default_factory=dict)  # component -> its own process's peak
    children: dict[str, dict[int, int]] = field(default_factory=dict)  # component -> {descendant pid: peak}
    total_peak: int = 0  # the largest sum of current RSS over the whole tree
    _next: float = 0.0

    def sample(self, named: dict[str, int], force: bool = False) -> None:
        """`named`: component -> pid (the supervisor's pids). Every other process is counted under its
        nearest named ancestor, else under `ray` (Ray's own processes), the root itself as `driver`."""
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + self.period_s
        by_pid = {pid: name for name, pid in named.items() if isinstance(pid, int)}
        by_pid[self.root_pid] = "driver"
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
                peak = _hwm_bytes(proc)
                name, own = self._owner(proc, by_pid)
            except psutil.Error:  # ended while we looked
                continue
            if own:
                self.own[name] = max(self.own.get(name, 0), peak)
            else:
                kids = self.children.setdefault(name, {})
                kids[proc.pid] = max(kids.get(proc.pid, 0), peak)
        self.total_peak = max(self.total_peak, total)

    def _owner(self, proc: psutil.Process, by_pid: dict[int, str]) -> tuple[str, bool]:
        if proc.pid in by_pid:
            return by_pid[proc.pid], True
        for parent in proc.parents():
            if parent.pid in by_pid and by_pid[parent.pid] != "driver":
                return by_pid[parent.pid], False
        return "ray", False

    def report(self) -> dict:
        """GiB per component: its own peak and the sum of its child processes' peaks; and the machine's."""
        names = sorted(set(self.own) | set(self.children))
        return {
            "components": {n: {"peak_gib": round(self.own.get(n, 0) / GIB, 2),
                               "children_peak_gib": round(sum(self.children.get(n, {}).values()) / GIB, 2),
                               "child_processes": len(self.children.get(n, {}))} for n in names},
            "tree_peak_gib": round(self.total_peak / GIB, 2),
            "machine_gib": round(psutil.virtual_memory().total / GIB, 1),
        }

    def summary_lines(self) -> list[str]:
        r = self.report()
        parts = [f"{n} {c['peak_gib']:.2f}" + (f" (+{c['children_peak_gib']:.2f} in {c['child_processes']} child "
            f"processes)" if c["child_processes"] else "")
                 for n, c in r["components"].items()]
        return [f"- peak memory, GiB (each process's resident high-water mark): {'; '.join(parts)}",
                f"- peak memory of all of the run's processes at once: {r['tree_peak_gib']:.2f} GiB of "
                f"{r['machine_gib']} GiB (memory.json)"]
