"""The generate driver against vLLM's own offline throughput, on vLLM's CPU build, in the same run.

The same prompts, model and sampling go two ways, alternately (``--rounds`` times each, medians):

- ``driver``: ``snakemake --until generate`` on a prepared store, the vllm backend with a shared server
  started before the run (as production keeps one per GPU): render, journal, publish, through HTTP;
- ``offline``: ``vllm.LLM.generate`` in vLLM's own environment, on the token ids and row seeds the
  driver sent (read back from its shards), the model loaded before the clock starts.

Output tokens per second of each, their ratio, and whether both wrote the same tokens (the same seeds on
the same engine). Where the driver's difference goes: the job's own start before its first request
(Snakemake, Python, the tokenizer; from its log), and the rest (HTTP and the driver's bookkeeping).
Writes bench/results/vllm_throughput.json.

    python bench/vllm_throughput.py [--prompts 192] [--max-new-tokens 96] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.conftest import VLLM_TEST_OPTIONS, build_vllm_model, write_jsonl  # noqa: E402

RESULTS = REPO / "bench" / "results" / "vllm_throughput.json"
VLLM_PYTHON = Path(os.environ.get("DFLASH_BUILD_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
OFFLINE = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main():  # under a main guard: vLLM starts its engine core by spawning
    asked = json.load(open(sys.argv[1]))
    # as the backend runs the server on the CPU build: chunked prefill off (seeded requests fail it there)
    llm = LLM(model=asked["model"], dtype="float32", enforce_eager=True, max_model_len=asked["context"], seed=0,
              enable_chunked_prefill=False)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in asked["rows"]]
    params = [
        SamplingParams(temperature=asked["temperature"], top_p=asked["top_p"], top_k=asked["top_k"], min_p=0.0,
                       max_tokens=asked["max_new_tokens"], seed=r["seed"], stop_token_ids=asked["stop_ids"],
                       skip_special_tokens=False)
        for r in asked["rows"]
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm, as the server is before the driver's run
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    print("@@" + json.dumps({"wall_s": wall, "outputs": [list(o.outputs[0].token_ids) for o in outputs]}))


if __name__ == "__main__":
    main()
"""


