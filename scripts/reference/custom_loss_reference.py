"""Reference values for server-side custom losses, from PyTorch autograd.

Traces a set of per-datum losses with the tinker SDK's own tracer (the graphs are
exactly what `ServiceClient.create_custom_loss` uploads), runs each traced graph in
float64 on fixed inputs, and writes the loss, the metrics and d(loss)/d(logprobs) to
server/tests/data/custom_loss_reference.json, which the test
`custom_losses_match_pytorch` replays through the server's interpreter. Between them the
losses call every function the server's allow-list has.

Needs torch and tinker==0.38.0, e.g. the cookbook venv:
    $(scripts/compat/setup-cookbook-venv) scripts/reference/custom_loss_reference.py
"""
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss


def ppo(logprobs, advantages, sampler_logprobs):
    ratio = torch.exp(logprobs - sampler_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    n = logprobs.shape[0]
    active = (advantages != 0).float().sum() / n
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/active:sum": active}


def distill(logprobs, target):
    lse = torch.logsumexp(logprobs, dim=-1, keepdim=True)
    p = F.softmax(logprobs, -1)
    first = logprobs[:, 0] + logprobs[1:, :].sum() * 0.5
    deep = logprobs[..., None].squeeze(-1).mean(dim=(0, 1))
    kl = (target * (torch.log(target) - (logprobs - lse))).sum()
    picked = torch.where(target > 0.3, logprobs, torch.zeros_like(logprobs))
    loss = kl + first.sum() + deep + math.sqrt(2.0) * p.max() + picked.sum().detach() ** 2
    return loss + logprobs.pow(2).sum(), {"custom/kl:sum": kl}


def unary_zoo(logprobs):
    x = -logprobs  # positive
    smooth = (
        torch.exp(logprobs).sum()
        + torch.log(x).sum()
        + torch.log1p(x).sum()
        + torch.expm1(logprobs).sum()
        + torch.abs(logprobs).sum()
        + torch.sqrt(x).sum()
        + torch.rsqrt(x + 1).sum()
        + torch.sigmoid(logprobs).sum()
        + F.logsigmoid(logprobs).sum()
        + torch.tanh(logprobs).sum()
        + F.relu(logprobs + 1.0).sum()
        + torch.square(logprobs).sum()
        + torch.reciprocal(x).sum()
        + (+logprobs).sum()
        + logprobs.neg().sum()
    )
    steps = (torch.sign(logprobs) + torch.floor(logprobs) + torch.ceil(logprobs) + torch.round(logprobs * 3)).sum()
    return smooth + steps, {"custom/steps:sum": steps}


def binary_zoo(logprobs, weights):
    a = torch.add(logprobs, weights, alpha=2.0) + torch.sub(logprobs, weights, alpha=0.5)
    b = logprobs * weights - logprobs / (weights + 2.0) + (logprobs.detach() // 0.5) * 0.25
    c = (1.0 - logprobs) ** weights + 2.0 ** logprobs + logprobs**3
    ties = torch.maximum(logprobs, logprobs.detach()) + torch.minimum(logprobs, weights)
    flags = (logprobs > -1.0) & (weights < 0.5) | ~(logprobs <= -2.0)
    ordered = (logprobs >= weights).float() + (logprobs == weights).float() + (logprobs != weights).float()
    loss = (a + b + c + ties).sum() + (flags.float() * logprobs).sum() + ordered.sum()
    return loss, {"custom/flags:mean": flags.float().mean()}


def bounds(logprobs, low, mask):
    keep = mask.bool()
    x = torch.clamp(logprobs, min=low, max=-0.5) + torch.clip(logprobs, -2.0, -1.0)
    y = logprobs.clamp_min(-1.5) + logprobs.clamp_max(-1.5)
    z = logprobs.masked_fill(~keep, 0.0) + torch.where(keep, logprobs, low)
    return (x + y + z).sum(), {"custom/kept:sum": keep.float().sum()}


def reductions(logprobs, other):
    s = logprobs.sum(dim=1, keepdim=True).sum() + logprobs.mean(dim=-1).sum() + torch.sum(logprobs, 0).mean()
    m = logprobs.amax(dim=0).sum() + logprobs.amin(dim=1).sum() + logprobs.max() + logprobs.min()
    pair = torch.max(logprobs, other).sum() + torch.min(logprobs, other).sum()
    lse = torch.logsumexp(logprobs, dim=(0, 1))
    soft = (F.softmax(logprobs, dim=0) * other).sum() + (torch.log_softmax(logprobs, dim=-1) * other).sum()
    cum = (logprobs.cumsum(dim=0) * other).sum() + (torch.cumsum(logprobs, -1) ** 2).sum()
    return s + m + pair + lse + soft + cum, {"custom/lse:mean": lse}


def shapes(logprobs, scale):
    n = logprobs.shape[0]
    flat = logprobs.reshape(-1)
    grid = flat.view(n, -1)
    more = logprobs.flatten().unsqueeze(0).squeeze(0).contiguous().clone()
    sizes = logprobs.size(0) * logprobs.size()[1] + logprobs.numel() + logprobs.dim()
    c = torch.ones_like(logprobs[0]) + torch.full_like(logprobs[0], 0.5) + torch.zeros_like(logprobs[0], dtype=torch.float64)
    typed = logprobs.to(torch.float64).type_as(logprobs).float() + logprobs.long().float() * 0.0
    stepped = logprobs[::2, 1:].sum() + logprobs[-1, ...].sum() + logprobs[:, None, 0].sum()
    loss = scale * (grid.sum() + more.sum() + (grid * c).sum() + typed.sum() + stepped) + sizes
    return loss, {"custom/sizes:sum": sizes * scale}


def sequence(logprobs, sampler_logprobs, advantages, mask):
    m = mask.float()
    log_ratio = ((logprobs - sampler_logprobs) * m).sum() / m.sum().clamp_min(1.0)
    ratio = torch.exp(log_ratio - log_ratio.detach()) * torch.exp(log_ratio.detach())
    discounted = advantages.cumsum(0)
    loss = -(ratio * (discounted * m)).sum()
    return loss, {"custom/ratio:mean": ratio}


CASES = [
    (ppo, {"logprobs": 1, "advantages": 1, "sampler_logprobs": 1}, {"advantages": ("f", [5]), "sampler_logprobs": ("lp", [5])}),
    (distill, {"logprobs": 2, "target": 2}, {"target": ("p", [4, 3])}),
    (unary_zoo, {"logprobs": 1}, {}),
    (binary_zoo, {"logprobs": 1, "weights": 1}, {"weights": ("ties", [6])}),
    (bounds, {"logprobs": 1, "low": 0, "mask": 1}, {"low": ("c", -1.8), "mask": ("mask", [6])}),
    (reductions, {"logprobs": 2, "other": 2}, {"other": ("f", [3, 4])}),
    (shapes, {"logprobs": 2, "scale": 0}, {"scale": ("c", 0.75)}),
    (sequence, {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1, "mask": 1},
     {"sampler_logprobs": ("lp", [5]), "advantages": ("f", [5]), "mask": ("mask", [5])}),
]


def value(kind, spec, gen):
    if kind == "c":
        return torch.tensor(spec, dtype=torch.float64)
    shape = spec
    if kind == "f":
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    if kind == "lp":
        return -torch.rand(*shape, generator=gen, dtype=torch.float64) * 3 - 0.05
    if kind == "p":
        return torch.softmax(torch.randn(*shape, generator=gen, dtype=torch.float64), -1)
    if kind == "mask":
        return (torch.arange(math.prod(shape)).reshape(shape) % 3 != 1).to(torch.int64)
    raise ValueError(kind)


def main():
    gen = torch.Generator().manual_seed(0)
    out = []
    for fn, ranks, specs in CASES:
        handle = trace_loss(fn, ranks, "session")
        rank = ranks["logprobs"]
        lp_shape = [6] if rank == 1 else ([4, 3] if fn is distill else [3, 4])
        if fn is ppo or fn is sequence:
            lp_shape = [5]
        logprobs = -torch.rand(*lp_shape, generator=gen, dtype=torch.float64) * 3 - 0.05
        if fn is binary_zoo:
            # Ties between logprobs and weights exercise minimum's split gradient.
            weights = logprobs.detach().clone()
            weights[::2] = torch.randn(3, generator=gen, dtype=torch.float64)
        inputs = []
        for x in handle.inputs[1:]:
            if fn is binary_zoo and x.name == "weights":
                inputs.append(weights)
            else:
                inputs.append(value(specs[x.name][0], specs[x.name][1], gen))
        lp = logprobs.clone().requires_grad_(True)
        loss, metrics = handle.graph(lp, *inputs)
        loss.backward()
        out.append(
            {
                "name": handle.name,
                "inputs": [x.model_dump() for x in handle.inputs],
                "graph": encode_graph(handle).model_dump(),
                "logprobs": {"shape": list(logprobs.shape), "data": logprobs.flatten().tolist()},
                "values": [
                    {
                        "shape": list(t.shape),
                        "data": t.flatten().double().tolist(),
                        "int": not t.is_floating_point(),
                    }
                    for t in inputs
                ],
                "loss": loss.item(),
                "grad": lp.grad.flatten().tolist(),
                "metrics": {k: float(v.detach()) for k, v in metrics.items()},
            }
        )
    path = Path(__file__).resolve().parents[2] / "server/tests/data/custom_loss_reference.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {len(out)} cases to {path}")


if __name__ == "__main__":
    main()
