"""llama.cpp (llama-cpp-python, built for this CPU) decoding the same GGUF as
`lathe bench sample`: a prompt of PROMPT random tokens, then NEW tokens one at a time,
sampled at temperature 1. Prints one JSON object with the decode-only tokens/s (the
prompt's evaluation is timed apart), median over iterations.

    python scripts/peers/llama_decode.py --model models/X.gguf [--threads 2]
"""

import argparse
import json
import os
import random
import statistics
import time

import llama_cpp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    a = p.parse_args()
    llm = llama_cpp.Llama(
        model_path=a.model,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        n_ctx=a.prompt_len + a.new_tokens + 8,
        seed=0,
        verbose=False,
    )
    rng = random.Random(1)
    vocab = llm.n_vocab()
    decode_rates, prefill_times = [], []
    for i in range(a.iters + 1):
        llm.reset()
        prompt = [rng.randrange(100, vocab) for _ in range(a.prompt_len)]
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for _ in range(a.new_tokens - 1):
            token = llm.sample(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
            llm.eval([token])
        t2 = time.perf_counter()
        if i > 0:
            prefill_times.append(t1 - t0)
            decode_rates.append((a.new_tokens - 1) / (t2 - t1))
    print(
        json.dumps(
            {
                "bench": "llama_cpp_decode",
                "llama_cpp_python": llama_cpp.__version__,
                "threads": a.threads,
                "prompt_len": a.prompt_len,
                "new_tokens": a.new_tokens,
                "decode_tokens_per_s_median": round(statistics.median(decode_rates), 2),
                "decode_tokens_per_s_min": round(min(decode_rates), 2),
                "decode_tokens_per_s_max": round(max(decode_rates), 2),
                "prefill_s_median": round(statistics.median(prefill_times), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
