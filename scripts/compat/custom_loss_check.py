"""Server-side custom losses with the official tinker 0.38.0 SDK and PyTorch.

`ServiceClient.create_custom_loss` traces each loss with torch.fx and, because Lathe's
client config says `custom_loss_server_side`, uploads it; `forward_backward_custom`
then runs it on the server in one request. The same traced loss also runs the SDK's
client-side way (a `LossHandle` without a `loss_id`: a forward pass, torch autograd on
the client, a linearised backward pass), on a second training client with the same
seed. The two must agree on the loss, the metrics and the trained weights.

Run through scripts/compat/run-acceptance (needs torch, so it runs in the cookbook's
venv); by hand:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python custom_loss_check.py
"""

import dataclasses
import math

import tinker
import torch
from tinker import types


def step(msg):
    print(f"[custom losses] {msg}", flush=True)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def close(a, b, tol=2e-4):
    return abs(a - b) <= tol * (1.0 + abs(b))


def ppo(logprobs, advantages, sampler_logprobs):
    ratio = torch.exp(logprobs - sampler_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/tokens:sum": (advantages != 0).float().sum()}


def entropy_bonus(logprobs, weights, coef):
    nll = -(logprobs * weights).sum()
    sharp = torch.logsumexp(logprobs, dim=0) - logprobs.mean()
    return nll + coef * sharp, {"custom/sharp:mean": sharp}


def data(tokens):
    out = []
    for i, seq in enumerate(tokens):
        n = len(seq) - 1
        advantages = [0.0] * (n // 2) + [(-1.0) ** i * (0.5 + 0.25 * j) for j in range(n - n // 2)]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={
                    "target_tokens": seq[1:],
                    "weights": [1.0] * n,
                    "advantages": advantages,
                    "coef": types.TensorData(data=[0.3], dtype="float32", shape=[]),
                },
            )
        )
    return out


def with_sampler_logprobs(training, datums):
    """Adds `sampler_logprobs`: the current policy's, nudged, as a sampler's would be."""
    fwd = training.forward(datums, "cross_entropy").result()
    out = []
    for d, o in zip(datums, fwd.loss_fn_outputs, strict=True):
        lp = [x + 0.05 * math.sin(k) for k, x in enumerate(o["logprobs"].data)]
        inputs = dict(d.loss_fn_inputs)
        inputs["sampler_logprobs"] = types.TensorData(data=lp, dtype="float32", shape=[len(lp)])
        out.append(types.Datum(model_input=d.model_input, loss_fn_inputs=inputs))
    return out


def main():
    service = tinker.ServiceClient()
    base = service.get_server_capabilities().supported_models[0].model_name
    tokens = [[1, 17, 29, 42, 7, 99, 3, 250, 11], [5, 6, 7, 8, 9, 10, 300, 12], [100, 200, 300, 400, 500]]
    datums = data(tokens)
    # A small step: Adam's tiny eps turns float32 noise in near-zero gradient components
    # (torch on the client, f64 on the server) into steps of either sign, which grow from
    # step to step; two small steps keep that well under the tolerance below.
    adam = types.AdamParams(learning_rate=5e-3)
    for fn, ranks in [
        (ppo, {"logprobs": 1, "advantages": 1, "sampler_logprobs": 1}),
        (entropy_bonus, {"logprobs": 1, "weights": 1, "coef": 0}),
    ]:
        handle = service.create_custom_loss(fn, ranks).result()
        check(handle.loss_id is not None, f"{fn.__name__}: the SDK did not upload the loss")
        local = dataclasses.replace(handle, loss_id=None)
        server_side = service.create_lora_training_client(base_model=base, rank=8, seed=11).result()
        client_side = service.create_lora_training_client(base_model=base, rank=8, seed=11).result()
        batch = with_sampler_logprobs(server_side, datums)
        for i in range(2):
            a = server_side.forward_backward_custom(batch, handle).result()
            b = client_side.forward_backward_custom(batch, local).result()
            for key in sorted(b.metrics):
                check(key in a.metrics, f"{fn.__name__}: the server's result lacks {key}")
                check(
                    close(a.metrics[key], b.metrics[key]),
                    f"{fn.__name__} step {i}: {key} is {a.metrics[key]} server-side, "
                    f"{b.metrics[key]} client-side",
                )
            server_side.optim_step(adam).result()
            client_side.optim_step(adam).result()
            step(f"{fn.__name__} step {i}: loss {a.metrics['loss:sum']:.9f} server-side, {b.metrics['loss:sum']:.9f} client-side")
        after = [
            [x for o in t.forward(datums, "cross_entropy").result().loss_fn_outputs for x in o["logprobs"].data]
            for t in (server_side, client_side)
        ]
        worst = max(abs(x - y) for x, y in zip(*after, strict=True))
        check(worst < 2e-3, f"{fn.__name__}: trained weights differ (logprobs by up to {worst})")
        step(f"{fn.__name__}: two steps server-side and client-side give the same model (max |dlp| {worst:.2e})")

    # Refused by the server's own allow-list even though the SDK would trace it: a
    # graph naming a function outside it never runs.
    graph = types.CustomLossGraph(
        nodes=[
            types.CustomLossNode(op="placeholder", name="logprobs", target="logprobs"),
            types.CustomLossNode(op="call_function", name="x", target="torch.load", args=[{"ref": "logprobs"}]),
            types.CustomLossNode(
                op="output", name="output", target="output",
                args=[{"tuple": [{"ref": "x"}, {"dict": {}}]}],
            ),
        ]
    )
    holder = service.holder
    try:
        holder.run_coroutine_threadsafe(
            holder._create_custom_loss("evil", [types.CustomLossInput(name="logprobs", rank=1)], graph)
        ).result()
        raise AssertionError("the server accepted a graph calling torch.load")
    except tinker.BadRequestError as e:
        check("torch.load" in str(e), f"the refusal does not name torch.load: {e}")
    step("a graph calling torch.load is refused with 400")
    print("custom losses: ok")


if __name__ == "__main__":
    main()
