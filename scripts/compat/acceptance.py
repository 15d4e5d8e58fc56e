"""Acceptance test: drive a running `lathe serve` with the official SDK, unmodified.

Exercises every flow of tinker-wire.md section 9 and fails (non-zero exit) on any
exception or wrong shape. Run through scripts/compat/run-acceptance, which starts the
server; by hand:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python acceptance.py tinker
    MINT_BASE_URL=http://127.0.0.1:8000 MINT_API_KEY=sk-... python acceptance.py mint
"""

import json
import math
import os
import sys
import time
import urllib.error
import urllib.request

SDK = sys.argv[1] if len(sys.argv) > 1 else "tinker"
if SDK == "mint":
    import mint as sdk  # patches tinker so sk- keys work, maps MINT_* to TINKER_*
    from mint import types

    KEY = os.environ["MINT_API_KEY"]
    BASE_URL = os.environ["MINT_BASE_URL"]
else:
    import tinker as sdk
    from tinker import types

    KEY = os.environ["TINKER_API_KEY"]
    BASE_URL = os.environ["TINKER_BASE_URL"]


import tinker as _tinker

TINKER_VERSION = tuple(int(x) for x in _tinker.__version__.split(".")[:2])


def ready(client):
    """0.38 returns futures of clients (usable as clients, with a deprecation warning);
    0.22 returns the clients themselves."""
    return client.result() if type(client).__name__.startswith("Backcompat") else client


def step(msg):
    print(f"[{SDK}] {msg}", flush=True)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def tokenizer():
    """The server's tokenizer, through the Lathe extension (no model hub needed)."""
    from tokenizers import Tokenizer

    req = urllib.request.Request(
        f"{BASE_URL}/api/v1/lathe/tokenizer", headers={"X-API-Key": KEY}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = json.load(resp)
    check(body["chat_template"], "tokenizer extension returns the chat template")
    return Tokenizer.from_str(json.dumps(body["tokenizer"]))


def datum(tok, prompt, answer):
    p = tok.encode(prompt, add_special_tokens=False).ids
    a = tok.encode(answer, add_special_tokens=False).ids
    ids = p + a
    weights = [0.0] * (len(p) - 1) + [1.0] * len(a)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
    ), len(ids) - 1


def logprobs_of(out, i=0):
    return out.loss_fn_outputs[i]["logprobs"].tolist()


def main():
    t0 = time.time()
    tok = tokenizer()
    if TINKER_VERSION >= (0, 38):
        # Leaving the block finishes the session (POST /sessions/{id}/finish).
        with sdk.ServiceClient() as service:
            session_id = service.holder.get_session_id()
            flows(tok, service)
        status, body = post_raw("/api/v1/session_heartbeat", {"session_id": session_id})
        check(status == 410, f"a finished session's heartbeat answers 410, got {status} {body}")
        step("leaving `with ServiceClient()` finished the session")
    else:
        flows(tok, sdk.ServiceClient())
    step(f"all flows passed in {time.time() - t0:.1f} s")


