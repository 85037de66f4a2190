"""Runs a command and reports its wall time and the peak resident memory of its whole process
tree (the sum over the command and all its descendants, sampled every 20 ms from /proc, the
descendants looked up again every 0.5 s), since `time -v` only reports the largest single
process and Megatron forks workers.
Usage: measure.py OUT.json [--stdout FILE] -- COMMAND ARGS... (stdout is discarded unless
--stdout names a file to keep it in)."""
import json
import os
import subprocess
import sys
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def tree_pids(root):
    """The command's process and all its descendants."""
    children = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def tree_rss(pids):
    """Resident bytes summed over `pids` (those that still run)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total


def main():
    out, rest = sys.argv[1], sys.argv[2:]
    stdout = subprocess.DEVNULL
    if rest[:1] == ["--stdout"]:
        stdout, rest = open(rest[1], "w"), rest[2:]
    sep, cmd = rest[0], rest[1:]
    assert sep == "--" and cmd, __doc__
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE)
    # Reading every process's /proc entries each sample costs ~0.5 ms of a core, which slows a
    # command that keeps both cores busy by a few percent: the tree is found again only every
    # half second (the benchmarked commands start their workers once), its members read each
    # 20 ms.
    peak, pids, found = 0, [], 0.0
    while proc.poll() is None:
        now = time.perf_counter()
        if now - found >= 0.5:
            pids, found = tree_pids(proc.pid), now
        peak = max(peak, tree_rss(pids))
        time.sleep(0.02)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace")
    if proc.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({proc.returncode}):\n{err[-2000:]}")
    with open(out, "w") as f:
        json.dump({"wall_s": wall, "peak_rss_mb": peak / 2**20, "stderr_tail": err[-500:]}, f)


if __name__ == "__main__":
    main()
