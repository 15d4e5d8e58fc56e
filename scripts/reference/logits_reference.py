"""Reference logits of the default model from PyTorch + transformers.

Produces server/tests/data/smollm2_logits_reference.json, which the real-model test
`logits_match_transformers` compares Lathe's forward pass against. transformers
dequantises the Q4_1 GGUF to float32 exactly as Lathe does, so the two forward passes
should agree to float rounding.

Run (needs torch, transformers, gguf; see scripts/reference/README.md):
    python scripts/reference/logits_reference.py models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

STRIDE = 97  # keep every 97th vocabulary entry per position (plus each row's top 5)


def main():
    gguf = Path(sys.argv[1])
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
    )
    model.eval()
    # The chat prompt, rendered with the model's template and tokenised by Lathe's
    # tokenizer (transformers' GGUF tokenizer ignores the "smollm" pre-tokenizer; this
    # text has no whitespace-before-digit run, where the two differ).
    prompt = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3? Answer with only the number.<|im_end|>\n<|im_start|>assistant\n"
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    vocab = logits.shape[1]
    cols = list(range(0, vocab, STRIDE))
    top = torch.topk(logits, 5, dim=-1)
    out = {
        "prompt": prompt,
        "input_ids": ids,
        "stride": STRIDE,
        "strided_logits": [[round(float(x), 6) for x in row[cols]] for row in logits],
        "top5_ids": top.indices.tolist(),
        "top5_logits": [[round(float(x), 6) for x in r] for r in top.values],
        "torch": torch.__version__,
    }
    dest = Path(__file__).resolve().parents[2] / "server/tests/data/smollm2_logits_reference.json"
    dest.write_text(json.dumps(out))
    print(f"wrote {dest}: {len(ids)} positions, max |logit| {logits.abs().max():.3f}")


if __name__ == "__main__":
    main()
