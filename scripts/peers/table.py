"""The README's table of Lathe against its peers, from a `scripts/bench-peers` report.

    scripts/bench-peers --rounds 3 > peers.json
    python3 scripts/peers/table.py peers.json
"""

import json
import sys


def main() -> None:
    with open(sys.argv[1]) as f:
        r = json.load(f)
    t, x = r["train_tokens_per_s"], r["ratios"]
    # Without a bf16 kernel `--precision bf16` runs in f32: the rows say so, and there is
    # no bf16 GEMM rate to hold training to.
    kernel = r.get("lathe_bf16_kernel")
    bf16 = f"`--precision bf16`, {kernel}" if kernel else "`--precision bf16`: f32, no bf16 kernel on this CPU"
    rows = [
        ("| | Lathe | Peer | Lathe / peer | Target |", None),
        ("|---|---|---|---|---|", None),
        (
            f"| training, f32 | {t['lathe_f32']:.0f} tokens/s | PyTorch + PEFT f32: "
            f"{t['torch_f32']:.0f} | {x['lathe_f32_over_torch_f32']:.2f}x | |",
            None,
        ),
        (
            f"| training, bf16 ({bf16}) | "
            f"{t['lathe_bf16']:.0f} tokens/s ({x['lathe_bf16_over_lathe_f32']:.2f}x Lathe f32) | "
            f"PyTorch + PEFT, bf16 autocast: {t['torch_bf16']:.0f} | "
            f"{x['lathe_bf16_over_torch_bf16']:.2f}x | "
            + (f"2x{met(x['lathe_bf16_over_torch_bf16'] >= 2)} |" if kernel else "n/a (no bf16 kernel) |"),
            None,
        ),
    ]
    if kernel:
        fraction = r["lathe_bf16_fraction_of_bf16_gemm_peak"]
        rows.append(
            (
                "| training in bf16: achieved over the bf16 GEMM rate `lathe bench gemm` measures | "
                f"{fraction:.2f} | | | 0.6{met(fraction >= 0.6)} |",
                None,
            )
        )
    d = r.get("decode_tokens_per_s")
    if d:
        lathe = d.get("lathe_single_stream_with_adapter", d.get("lathe_single_stream"))
        rows.append(
            (
                "| single-stream decode (Q4_1, decode phase alone; Lathe's stream carries a "
                "rank-8 adapter on seven projections, llama.cpp decodes the bare model) | "
                f"{lathe:.0f} tokens/s | llama.cpp: {d['llama_cpp_single_stream']:.0f} | "
                f"{x['lathe_over_llama_cpp_decode']:.2f}x | 1.2x{met(x['lathe_over_llama_cpp_decode'] >= 1.2)} |",
                None,
            )
        )
        rows.append(
            (
                "| 8 streams over 4 adapters, aggregate (tokens/s of the decode phase; the ratio of "
                f"whole requests, prefill included) | {d['lathe_8_streams_4_adapters']:.0f} tokens/s; "
                f"{x['lathe_batched_over_single']:.2f}x one stream | | | "
                f"4x{met(x['lathe_batched_over_single'] >= 4)} |",
                None,
            )
        )
    b = r.get("decode_bf16")
    if b:
        rows.append(
            (
                "| single-stream decode, "
                + ("`--precision bf16` (the trainer's bf16 products, on its kernel)" if kernel else f"{bf16}")
                + f" | {b['single_stream_tokens_per_s']:.0f} tokens/s | llama.cpp: "
                f"{d['llama_cpp_single_stream']:.0f} | {x['lathe_bf16_over_llama_cpp_decode']:.2f}x | "
                f"1.2x{met(x['lathe_bf16_over_llama_cpp_decode'] >= 1.2)} |",
                None,
            )
        )
        rows.append(
            (
                f"| 8 streams over 4 adapters, aggregate, {'`--precision bf16` (as above)' if kernel else bf16} | "
                f"{b['streams_8_adapters_4_tokens_per_s']:.0f} tokens/s; "
                f"{b['batched_over_single']:.2f}x one stream | | | 4x{met(b['batched_over_single'] >= 4)} |",
                None,
            )
        )
        rows.append(
            (
                f"| {'bf16' if kernel else 'f32 (`--precision bf16`)'} sampler against the trainer: mean importance ratio, largest "
                f"logprob difference | {b['trainer_ratio_mean']:.5f}, "
                f"{b['trainer_max_abs_logprob_diff']:.3f} nats | | | 1 ± 0.01"
                f"{met(abs(b['trainer_ratio_mean'] - 1) <= 0.01)} |",
                None,
            )
        )
    for line, _ in rows:
        print(line)
    if not r.get("quiet", False):
        print(f"\n{r.get('warning', 'not measured on a quiet machine')}")


def met(ok: bool) -> str:
    return "" if ok else ", not met"


if __name__ == "__main__":
    main()
