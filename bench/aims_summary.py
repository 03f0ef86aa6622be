#!/usr/bin/env python3
"""Each aim of issues 16 and 18 against what bench/run_aims.sh measured.

    aims_summary.py OUT_DIR

Reads the parts' files in OUT_DIR (floor.txt, ipc.txt, kernel.txt,
bytes.txt, save.txt; a part not run is left out) and prints, per aim, every
figure measured (one per round or run), how many meet the aim, and the
median. The aims are those of docs/performance.md "Where the open aims
stand"; the figures are the programs' own lines, not recomputed."""
import json
import os
import re
import statistics
import sys


def read(out, name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        return f.read()


def floor_ratios(text):
    """mlakv's GetPool p50 over the minimal sync server's, each alone in the
    process in turn (rpc_floor_bench's first table: the aim's comparison)."""
    table = text.split("rpc_floor_bench: 2 x")[0] if "each server alone" in text else ""
    sync = re.search(r"minimal sync server, Health/Check\s+p50\s+([0-9.]+)", table)
    mlakv = re.search(r"mlakv-server, GetPool\s+p50\s+([0-9.]+)", table)
    return [float(mlakv.group(1)) / float(sync.group(1))] if sync and mlakv else []


def ipc_figures(text):
    """Per round: the 262k append over the kernel (view LENGTHS), one row
    over GetPool, the decode step PACKED p50 / p99, its launch over a copy."""
    out = {"262k": [], "one_row": [], "step_p50": [], "step_p99": [], "launch": []}
    for block in re.split(r"(?=^ipc append of |^decode step by reference)", text, flags=re.M):
        head = block.splitlines()[0] if block else ""
        if head.startswith("ipc append of 262144"):
            m = re.search(r"view LENGTHS\s+end to end [0-9.]+ us .*kernel \+ ([0-9.]+) us", block)
            if m:
                out["262k"].append(float(m.group(1)))
        elif head.startswith("ipc append of 1 "):
            floor = re.search(r"GetPool \(RPC floor\) ([0-9.]+) us", head)
            m = re.search(r"view LENGTHS\s+end to end ([0-9.]+) us", block)
            if floor and m:
                out["one_row"].append(float(m.group(1)) / float(floor.group(1)))
        elif head.startswith("decode step by reference"):
            m = re.search(r"view PACKED \(steps interleaved\): p50 ([0-9.]+) us, p90 [0-9.]+ us, p99 ([0-9.]+) us",
                          block)
            if m:
                out["step_p50"].append(float(m.group(1)))
                out["step_p99"].append(float(m.group(2)))
            m = re.search(r"one launch / copy = ([0-9.]+)x", block)
            if m:
                out["launch"].append(float(m.group(1)))
    return out


def kernel_pct(text, case):
    return [float(m) for m in re.findall(r"^%s\s+\d+\s+(?:[0-9.]+\s+){5}([0-9.]+)%%" % re.escape(case), text, re.M)]


def bytes_figures(text):
    out = {"compact_p50_ms": [], "one_gbps": [], "eight_gbps": []}
    for block in re.split(r"(?=^== )", text, flags=re.M):
        p50 = re.search(r"latency\s+p50 ([0-9.]+) us", block)
        rate = re.search(r"rows .*: ([0-9.]+) GB/s", block)
        if block.startswith("== compact bytes decode step") and p50:
            out["compact_p50_ms"].append(float(p50.group(1)) / 1e3)
        elif block.startswith("== ingest, one connection") and rate:
            out["one_gbps"].append(float(rate.group(1)))
        elif block.startswith("== ingest, eight connections") and rate:
            out["eight_gbps"].append(float(rate.group(1)))
    return out


def save_figures(text, tokens=4096):
    out = {"commit_ms": [], "overhead_pct": []}
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("tokens") == tokens and "last_compute_to_commit_ms" in r:
            out["commit_ms"].append(r["last_compute_to_commit_ms"])
            out["overhead_pct"].append(r["overhead_pct"])
    return out


def row(aim, figures, meets, fmt):
    if not figures:
        return "  %-58s not measured" % aim
    met = sum(1 for x in figures if meets(x))
    return "  %-58s %s  -> met in %d of %d (median %s)" % (
        aim, ", ".join(fmt % x for x in figures), met, len(figures), fmt % statistics.median(figures))


def main_for(out):
    lines = []
    floor = read(out, "floor.txt")
    if floor is not None:
        lines.append(row("GetPool p50 / minimal sync server <= 1.15x", floor_ratios(floor),
                         lambda x: x <= 1.15, "%.2fx"))
    ipc = read(out, "ipc.txt")
    if ipc is not None:
        f = ipc_figures(ipc)
        lines.append(row("262,144-row IPC append: kernel + <= 150 us", f["262k"], lambda x: x <= 150, "+%.1f us"))
        lines.append(row("one-row IPC append <= 1.3x GetPool", f["one_row"], lambda x: x <= 1.3, "%.2fx"))
        lines.append(row("decode step by reference p50 <= 300 us", f["step_p50"], lambda x: x <= 300, "%.1f us"))
        lines.append(row("decode step by reference p99 <= 1 ms", f["step_p99"], lambda x: x <= 1000, "%.0f us"))
        lines.append(row("decode step's one launch <= 1.3x a copy", f["launch"], lambda x: x <= 1.3, "%.2fx"))
    kernel = read(out, "kernel.txt")
    if kernel is not None:
        lines.append(row("kernel at 16,384 rows >= 88% of a copy", kernel_pct(kernel, "prefill_4x4096"),
                         lambda x: x >= 88, "%.1f%%"))
        lines.append(row("kernel at 32,768 rows >= 88% of a copy", kernel_pct(kernel, "prefill_8x4096"),
                         lambda x: x >= 88, "%.1f%%"))
    by = read(out, "bytes.txt")
    if by is not None:
        f = bytes_figures(by)
        lines.append(row("compact bytes decode step p50 <= 10 ms", f["compact_p50_ms"], lambda x: x <= 10, "%.2f ms"))
        lines.append(row("ingest, one connection >= 2 GB/s", f["one_gbps"], lambda x: x >= 2, "%.2f GB/s"))
        lines.append(row("ingest, eight connections >= 10 GB/s", f["eight_gbps"], lambda x: x >= 10, "%.2f GB/s"))
    save = read(out, "save.txt")
    if save is not None:
        f = save_figures(save)
        lines.append(row("save at 4k tokens: last compute -> commit <= 1 ms", f["commit_ms"], lambda x: x <= 1,
                         "%.2f ms"))
        lines.append(row("save at 4k tokens: the loop's overhead < 5%", f["overhead_pct"], lambda x: x < 5, "%.1f%%"))
    if not lines:
        print("aims_summary: no part's file in %s" % out)
        return 1
    print("\n".join(lines))
    return 0


def main():
    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1])
        return 2
    return main_for(sys.argv[1])


if __name__ == "__main__":
    sys.exit(main())
