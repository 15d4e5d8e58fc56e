"""A Hugging Face directory with a GGUF model's architecture and tokenizer but random
weights: for speed measurements on a machine the real weights cannot reach (a GPU
machine with no network and a size limit on what travels). Throughput depends on the
shapes alone, and Lathe and PyTorch + PEFT then load the same directory.

    python scripts/peers/random_model.py shape --gguf models/X.gguf --out DIR
        config.json, tokenizer.json and tokenizer_config.json from the GGUF's metadata
        (needs the `gguf` and `tokenizers` packages; a Llama-architecture GGUF with a
        byte-level BPE tokenizer, as the default model is)
    python scripts/peers/random_model.py weights --dir DIR [--seed 0]
        model.safetensors: f32 weights drawn as transformers initialises a Llama
        (N(0, 0.02) matrices, unit norms; needs numpy and safetensors)
"""

import argparse
import json
import os


def shape(gguf_path: str, out: str) -> None:
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    reader = GGUFReader(gguf_path)

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise SystemExit(f"error: {gguf_path}: architecture {arch!r}; only 'llama' is handled")
    if field("tokenizer.ggml.model") != "gpt2":
        raise SystemExit(f"error: {gguf_path}: tokenizer is not byte-level BPE ('gpt2')")
    tokens = field("tokenizer.ggml.tokens")
    merges = field("tokenizer.ggml.merges")
    names = {t.name for t in reader.tensors}
    bos, eos = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
    heads = field("llama.attention.head_count")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokens),
        "hidden_size": field("llama.embedding_length"),
        "intermediate_size": field("llama.feed_forward_length"),
        "num_hidden_layers": field("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field("llama.attention.head_count_kv", heads),
        "max_position_embeddings": field("llama.context_length"),
        "rms_norm_eps": field("llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": field("llama.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = field("tokenizer.ggml.token_type")
    # GGUF token type 3 is a control token: special, never split by the BPE.
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if ty == 3])
    tok.save(os.path.join(out, "tokenizer.json"))
    tokenizer_config = {"bos_token": tokens[bos], "eos_token": tokens[eos]}
    template = field("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    print(json.dumps({"dir": out, "config": config}))


def weights(directory: str, seed: int) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    with open(os.path.join(directory, "config.json")) as f:
        c = json.load(f)
    rng = np.random.default_rng(seed)
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = hidden // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim

    def normal(rows, cols):
        # transformers' initialisation of Llama: N(0, initializer_range = 0.02).
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(c["vocab_size"], hidden)}
    tensors["model.norm.weight"] = np.ones(hidden, np.float32)
    if not c.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = normal(c["vocab_size"], hidden)
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for name, rows, cols in [
            ("self_attn.q_proj", hidden, hidden),
            ("self_attn.k_proj", kv, hidden),
            ("self_attn.v_proj", kv, hidden),
            ("self_attn.o_proj", hidden, hidden),
            ("mlp.gate_proj", inter, hidden),
            ("mlp.up_proj", inter, hidden),
            ("mlp.down_proj", hidden, inter),
        ]:
            tensors[pre + name + ".weight"] = normal(rows, cols)
        tensors[pre + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        tensors[pre + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    params = sum(t.size for t in tensors.values())
    print(json.dumps({"dir": directory, "parameters": params, "seed": seed}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("shape", help="config and tokenizer from a GGUF's metadata")
    s.add_argument("--gguf", required=True)
    s.add_argument("--out", required=True)
    w = sub.add_parser("weights", help="random weights for a directory's config")
    w.add_argument("--dir", required=True)
    w.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.cmd == "shape":
        shape(a.gguf, a.out)
    else:
        weights(a.dir, a.seed)


if __name__ == "__main__":
    main()
