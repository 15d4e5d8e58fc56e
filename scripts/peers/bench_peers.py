"""Lathe and its peers on the same machine, interleaved, as one JSON object.

Each round runs, one after another: `lathe bench train` in f32 and in bf16, PyTorch +
PEFT on the same shapes in f32 and with bf16 autocast, `lathe bench sample` (f32
and bf16) and llama.cpp decoding the same GGUF. Rounds interleave the systems so that a machine
getting busier or quieter affects all of them alike. Before each run the script samples
how busy the CPUs are with other work, and during it counts the CPU time not spent by the
run itself; the summary says whether every run was on a quiet machine (llama.cpp's OpenMP threads in
particular collapse when another process shares the cores).

Run through `scripts/bench-peers`, which builds Lathe and the peers' venv first.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LATHE = os.path.join(ROOT, "target", "release", "lathe")
PEERS = os.path.dirname(os.path.abspath(__file__))

# Other processes may use at most this fraction of all cores for a run to count as quiet.
QUIET_BUSY_FRACTION = 0.15


def cpu_times() -> tuple:
    """(all CPU time, idle CPU time) since boot, in clock ticks."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def cpu_busy_fraction(seconds: float = 1.0) -> float:
    """Fraction of all CPU time spent busy over `seconds` (nothing of ours runs then)."""
    t0, i0 = cpu_times()
    time.sleep(seconds)
    t1, i1 = cpu_times()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def children_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cpu_name() -> dict:
    name, flags, ids = platform.processor(), set(), {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                name = value.strip()
            elif key == "flags":
                flags = set(value.split())
            elif key in ("cpu family", "model", "stepping") and key not in ids:
                # With a generic model name, family/model/stepping say which CPU it is.
                ids[key.replace(" ", "_")] = value.strip()
    return {
        "name": name,
        **ids,
        "cores": os.cpu_count(),
        "amx_bf16": "amx_bf16" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "avx512_vnni": "avx512_vnni" in flags,
        "avx512f": "avx512f" in flags,
    }


def run_json(cmd: list, env: dict | None = None) -> dict:
    busy = cpu_busy_fraction()
    print(f"  {' '.join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd))}", file=sys.stderr)
    ticks = os.sysconf("SC_CLK_TCK")
    (t0, i0), c0 = cpu_times(), children_cpu_seconds()
    out = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=ROOT
    )
    (t1, i1), c1 = cpu_times(), children_cpu_seconds()
    # Busy CPU time during the run that was not the run's own, over all CPU time.
    others = ((t1 - t0) - (i1 - i0)) / ticks - (c1 - c0)
    busy_during = max(0.0, others / max((t1 - t0) / ticks, 1e-9))
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-3000:])
        raise SystemExit(f"{cmd[0]} failed with status {out.returncode}")
    # `lathe bench` prints one pretty-printed object; the Python peers one line last.
    try:
        result = json.loads(out.stdout)
    except json.JSONDecodeError:
        result = json.loads(out.stdout.strip().splitlines()[-1])
    result["_busy_before"] = round(busy, 3)
    result["_others_busy_during"] = round(busy_during, 3)
    return result


