"""The OpenAI-compatible endpoints, driven by the official `openai` package, against the
Tinker protocol on the same server as the reference: train an adapter with `tinker`,
then evaluate it with `openai` and check that both give the same greedy text and
log-probabilities. Fails (non-zero exit) on any difference or exception.

Run through scripts/compat/run-acceptance, which starts the server; by hand:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python openai_check.py
"""

import json
import math
import os
import time
import urllib.request

import openai
import tinker
from tinker import types
from tokenizers import Tokenizer

KEY = os.environ["TINKER_API_KEY"]
BASE_URL = os.environ["TINKER_BASE_URL"]


def step(msg):
    print(f"[openai {openai.__version__}] {msg}", flush=True)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def server_tokenizer():
    req = urllib.request.Request(f"{BASE_URL}/api/v1/lathe/tokenizer", headers={"X-API-Key": KEY})
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = json.load(resp)
    tok = Tokenizer.from_str(json.dumps(body["tokenizer"]))
    return tok, tok.token_to_id(body["eos_token"])


def greedy_text(tok, eos, sampler, ids, max_tokens):
    """The Tinker sampler's greedy answer: text (EOS left out) and its logprobs."""
    res = sampler.sample(
        prompt=types.ModelInput.from_ints(ids), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    ).result()
    seq = res.sequences[0]
    kept = [(t, lp) for t, lp in zip(seq.tokens, seq.logprobs) if t != eos]
    return tok.decode([t for t, _ in kept], skip_special_tokens=False), [lp for _, lp in kept]


def close(a, b, tol=1e-5):
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def main():
    t0 = time.time()
    tok, eos = server_tokenizer()
    with tinker.ServiceClient() as service:
        base = service.get_server_capabilities().supported_models[0].model_name
        tc = service.create_lora_training_client(base_model=base, rank=8, seed=5).result()
        ids = tok.encode("Question: what is 2 + 3? Answer: 5", add_special_tokens=False).ids
        d = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
        for _ in range(2):
            tc.forward_backward([d], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        adapter = tc.save_weights_for_sampler("openai-eval").result().path
        tuned = service.create_sampling_client(model_path=adapter).result()
        plain = service.create_sampling_client(base_model=base).result()
        step(f"trained {adapter}")

        client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key=KEY, max_retries=0)
        models = [m.id for m in client.models.list()]
        check(models[0] == base and adapter in models, f"models.list: {models}")

        prompt = "Question: what is 2 + 3? Answer:"
        pids = tok.encode(prompt, add_special_tokens=False).ids
        for model, sampler in ((base, plain), (adapter, tuned)):
            want, want_lp = greedy_text(tok, eos, sampler, pids, 12)
            got = client.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
            )
            c = got.choices[0]
            check(c.text == want, f"{model}: completion {c.text!r} != tinker {want!r}")
            check(close(c.logprobs.token_logprobs, want_lp), f"{model}: logprobs differ")
            check(got.usage.prompt_tokens == len(pids), f"usage {got.usage}")
            streamed = "".join(
                ch.choices[0].text
                for ch in client.completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                )
                if ch.choices
            )
            check(streamed == want, f"{model}: streamed {streamed!r} != {want!r}")
        step(f"completions equal tinker's greedy samples, whole and streamed: {want!r}")

        # Chat: the server's template, then the same greedy answer as tinker's sampler.
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        rendered = tok.encode(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
            "<|im_start|>assistant\n",
            add_special_tokens=False,
        ).ids
        want, want_lp = greedy_text(tok, eos, tuned, rendered, 24)
        chat = client.chat.completions.create(
            model=adapter, messages=messages, max_tokens=24, temperature=0, logprobs=True,
        )
        msg = chat.choices[0].message
        check(msg.role == "assistant" and msg.content == want, f"chat {msg.content!r} != {want!r}")
        check(close([t.logprob for t in chat.choices[0].logprobs.content], want_lp), "chat logprobs")
        pieces = [
            ch.choices[0].delta.content or ""
            for ch in client.chat.completions.create(
                model=adapter, messages=messages, max_tokens=24, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
            if ch.choices
        ]
        check("".join(pieces) == want, f"streamed chat {''.join(pieces)!r} != {want!r}")
        step(f"chat equals tinker's greedy sample, whole and streamed: {want!r}")

        # lm-evaluation-harness's loglikelihood request: the prompt scored.
        scored = client.completions.create(
            model=adapter, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0,
        ).choices[0]
        ref = tuned.compute_logprobs(types.ModelInput.from_ints(pids)).result()
        check(scored.text == prompt, f"echo text {scored.text!r}")
        lps = scored.logprobs.token_logprobs
        check(lps[0] is None and close(lps[1:], ref[1:]), "echoed logprobs = compute_logprobs")
        check(all(math.isfinite(x) for x in lps[1:]), "finite")
        step("echo + logprobs scores the prompt as compute_logprobs does")

        try:
            client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
            raise AssertionError("an unknown model must fail")
        except openai.NotFoundError as e:
            check("gpt-4" in str(e), str(e))
        try:
            client.chat.completions.create(
                model=base, messages=messages, max_tokens=1, presence_penalty=1.0,
            )
            raise AssertionError("presence_penalty must be refused")
        except openai.BadRequestError as e:
            check("presence_penalty" in str(e), str(e))
        step("unknown models and unsupported fields are typed errors")
    step(f"all checks passed in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
