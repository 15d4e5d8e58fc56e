"""Reference AdamW steps from torch.optim.AdamW with clip_grad_norm_.

Produces server/tests/data/adamw_reference.json, which the test `adamw_matches_pytorch`
replays: two parameter tensors, two steps with weight decay, global-norm clipping active
on the first step and inactive on the second.

Run: python scripts/reference/adamw_reference.py
"""
import json
from pathlib import Path

import torch

torch.manual_seed(0)
a = torch.randn(3, 5, dtype=torch.float32)
b = torch.randn(4, 3, dtype=torch.float32) * 0.1
grads = [
    [torch.randn(3, 5) * 3.0, torch.randn(4, 3) * 2.0],  # large: clipped
    [torch.randn(3, 5) * 0.01, torch.randn(4, 3) * 0.02],  # small: not clipped
]
hp = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0)

pa, pb = a.clone().requires_grad_(), b.clone().requires_grad_()
opt = torch.optim.AdamW(
    [pa, pb], lr=hp["learning_rate"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
    weight_decay=hp["weight_decay"],
)
steps = []
for ga, gb in grads:
    pa.grad, pb.grad = ga.clone(), gb.clone()
    norm = torch.nn.utils.clip_grad_norm_([pa, pb], hp["grad_clip_norm"])
    opt.step()
    steps.append({
        "grad_a": ga.flatten().tolist(), "grad_b": gb.flatten().tolist(),
        "pre_clip_norm": float(norm),
        "a": pa.detach().flatten().tolist(), "b": pb.detach().flatten().tolist(),
        "exp_avg_a": opt.state[pa]["exp_avg"].flatten().tolist(),
        "exp_avg_sq_b": opt.state[pb]["exp_avg_sq"].flatten().tolist(),
    })
out = {"hyper": hp, "a0": a.flatten().tolist(), "b0": b.flatten().tolist(),
       "shape_a": list(a.shape), "shape_b": list(b.shape), "steps": steps, "torch": torch.__version__}
dest = Path(__file__).resolve().parents[2] / "server/tests/data/adamw_reference.json"
dest.write_text(json.dumps(out))
print(f"wrote {dest}")
