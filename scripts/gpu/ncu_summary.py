"""Kernel time of one training step from an Nsight Compute CSV, as one JSON object.

    ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none \
        --csv --page raw --log-file STEP.csv lathe bench train ... --iters 1
    python3 scripts/gpu/ncu_summary.py STEP.csv [--top 25]

The run holds a warm-up step and one timed step; the timed step is the kernels after the
first of the two optimizer launches (`adamw_many_f32`) up to the second. Without two
such launches (the composites' optimizer, say) every kernel of the run counts, model
loading included, and the report says so. Prints the step's kernel count and GPU time,
cuBLAS products apart from the rest, and the kernels that took longest, by name.
"""

import argparse
import collections
import csv
import json
import sys

MARKER = "adamw_many_f32"


def rows(path):
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    # ncu prints its own lines (==PROF== ...) before the table when logging to a file.
    start = next((i for i, r in enumerate(table) if "Kernel Name" in r), None)
    if start is None:
        raise SystemExit(f"error: {path}: no 'Kernel Name' column (not an ncu --csv --page raw log)")
    header = table[start]
    name, time = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    units = None
    out = []
    for r in table[start + 1 :]:
        if len(r) <= max(name, time):
            continue
        value = r[time].replace(",", "")
        try:
            out.append((r[name], float(value)))
        except ValueError:
            units = units or value  # the units row under the header
    if units not in (None, "ns", "nsecond"):
        raise SystemExit(f"error: {path}: times in {units!r}, expected ns")
    return out


def is_product(name):
    return "gemm" in name or "sgemm" in name or "splitKreduce" in name


def summary(kernels, top):
    marks = [i for i, (n, _) in enumerate(kernels) if n.startswith(MARKER)]
    whole_run = len(marks) < 2
    step = kernels if whole_run else kernels[marks[-2] + 1 : marks[-1] + 1]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for n, t in step:
        short = n.split("(")[0].replace("void ", "")[:100]
        by_name[short][0] += 1
        by_name[short][1] += t
    total = sum(t for _, t in step)
    products = sum(t for n, t in step if is_product(n))
    return {
        "step": "whole run (no two optimizer launches found)" if whole_run else "the timed step",
        "kernels": len(step),
        "gpu_ms": round(total / 1e6, 2),
        "cublas_products_ms": round(products / 1e6, 2),
        "other_ms": round((total - products) / 1e6, 2),
        "top": [
            {"kernel": n, "launches": c, "ms": round(t / 1e6, 3)}
            for n, (c, t) in sorted(by_name.items(), key=lambda x: -x[1][1])[:top]
        ],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    kernels = rows(a.csv)
    if not kernels:
        raise SystemExit(f"error: {a.csv}: no kernel rows")
    json.dump(summary(kernels, a.top), sys.stdout)
    print()


if __name__ == "__main__":
    main()