def config(root: Path, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    rows = [
        {"instruction": f"Tell a short story about a {w} number {i}."}
        for i, w in enumerate(["red", "tall"] * (args.prompts // 2))
    ]
    write_jsonl(root / "prompts.jsonl", rows)
    return {
        "store": "store",
        "logs": "logs",
        "dataset": {"name": "bench", "out": "dist"},
        "model": {"path": str(model), "chat_template": str(REPO / "config" / "templates" / "chatml-tools.jinja")},
        "engine": {
            "backend": "vllm",
            "shared": True,
            "lock_dir": str(root / "locks"),
            "base_port": 32500,
            "options": {**VLLM_TEST_OPTIONS, "python": str(VLLM_PYTHON), "max_inflight": args.prompts},
        },
        "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "max_new_tokens": args.max_new_tokens, "seed": 0},
        "shard_size": args.prompts,  # one job: its start is paid once, as one GPU's shard is
        "truncated": "keep",
        "mix": {"categories": {"general": 1}},
        "sources": {"p": {"category": "general", "format": "alpaca", "files": [str(root / "prompts.jsonl")]}},
    }


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "snakemake", "--directory", str(workdir), "--snakefile", str(REPO / "Snakefile")]
    cmd += ["--configfile", str(workdir / "config.yaml"), "--cores", "2", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return done


def shard_rows(workdir: Path) -> list[dict[str, Any]]:
    return [
        r for p in sorted((workdir / "store" / "completions").rglob("0*.parquet")) for r in pq.read_table(p).to_pylist()
    ]


def driver_round(root: Path, raw: dict[str, Any]) -> dict[str, Any]:
    workdir = root / f"driver-{time.monotonic_ns()}"
    workdir.mkdir()
    (workdir / "config.yaml").write_text(yaml.safe_dump(raw))
    snakemake(workdir, "--until", "prepare_p")
    start = time.perf_counter()
    snakemake(workdir, "--until", "generate")
    wall = time.perf_counter() - start
    rows = shard_rows(workdir)
    stats = json.loads(next((workdir / "store" / "completions").rglob("*.stats.json")).read_text())
    return {
        "wall_s": round(wall, 2),
        "job_wall_s": round(stats["wall_seconds"], 2),  # the job's own: from its shard's load to publishing it
        "tokens": sum(len(answered(r)) for r in rows),
        "rows": rows,
    }


def answered(row: dict[str, Any]) -> list[int]:
    """A row's answer as vLLM returns it: with the stop token that ended it."""
    return row["output_ids"] + ([row["stop_token_id"]] if row["stop_token_id"] is not None else [])


def offline_round(root: Path, raw: dict[str, Any], rows: list[dict[str, Any]], stop_ids: list[int]) -> dict[str, Any]:
    asked = root / "offline.json"
    sampling = raw["sampling"]
    asked.write_text(json.dumps({
        "model": raw["model"]["path"], "context": 2048, "stop_ids": stop_ids, "rows": rows,
        **{k: sampling[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens")},
    }))  # fmt: skip
    script = root / "offline.py"
    script.write_text(OFFLINE)
    done = subprocess.run([str(VLLM_PYTHON), str(script), str(asked)], capture_output=True, text=True,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    found = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("@@"))[2:])
    return {"wall_s": round(found["wall_s"], 2), "tokens": sum(map(len, found["outputs"])), "outputs": found["outputs"]}


def warm(cfg: Any, stop_ids: list[int]) -> None:
    """Start the config's shared server (or keep the one running), logging outside the build's folders."""
    from dflash_build import plan as plan_mod
    from dflash_build.engines import host
    from dflash_build.stages.common import chat
    from dflash_build.store import fingerprints

    fingerprint, _ = plan_mod.fingerprint_model(cfg, fingerprints.FingerprintCache(None))
    spec = host.launch_spec(cfg, stop_ids, None, fingerprint, chat.context_length(cfg.model))
    host.attach(spec, pool=False).release()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from dflash_build import config as config_mod
    from dflash_build.engines import host
    from dflash_build.stages.common import chat

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = root / "tokenizer"
        from transformers import AutoTokenizer

        from tests.conftest import smollm2_gguf

        gguf = smollm2_gguf()
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tokenizer)
        model = build_vllm_model(root / "model", tokenizer, seed=0)
        raw = config(root, model, args)
        (root / "config.yaml").write_text(yaml.safe_dump(raw))
        with contextlib.chdir(root):  # the config's relative folders, as a build in root reads them
            cfg = config_mod.load(root / "config.yaml")
        stop_ids = chat.stop_token_ids(chat.load_tokenizer(cfg.model), cfg.model.path)
        runs: dict[str, list[dict[str, Any]]] = {"driver": [], "offline": []}
        for _ in range(args.rounds):  # alternating: a slow stretch of the machine hits both
            with contextlib.chdir(root):  # its log beside the builds, not in the working directory
                warm(cfg, stop_ids)  # the shared server runs before the build, as production's does
            driver = driver_round(root, raw)
            runs["driver"].append(driver)
            host.stop_idle(root / "locks")  # the offline engine gets the cores and memory the server had
            runs["offline"].append(offline_round(root, raw, driver["rows"], stop_ids))
        host.stop_idle(root / "locks")
    d_rate = statistics.median(r["tokens"] / r["wall_s"] for r in runs["driver"])
    o_rate = statistics.median(r["tokens"] / r["wall_s"] for r in runs["offline"])
    same = all(
        [r["output_ids"] + ([r["stop_token_id"]] if r["stop_token_id"] is not None else []) for r in d["rows"]]
        == o["outputs"]
        for d, o in zip(runs["driver"], runs["offline"], strict=True)
    )
    own = statistics.median(r["wall_s"] - r["job_wall_s"] for r in runs["driver"])
    job_rate = statistics.median(r["tokens"] / r["job_wall_s"] for r in runs["driver"])
    result = {
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "driver_tok_per_s": round(d_rate, 1),
        "offline_tok_per_s": round(o_rate, 1),
        "ratio": round(d_rate / o_rate, 3),
        # the job alone (without Snakemake's start and the job's own start before its shard loads)
        "driver_job_tok_per_s": round(job_rate, 1),
        "job_ratio": round(job_rate / o_rate, 3),
        "same_tokens": same,
        "driver_runs": [{k: v for k, v in r.items() if k != "rows"} for r in runs["driver"]],
        "offline_runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs["offline"]],
        "snakemake_and_job_start_s": round(own, 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
