"""tinker-cookbook 0.6.1's `sl_basic` and `rl_basic` recipes, shrunk, against a running
`lathe serve`, with no network beyond it.

Each recipe's own `main` runs on the configuration its blueprint builds, with four
changes: the model is the server's (SmolLM2, which the cookbook's model registry does not
know, so the renderer is named explicitly), the data is local (the cookbook's bundled
`example_data/conversations.jsonl` for `sl_basic`; its arithmetic environment instead of
GSM8K, which would be downloaded, for `rl_basic`), runs are 2 steps of small batches,
and the LoRA rank is 8. The tokenizer comes from the server (`GET /api/v1/lathe/tokenizer`)
through the cookbook's own `tokenizer_utils.register_tokenizer` hook. Fails (non-zero
exit) unless both recipes finish and log finite metrics for every step.

Run through scripts/compat/run-acceptance, which starts the server; by hand:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python cookbook_check.py
"""

import json
import math
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import chz
import tinker_cookbook
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.recipes import rl_basic, sl_basic
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

URL = os.environ["TINKER_BASE_URL"]
KEY = os.environ["TINKER_API_KEY"]
RENDERER = "role_colon"
STEPS = 2


def step(msg):
    print(f"[cookbook {tinker_cookbook.__version__}] {msg}", flush=True)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def get(path):
    req = urllib.request.Request(f"{URL}{path}", headers={"X-API-Key": KEY})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def lathe_tokenizer():
    """The served model's tokenizer as a transformers tokenizer, from the server."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    body = get("/api/v1/lathe/tokenizer")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(body["tokenizer"])),
        bos_token=body.get("bos_token"),
        eos_token=body.get("eos_token"),
    )
    tok.chat_template = body.get("chat_template")
    return tok


def metrics(log_path):
    """The per-step metrics the recipe logged."""
    path = Path(log_path) / "metrics.jsonl"
    check(path.exists(), f"{path} was written")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finite_steps(rows, key_part):
    rows = [r for r in rows if any(key_part in k for k in r)]
    for r in rows:
        for k, v in r.items():
            if key_part in k and isinstance(v, (int, float)):
                check(math.isfinite(v), f"{k} = {v}")
    return rows


def run_sl(model, root):
    log_path = str(root / "sl_basic")
    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model,
        renderer_name=RENDERER,
        max_length=512,
        batch_size=2,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    config = chz.Blueprint(sl_train.Config).apply(
        {
            # sl_basic's blueprint, with the changes the module doc lists.
            "log_path": log_path,
            "model_name": model,
            "recipe_name": "recipe_sl_basic",
            "renderer_name": RENDERER,
            "dataset_builder": FromConversationFileBuilder(
                common_config=common, file_path=str(data)
            ),
            "learning_rate": 2e-4,
            "lr_schedule": "linear",
            "num_epochs": 1,
            "eval_every": 0,
            "save_every": 0,
            "max_steps": STEPS,
            "lora_rank": 8,
            "base_url": URL,
        }
    ).make()
    t0 = time.time()
    sl_basic.main(config)
    rows = finite_steps(metrics(log_path), "loss")
    check(len(rows) >= STEPS, f"sl_basic logged {len(rows)} steps with a loss: {rows}")
    step(f"sl_basic: {len(rows)} steps in {time.time() - t0:.0f} s, last {rows[-1]}")


def run_rl(model, root):
    log_path = str(root / "rl_basic")
    builder = ArithmeticDatasetBuilder(
        batch_size=2,
        model_name_for_tokenizer=model,
        renderer_name=RENDERER,
        n_batches=STEPS,
        group_size=2,
    )
    config = chz.Blueprint(rl_train.Config).apply(
        {
            # rl_basic's blueprint, with the changes the module doc lists.
            "model_name": model,
            "recipe_name": "recipe_rl_basic",
            "renderer_name": RENDERER,
            "log_path": log_path,
            "dataset_builder": builder,
            "learning_rate": 4e-5,
            "max_tokens": 16,
            "eval_every": 0,
            "save_every": 0,
            "max_steps": STEPS,
            "lora_rank": 8,
            "base_url": URL,
        }
    ).make()
    t0 = time.time()
    rl_basic.main(config)
    rows = metrics(log_path)
    check(len(rows) >= STEPS, f"rl_basic logged {len(rows)} steps: {rows}")
    finite_steps(rows, "reward")
    step(f"rl_basic: {len(rows)} steps in {time.time() - t0:.0f} s")


def main():
    model = get("/api/v1/get_server_capabilities")["supported_models"][0]["model_name"]
    tokenizer_utils.register_tokenizer(model, lathe_tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        run_sl(model, Path(tmp))
        run_rl(model, Path(tmp))
    step("sl_basic and rl_basic finished")


if __name__ == "__main__":
    sys.exit(main())
