"""The scale benchmark's generate and tokenize measurements (bench/scale.py runs each in a child process):
the generate driver against a plain loop over the same engine, and tokenize against re-rendering."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from scale_common import REPO
from scale_common import config as _config

GEN_PROMPTS = 48
GEN_TOKENS = 96
GEN_ROUNDS = 5  # one run's noise on 2 cores is a few percent: the target is 2%


def build_model(root: str) -> dict[str, Any]:
    """A 4-layer random Llama (hidden 256) over SmolLM2's tokenizer, and its prompt shard prepared."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dflash_build import plan as plan_mod
    from dflash_build.stages import prepare
    from dflash_build.stages.registry import planned

    sys.path.insert(0, str(REPO))
    from tests.conftest import smollm2_gguf

    base = Path(root)
    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(base / "model")
    tok.save_pretrained(base / "model")
    with open(base / "prompts.jsonl", "w") as f:
        for i in range(GEN_PROMPTS):
            f.write(json.dumps({"p": f"Question {i}: " + "explain the idea in a few words " * (1 + i % 5)}) + "\n")
    plan = plan_mod.build(_gen_config(base))
    prepare.run(planned(plan, "prepare", "s"))
    return {}


def _gen_config(base: Path) -> Any:
    source = {"category": "c", "format": "prompt", "fields": {"prompt": "p"}, "files": [str(base / "prompts.jsonl")]}
    return _config(
        base,
        {"s": source},
        model=base / "model",
        shard_size=GEN_PROMPTS,
        engine={"backend": "transformers", "options": {"device": "cpu", "dtype": "float32", "batch_size": 8}},
        sampling={"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": GEN_TOKENS, "seed": 0},
        truncated="keep",
    )


def _time_model_work() -> dict[str, float]:
    """Patch the tokenizer load, the engine load and the engine's generate to add up their seconds:
    what is left of a run is the code around them (the driver's own cost, or the plain loop's)."""
    from dflash_build import engines
    from dflash_build.stages.common import chat

    spent = {"model_s": 0.0}
    load_tokenizer, load_engine = chat.load_tokenizer, engines.load

    def timed(f: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent["model_s"] += time.perf_counter() - t

        return run

    def engine(*args: Any, **kwargs: Any) -> Any:
        loaded = timed(load_engine)(*args, **kwargs)
        generate = loaded.generate

        def generate_timed(requests: Any) -> Any:
            it = iter(generate(requests))
            while True:
                t = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    return
                finally:
                    spent["model_s"] += time.perf_counter() - t
                yield item

        loaded.generate = generate_timed
        return loaded

    chat.load_tokenizer, engines.load = timed(load_tokenizer), engine
    return spent


def measure_generate_driver(root: str, round_: int) -> dict[str, Any]:
    import shutil

    from dflash_build import plan as plan_mod
    from dflash_build.stages import generate
    from dflash_build.stages.registry import planned

    base = Path(root)
    plan = plan_mod.build(_gen_config(base))
    for folder in ("completions", "journal", "index"):
        shutil.rmtree(plan.config.store / folder, ignore_errors=True)
    spent = _time_model_work()
    t = time.perf_counter()
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    seconds = time.perf_counter() - t
    assert stats["generated"] == GEN_PROMPTS, stats
    own = seconds - spent["model_s"]
    return {"seconds": round(seconds, 2), "own_s": round(own, 3), "output_tokens": stats.get("output_tokens")}


def measure_generate_plain(root: str, round_: int) -> dict[str, Any]:
    """What the driver does without the driver: render, generate, keep the results in a list."""
    import pyarrow.parquet as pq

    from dflash_build import engines
    from dflash_build import plan as plan_mod
    from dflash_build.stages import generate
    from dflash_build.stages.common import chat

    base = Path(root)
    plan = plan_mod.build(_gen_config(base))
    cfg, sampling = plan.config, plan.sources["s"].spec.sampling
    spent = _time_model_work()
    t = time.perf_counter()
    tokenizer = chat.load_tokenizer(cfg.model)
    engine = engines.load(cfg.engine, cfg.model, chat.stop_token_ids(tokenizer, cfg.model.path), None, tokenizer)
    params = engines.SamplingParams.of(sampling)
    requests = [
        engines.Request(
            p["prompt_id"],
            0,
            chat.render(tokenizer, json.loads(p["messages"]), None, {}),
            params,
            generate.row_seed(sampling.seed, p["prompt_id"], 0),
        )
        for p in pq.read_table(plan.prompt_dir("s") / "00000.parquet").to_pylist()
    ]
    results = list(engine.generate(requests))
    engine.close()
    seconds = time.perf_counter() - t
    assert len(results) == GEN_PROMPTS
    own = seconds - spent["model_s"]
    return {
        "seconds": round(seconds, 2),
        "own_s": round(own, 3),
        "output_tokens": sum(len(r.output_ids) for r in results),
    }


TOKENIZE_COPIES = 40  # the generated shard repeated: enough rows to time


def measure_tokenize(root: str) -> dict[str, Any]:
    """tokenize.run on the generated shard repeated, against re-rendering each conversation."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_build import plan as plan_mod
    from dflash_build.stages import tokenize
    from dflash_build.stages.common import chat
    from dflash_build.stages.registry import planned

    base = Path(root)
    plan = plan_mod.build(_gen_config(base))
    completions = pq.read_table(plan.completion_dir("s") / "00000.parquet")
    big = base / "tokenize-in.parquet"
    pq.write_table(pa.concat_tables([completions] * TOKENIZE_COPIES), big)
    t = time.perf_counter()
    job = planned(plan, "tokenize", "s", "00000")
    out = base / "tokenize-out.parquet"
    inputs = {**job.inputs, "completions": (big,)}
    job = dataclasses.replace(job, inputs=inputs, outputs={"data": (out,), "stats": (out.with_suffix(".json"),)})
    stats = tokenize.run(job)
    ours = time.perf_counter() - t
    prompts = {p["prompt_id"]: p for p in pq.read_table(plan.prompt_dir("s") / "00000.parquet").to_pylist()}
    tokenizer = chat.load_tokenizer(plan.config.model)
    t = time.perf_counter()
    tokens = 0
    for row in pq.read_table(big, columns=["prompt_id", "text"]).to_pylist():
        messages = [*json.loads(prompts[row["prompt_id"]]["messages"]), {"role": "assistant", "content": row["text"]}]
        text = chat.render_text(tokenizer, messages, None, {}, generation_prompt=False)
        tokens += len(tokenizer(text, add_special_tokens=False)["input_ids"])
    baseline = time.perf_counter() - t
    return {
        "rows": completions.num_rows * TOKENIZE_COPIES,
        "tokens": stats["tokens"],
        "tokenize_s": round(ours, 3),
        "rerender_s": round(baseline, 3),
        "tokenize_tokens_per_s": round(stats["tokens"] / ours),
        "rerender_tokens_per_s": round(tokens / baseline),
    }
