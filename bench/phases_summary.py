#!/usr/bin/env python3
"""Medians of the server's per-call phases from a debug-level log.

    phases_summary.py SERVER_LOG

mlakv-server at --log_level debug writes, per AppendBatch, a line ending in
"rows=R us: checks=.. wait=.. prepare=.. stage=.. commit=.. respond=.." and,
per write of a CUDA pool, "cuda backend append: layers=L rows=R ... us:
stage=.. enqueue=.. sync=.. gpu_to_kernel=.. gpu_kernel=..". This prints, per
kind of line and row count, the p50 and p90 of every field: where a call's
server time goes on the machine it ran on (bench/run_aims.sh phases)."""
import collections
import re
import statistics
import sys

FIELD = re.compile(r"(\w+)=(-?[0-9.]+)")


def main_for(log):
    groups = collections.defaultdict(lambda: collections.defaultdict(list))
    with open(log, errors="replace") as f:
        for line in f:
            if "cuda backend append:" in line:
                kind = "backend"
            elif "AppendBatch" in line and " us: " in line:
                kind = "AppendBatch"
            else:
                continue
            head, _, timed = line.partition(" us: ")
            named = dict(FIELD.findall(head))
            rows, layers = named.get("rows", "?"), named.get("layers", "")
            key = (kind, rows + (" x %s layers" % layers if layers else ""))
            for name, value in FIELD.findall(timed):
                groups[key][name].append(float(value))
    if not groups:
        print("no timed lines (was the server at --log_level debug?)")
        return 1
    for (kind, rows), fields in sorted(groups.items()):
        n = max(len(v) for v in fields.values())
        print("%s, rows=%s (%d calls): %s" % (kind, rows, n, "  ".join(
            "%s p50 %.1f p90 %.1f" % (name, statistics.median(v), sorted(v)[int(len(v) * 0.9)])
            for name, v in fields.items())))
    return 0


def main():
    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1])
        return 2
    return main_for(sys.argv[1])


if __name__ == "__main__":
    sys.exit(main())