def median(xs):
    return round(statistics.median(xs), 2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5, help="timed iterations per run")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--skip-decode", action="store_true")
    a = p.parse_args()
    threads = str(os.cpu_count())
    shape = ["--batch", str(a.batch), "--seq-len", str(a.seq_len), "--rank", str(a.rank)]
    py = sys.executable
    runs: dict[str, list] = {k: [] for k in ["lathe_f32", "lathe_bf16", "torch_f32", "torch_bf16", "lathe_decode", "lathe_decode_bf16", "llama_decode"]}
    torch_cmd = [py, os.path.join(PEERS, "torch_train.py"), "--model", a.model, "--iters", str(a.iters), "--threads", threads] + shape
    jobs = [
        ("lathe_f32", [LATHE, "bench", "train", "--model", a.model, "--precision", "f32", "--iters", str(a.iters)] + shape),
        ("lathe_bf16", [LATHE, "bench", "train", "--model", a.model, "--precision", "bf16", "--iters", str(a.iters)] + shape),
        ("torch_f32", torch_cmd),
        ("torch_bf16", torch_cmd + ["--bf16"]),
    ]
    if not a.skip_decode:
        jobs += [
            ("lathe_decode", [LATHE, "bench", "sample", "--model", a.model, "--precision", "f32", "--iters", "3", "--streams", "8", "--adapters", "4"]),
            ("lathe_decode_bf16", [LATHE, "bench", "sample", "--model", a.model, "--precision", "bf16", "--iters", "3", "--streams", "8", "--adapters", "4"]),
            ("llama_decode", [py, os.path.join(PEERS, "llama_decode.py"), "--model", a.model, "--threads", threads, "--iters", "3"]),
        ]
    for r in range(a.rounds):
        print(f"round {r + 1} of {a.rounds}", file=sys.stderr)
        # Each round starts one system later, so no system always runs first or last.
        shift = r % len(jobs)
        for key, cmd in jobs[shift:] + jobs[:shift]:
            runs[key].append(run_json(cmd))
    train = {k: median([x["tokens_per_s_median"] for x in runs[k]]) for k in ["lathe_f32", "lathe_bf16", "torch_f32", "torch_bf16"]}
    report = {
        "bench": "peers",
        "cpu": cpu_name(),
        "threads": int(threads),
        "rounds": a.rounds,
        "train_shape": {"batch": a.batch, "seq_len": a.seq_len, "rank": a.rank, "targets": "q,k,v,o,gate,up,down"},
        "train_tokens_per_s": train,
        "lathe_bf16_kernel": runs["lathe_bf16"][0].get("bf16_kernel"),
        # What `--precision bf16` ran in: f32 where the CPU has no bf16 kernel.
        "lathe_bf16_ran_as": runs["lathe_bf16"][0].get("precision"),
        # Against the bf16 GEMM rate only where there is one (otherwise it is the f32 rate's).
        "lathe_bf16_fraction_of_bf16_gemm_peak": (
            median([x["fraction_of_gemm"] for x in runs["lathe_bf16"]])
            if runs["lathe_bf16"][0].get("bf16_kernel")
            else None
        ),
        "lathe_f32_fraction_of_f32_gemm_peak": median([x["fraction_of_gemm"] for x in runs["lathe_f32"]]),
        "ratios": {
            "lathe_bf16_over_torch_bf16": round(train["lathe_bf16"] / train["torch_bf16"], 3),
            "lathe_f32_over_torch_f32": round(train["lathe_f32"] / train["torch_f32"], 3),
            "lathe_bf16_over_lathe_f32": round(train["lathe_bf16"] / train["lathe_f32"], 3),
        },
        "versions": {
            "torch": runs["torch_f32"][0].get("torch"),
        },
    }
    if not a.skip_decode:
        single = median([x["single_stream_phases"]["decode_only_tokens_per_s"] for x in runs["lathe_decode"]])
        llama = median([x["decode_tokens_per_s_median"] for x in runs["llama_decode"]])
        report["decode_tokens_per_s"] = {
            # Lathe's stream carries a rank-8 adapter on seven projections; llama.cpp
            # decodes the bare model.
            "lathe_single_stream_with_adapter": single,
            "llama_cpp_single_stream": llama,
            "lathe_8_streams_4_adapters": median([x["batched_phases"]["decode_only_tokens_per_s"] for x in runs["lathe_decode"]]),
        }
        report["ratios"]["lathe_over_llama_cpp_decode"] = round(single / llama, 3)
        report["ratios"]["lathe_batched_over_single"] = median([x["batched_over_single_ratio_median"] for x in runs["lathe_decode"]])
        bf16 = runs["lathe_decode_bf16"]
        report["decode_bf16"] = {
            # Under --precision bf16 the decode products are the trainer's bf16 ones,
            # on AMX tiles or with AVX512-BF16 as the trainer's (f32 on a CPU with neither).
            "single_stream_tokens_per_s": median([x["single_stream_phases"]["decode_only_tokens_per_s"] for x in bf16]),
            "streams_8_adapters_4_tokens_per_s": median([x["batched_phases"]["decode_only_tokens_per_s"] for x in bf16]),
            "batched_over_single": median([x["batched_over_single_ratio_median"] for x in bf16]),
            # Not `median`, which keeps two decimals.
            "trainer_ratio_mean": round(statistics.median(x["trainer_agreement"]["ratio_mean"] for x in bf16), 5),
            "trainer_max_abs_logprob_diff": max(x["trainer_agreement"]["max_abs_logprob_diff"] for x in bf16),
        }
        report["ratios"]["lathe_bf16_over_llama_cpp_decode"] = round(report["decode_bf16"]["single_stream_tokens_per_s"] / llama, 3)
        report["versions"]["llama_cpp_python"] = runs["llama_decode"][0].get("llama_cpp_python")
    busy = [max(x["_busy_before"], x["_others_busy_during"]) for v in runs.values() for x in v]
    report["busiest_other_load"] = max(busy)
    report["quiet"] = max(busy) <= QUIET_BUSY_FRACTION
    if not report["quiet"]:
        report["warning"] = (
            f"other processes kept up to {max(busy):.0%} of the CPUs busy before or during "
            "a run: these figures are not trustworthy; rerun on a quiet machine"
        )
    report["runs"] = runs
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