def post_raw(path, body):
    """A direct POST: (status, JSON body)."""
    req = urllib.request.Request(
        f"{BASE_URL}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"X-API-Key": KEY, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def flows(tok, service):

    caps = service.get_server_capabilities()
    base = caps.supported_models[0].model_name
    step(f"capabilities: {base}")

    tc = ready(service.create_lora_training_client(base_model=base, rank=8, seed=3))
    info = tc.get_info()
    check(info.model_data.model_name == base and info.lora_rank == 8, f"get_info: {info}")
    step(f"training client {info.model_id}")

    d, n = datum(tok, "Question: what is 2 + 3? Answer:", " 5")
    fb = tc.forward_backward([d], "cross_entropy").result()
    lp = logprobs_of(fb)
    check(len(lp) == n, f"one logprob per target token ({len(lp)} != {n})")
    check(all(math.isfinite(x) and x <= 0 for x in lp), "logprobs are finite and <= 0")
    check(all(k.count(":") == 1 for k in fb.metrics), f"metric keys name:reduction: {fb.metrics}")
    first_loss = fb.metrics["loss:sum"]
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    check(opt.metrics is None or all(k.count(":") == 1 for k in opt.metrics), "optim metrics")
    step(f"forward_backward loss {first_loss:.4f}, optim_step {opt.metrics}")

    # Pipelined: submit forward_backward and optim_step before awaiting either.
    for _ in range(2):
        f1 = tc.forward_backward([d], "cross_entropy")
        f2 = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        f1.result()
        f2.result()
    fwd = tc.forward([d], "cross_entropy").result()
    check(fwd.metrics["loss:sum"] < first_loss, f"loss fell: {first_loss} -> {fwd.metrics['loss:sum']}")
    step(f"after 3 steps forward loss {fwd.metrics['loss:sum']:.4f}")

    if TINKER_VERSION >= (0, 38):
        # GSPO: the sequence ratio over the answer; equal logprobs give ratio 1.
        fwd_lp = logprobs_of(fwd)
        n_prompt = n - len(tok.encode(" 5", add_special_tokens=False).ids)
        g = types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "logprobs": fwd_lp,
                "advantages": [0.0] * n_prompt + [1.0] * (n - n_prompt),
                "sequence_ratio_mask": [0.0] * n_prompt + [1.0] * (n - n_prompt),
            },
        )
        gs = tc.forward([g], "gspo").result()  # no gradient: later checks compare weights
        want = -(n - n_prompt)
        check(abs(gs.metrics["loss:sum"] - want) < 1e-3, f"gspo loss {gs.metrics} != {want}")
        step(f"gspo loss {gs.metrics['loss:sum']:.4f}")

    sampler = ready(tc.save_weights_and_get_sampling_client())
    prompt = types.ModelInput.from_ints(tok.encode("Question: what is 2 + 3? Answer:").ids)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    res = sampler.sample(prompt=prompt, num_samples=2, sampling_params=params).result()
    check(len(res.sequences) == 2, "two samples")
    for s in res.sequences:
        check(s.stop_reason in ("length", "stop"), f"stop reason {s.stop_reason}")
        check(len(s.tokens) == len(s.logprobs) and 0 < len(s.tokens) <= 8, "tokens and logprobs")
    stop = sampler.sample(
        prompt=prompt, num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=3, temperature=0.0, stop=["\n"]),
    ).result()
    check(len(stop.sequences[0].tokens) <= 3, "max_tokens respected")
    step(f"sampled {[tok.decode(s.tokens) for s in res.sequences]}")
    if TINKER_VERSION >= (0, 38):
        # The server advertises retrieve_futures: samples were awaited through one
        # session poller, not a retrieve_future long-poll each.
        check(getattr(sampler, "_futures_poller", None) is not None,
              "0.38 sampled through the retrieve_futures poller")
        step("samples awaited through retrieve_futures")
        # A copied client (as sent to a worker process) joins the session for its own
        # request numbers, and samples alongside the original.
        import pickle

        copy = pickle.loads(pickle.dumps(sampler))
        out = copy.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
        check(len(out.sequences) == 1, "the copied sampling client samples")
        check(copy._cloned_sampler_id not in (None, 0), f"joined: {copy._cloned_sampler_id}")
        step(f"a pickled sampling client joined as copy {copy._cloned_sampler_id}")

    plp = sampler.compute_logprobs(prompt).result()
    check(len(plp) == len(prompt.to_ints()) and plp[0] is None, "prompt logprobs shape")
    check(all(x is not None and x <= 0 for x in plp[1:]), "prompt logprobs values")
    topk = sampler.sample(
        prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True, topk_prompt_logprobs=3,
    ).result()
    alts = topk.topk_prompt_logprobs
    check(alts is not None and len(alts) == len(prompt.to_ints()) and alts[0] is None,
          "topk prompt logprobs shape")
    for i, row in enumerate(alts[1:], start=1):
        check(len(row) == 3 and all(a[1] >= b[1] for a, b in zip(row, row[1:])),
              f"topk row {i} sorted")
        check(row[0][1] >= topk.prompt_logprobs[i] - 1e-5, f"topk row {i} holds the best token")

    state_path = tc.save_state("accept-state").result().path
    check(state_path.startswith("tinker://") and "/weights/accept-state" in state_path, state_path)
    sampler_path = tc.save_weights_for_sampler("accept-sampler").result().path
    check("/sampler_weights/accept-sampler" in sampler_path, sampler_path)
    step(f"saved {state_path} and {sampler_path}")

    if SDK == "mint":
        # MinT's extension: the weighted sum of two checkpoints' LoRA deltas.
        mixed = sdk.mint.interpolate_checkpoints(
            service, source_paths=[sampler_path, state_path], coefficients=[0.5, 0.5],
        )
        check("/sampler_weights/mintx-" in mixed.path and mixed.coefficients == [0.5, 0.5],
              f"interpolate: {mixed}")
        mixed_sampler = ready(service.create_sampling_client(model_path=mixed.path))
        out = mixed_sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
        check(len(out.sequences[0].tokens) > 0, "the interpolated checkpoint samples")
        step(f"mintx.interpolate_checkpoints -> {mixed.path}")

        # MinT's reverse-KL distillation towards a reference checkpoint: no seq_id, so
        # the training client's own numbering goes on undisturbed.
        ids = prompt.to_ints()
        kl_datum = sdk.mint.ReverseKLDatum(
            student_input=types.ModelInput.from_ints(ids[:-2]),
            reference_input=types.ModelInput.from_ints(ids[1:-2]),
            target_tokens={"data": ids[-2:], "dtype": "int64"},
            weights={"data": [1.0, 1.0], "dtype": "float32"},
        )
        student = ready(service.create_lora_training_client(base_model=base, rank=8, seed=4))
        kl = sdk.mint.forward_backward_reverse_kl(
            student, reference_model_path=mixed.path, data=[kl_datum], temperature=1.0,
        )
        check(len(kl.outputs) == 1 and kl.metrics["num_tokens:sum"] == 2.0, f"reverse kl: {kl}")
        check(kl.outputs[0].loss.data[0] > 0, f"reverse kl loss: {kl.outputs[0].loss}")
        student.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        step(f"mintx.forward_backward_reverse_kl loss {kl.metrics['loss:mean']:.4f}, then optim_step")

    # load_state into a fresh client: same weights, so the same forward logprobs.
    tc2 = ready(service.create_lora_training_client(base_model=base, rank=8))
    tc2.load_state(state_path).result()
    lp2 = logprobs_of(tc2.forward([d], "cross_entropy").result())
    check(max(abs(a - b) for a, b in zip(lp2, logprobs_of(fwd))) < 1e-5, "load_state restores weights")

    # Resume with optimizer state: the next step matches the original client's.
    tc3 = ready(service.create_training_client_from_state_with_optimizer(state_path))
    tc_plain = ready(service.create_training_client_from_state(state_path))
    check(tc_plain.get_info().lora_rank == 8, "create_training_client_from_state")
    for client in (tc, tc3):
        client.forward_backward([d], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    a = tc.forward([d], "cross_entropy").result().metrics["loss:sum"]
    b = tc3.forward([d], "cross_entropy").result().metrics["loss:sum"]
    check(abs(a - b) < 1e-6, f"resumed training matches: {a} vs {b}")
    step(f"resumed with optimizer: next loss {a:.6f} == {b:.6f}")

    s2 = ready(service.create_sampling_client(model_path=sampler_path))
    r2 = s2.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
    check(len(r2.sequences) == 1, "sampling from a sampler_weights path")
    s3 = ready(service.create_sampling_client(base_model=base))
    check(len(s3.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences) == 1, "base sampler")

    # 0.38 deprecates create_rest_client for a RestClient of its own.
    rest = sdk.RestClient() if TINKER_VERSION >= (0, 38) else service.create_rest_client()
    runs = rest.list_training_runs().result()
    run_ids = [r.training_run_id for r in runs.training_runs]
    check(info.model_id in run_ids, f"list_training_runs lists {info.model_id}")
    ckpts = rest.list_checkpoints(info.model_id).result()
    kinds = {c.checkpoint_type for c in ckpts.checkpoints}
    check(kinds == {"training", "sampler"}, f"both checkpoint kinds listed: {kinds}")
    user = rest.list_user_checkpoints().result()
    check(len(user.checkpoints) >= 2, "list_user_checkpoints")
    run = rest.get_training_run(info.model_id).result()
    check(run.last_checkpoint is not None, "get_training_run has last_checkpoint")
    step(f"REST: {len(run_ids)} runs, checkpoints {sorted(c.checkpoint_id for c in ckpts.checkpoints)}")


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # any exception fails the test, with its message
        print(f"[{SDK}] FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    os._exit(0)  # the SDK's background heartbeat threads would otherwise keep us alive
