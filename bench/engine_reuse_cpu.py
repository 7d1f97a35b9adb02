"""Per-job engines against shared engines, for real on the CPU: 8 small shards through llama.cpp.

The same build (8 shards of 4 prompts, answers of up to 32 tokens, the SmolLM2-135M-Instruct GGUF
served by llama-cpp-python's server, ``engine.backend: llamacpp``) runs through Snakemake in two ways,
alternately (``--rounds`` times each, so that a slower stretch of the machine hits both), each run in
a fresh folder:

- ``per_job``: ``engine.shared: false``, one job at a time: every job starts its own server and stops it;
- ``shared``: ``engine.shared: true``, one job at a time: the first job starts the server, the rest reuse it.

Two jobs feeding one engine at once (what keeps a GPU's batch full) is not measured here: on a 2-core
machine the second job's own start-up competes with the engine for the same cores (bench/engine_sim.py
models it).

For each: wall time, engine starts, the engines' start-up time (spawn until the server answers),
and the fraction of the run's wall time the engine had nothing to do (no job attached to it: starting,
stopped, or between jobs; from logs/engines/engines.jsonl, sampled every 0.2 s). The shared run must be
faster than the per-job run by at least the start-up time it saved (medians over the rounds). Writes
bench/results/engine_reuse_cpu.json.

    python bench/engine_reuse_cpu.py [--shards 8] [--prompts-per-shard 4] [--max-new-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_build.store.layout import prepare_rule_name
from tests.conftest import smollm2_gguf  # the test set-up installs it

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "config" / "templates" / "chatml-tools.jinja"


def tokenizer_folder(dest: Path) -> Path:
    """The GGUF's tokenizer saved as a folder once: each job then loads it in a moment instead of
    converting it from the GGUF (seconds of noise per job that are the same in both ways)."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(dest)
    return dest


def run(root: Path, shared: bool, cores: int, args: argparse.Namespace, port: int, tokenizer: Path) -> dict[str, Any]:
    data = root / "data" / "p.jsonl"
    data.parent.mkdir(parents=True)
    n = args.shards * args.prompts_per_shard
    rows = (json.dumps({"instruction": f"Name {i + 2} fruits, one per line."}) + "\n" for i in range(n))
    data.write_text("".join(rows))
    config = {
        "store": "store",
        "logs": "logs",
        "dataset": {"name": "bench", "out": "dist"},
        "model": {"path": str(smollm2_gguf()), "tokenizer": str(tokenizer), "chat_template": str(TEMPLATE)},
        "engine": {
            "backend": "llamacpp",
            "options": {"threads": 2},
            "shared": shared,
            "lock_dir": str(root / "locks"),
            "base_port": port,
        },
        "sampling": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": args.max_new_tokens},
        "shard_size": args.prompts_per_shard,
        "truncated": "keep",
        "mix": {"categories": {"general": 1.0}},
        "sources": {"fruits": {"category": "general", "files": [str(data)], "format": "alpaca"}},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    base = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(root)]
    base += ["--configfile", str(root / "config.yaml"), "--cores", str(cores)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # the prompt shards first, so that the timed part is generation only
    prep = subprocess.run([*base, "--until", prepare_rule_name("fruits")], capture_output=True, text=True, env=env)
    if prep.returncode != 0:
        sys.exit(f"snakemake failed:\n{prep.stderr[-4000:]}")
    started = time.monotonic()
    proc = subprocess.run([*base, "--until", "generate"], capture_output=True, text=True, env=env)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"snakemake failed:\n{proc.stderr[-4000:]}")
    engines = [json.loads(line) for line in (root / "logs" / "engines" / "engines.jsonl").read_text().splitlines()]
    in_use = sum(e["in_use_seconds"] for e in engines)
    start_up = sum(e["ready_at"] - e["spawned_at"] for e in engines)
    return {
        "wall_seconds": round(wall, 2),
        "engine_starts": len(engines),
        "start_up_seconds": round(start_up, 2),
        "engine_in_use_seconds": round(in_use, 2),
        "engine_idle_fraction": round(1 - in_use / wall, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--prompts-per-shard", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "engine_reuse_cpu.json"))
    args = parser.parse_args()
    port = 34000 + os.getpid() % 500 * 10
    runs: dict[str, list[dict[str, Any]]] = {"per_job": [], "shared": []}
    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer = tokenizer_folder(Path(tok_dir))
        for round_ in range(args.rounds):
            for name, shared in (("per_job", False), ("shared", True)):
                with tempfile.TemporaryDirectory() as tmp:
                    r = run(Path(tmp), shared, 1, args, port, tokenizer)
                runs[name].append(r)
                print(
                    f"round {round_ + 1} {name:<8} wall {r['wall_seconds']:6.1f}s  engine starts "
                    f"{r['engine_starts']}  start-up {r['start_up_seconds']:5.1f}s  "
                    f"engine idle {r['engine_idle_fraction']:.1%}"
                )
    results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    per_job, shared = results["per_job"], results["shared"]
    saved_start = per_job["start_up_seconds"] - shared["start_up_seconds"]
    faster = per_job["wall_seconds"] - shared["wall_seconds"]
    ok = faster >= saved_start
    print(
        f"medians: per-job {per_job['wall_seconds']:.1f}s (engine idle {per_job['engine_idle_fraction']:.1%}), "
        f"shared {shared['wall_seconds']:.1f}s (engine idle {shared['engine_idle_fraction']:.1%}); shared is "
        f"{faster:.1f}s faster ({per_job['wall_seconds'] / shared['wall_seconds']:.2f}x), start-up saved "
        f"{saved_start:.1f}s: {'meets' if ok else 'MISSES'} the target"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "params": vars(args) | {"out": None},
                "medians": results,
                "runs": runs,
                "faster_seconds": round(faster, 2),
                "start_up_saved_seconds": round(saved_start, 2),
                "meets_target": ok,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
