"""PyTorch + PEFT on the shapes of `lathe bench train`: the same model (a GGUF file,
dequantized to f32 by transformers, or a Hugging Face directory, loaded in f32), LoRA of
rank R on the seven projections of every block, a summed cross-entropy over BATCH x SEQ
random tokens, backward, AdamW step, on the CPU or a GPU. Prints one JSON object with
the median tokens/s, like `lathe bench train`.

    python scripts/peers/torch_train.py --model models/X.gguf [--bf16] [--iters 5]
    python scripts/peers/torch_train.py --model DIR --device cuda [--bf16]
"""

import argparse
import json
import os
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a .gguf file or a Hugging Face directory")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (f32 master weights)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    device = torch.device(a.device)
    if os.path.isdir(a.model):
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    else:
        directory, name = os.path.split(os.path.abspath(a.model))
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model = model.to(device)
    lora = LoraConfig(
        r=a.rank,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(model, lora)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    vocab = model.config.vocab_size
    ids = torch.randint(100, vocab, (a.batch, a.seq_len + 1)).to(device)
    inputs, targets = ids[:, :-1], ids[:, 1:].reshape(-1)
    tokens = a.batch * a.seq_len
    rates = []

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(a.iters + 1):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16):
            logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, vocab), targets, reduction="sum"
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        if i > 0:
            rates.append(tokens / dt)
    print(
        json.dumps(
            {
                "bench": "torch_train",
                "torch": torch.__version__,
                "precision": "bf16_autocast" if a.bf16 else "f32",
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "threads": torch.get_num_threads(),
                "batch": a.batch,
                "seq_len": a.seq_len,
                "rank": a.rank,
                "trainable_params": sum(q.numel() for q in params),
                "tokens_per_s_median": round(statistics.median(rates), 2),
                "tokens_per_s_min": round(min(rates), 2),
                "tokens_per_s_max": round(max(rates), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
