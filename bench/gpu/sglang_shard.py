"""On a GPU box: the production config's engine on real prompts, end to end, against SGLang's own benchmark.

What CI cannot run (no GPU there): the pinned SGLang starting the target model with config/config.yaml's
engine options, the backend's generate/abort calls and its signal take-over. This script

1. builds a small workflow from config/config.yaml: the same model settings, engine options and
   sampling; the prompts are the upstream-shaped fixtures of tests/data/upstream (every source, a few
   dozen rows each, so nothing is downloaded); the store goes under --out;
2. runs the generate stage through Snakemake on one GPU and checks every shard's accounting
   (ok + truncated + error + skipped == input rows, no error rows). With the production setting
   ``engine.shared: true`` that is SGLang's HTTP server kept by dflash_build.engines.host, fed by two
   jobs, which must have stopped when the workflow ended; ``--in-process`` runs one
   ``sglang.Engine`` per job instead;
3. runs ``python -m sglang.benchmark.offline_throughput`` on the same rendered prompts with the same
   answer lengths (ignore_eos) and the same engine options;
4. prints both output throughputs and writes them to --out/result.json.

    pip install -e ".[sglang]"
    python bench/gpu/sglang_shard.py --model /dev/shm/Qwen3.6-27B --out bench/results/gpu-check
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.test_production_rehearsal import HUB_FIXTURES, PINNED, UPSTREAM, production_config  # noqa: E402


def workflow_config(model: str, out: Path) -> dict:
    config = production_config()
    for source in config["sources"].values():
        source["hf"]["path"] = str(UPSTREAM / HUB_FIXTURES[source["hf"]["path"]])
        source["hf"]["revision"] = PINNED
    config["model"]["path"] = model
    config["store"], config["logs"] = str(out / "store"), str(out / "logs")
    config["dataset"]["out"] = str(out / "dist")
    config["shard_size"] = 100_000  # one shard per source
    return config


def snakemake(config_path: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "snakemake", "--configfile", str(config_path), "--cores", "all"]
    subprocess.run([*cmd, "--resources", "gpu=1", *args], cwd=REPO, check=True)


def shards(out: Path) -> list[tuple[Path, dict]]:
    return [
        (p.with_suffix("").with_suffix(".parquet"), json.loads(p.read_text()))
        for p in out.glob("store/completions/*/*/*.stats.json")
    ]


def check_accounting(found: list[tuple[Path, dict]]) -> None:
    for path, stats in found:
        total = stats["ok"] + stats["truncated"] + stats["error"] + stats["skipped"]
        assert total == stats["input_rows"], f"{path}: {total} rows accounted of {stats['input_rows']}"
        assert stats["error"] == 0, f"{path}: {stats['error']} error/abort rows: {stats.get('errors')}"


def benchmark_input(found: list[tuple[Path, dict]], model: str, dest: Path) -> int:
    """The rendered prompts and the answers' lengths, as SGLang's `custom` dataset reads them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = 0
    with dest.open("w") as f:
        for path, _ in found:
            for row in pq.read_table(path, columns=["prompt_ids", "output_ids"]).to_pylist():
                if not row["output_ids"]:
                    continue
                prompt = tokenizer.decode(row["prompt_ids"], skip_special_tokens=False)
                answer = tokenizer.decode(row["output_ids"], skip_special_tokens=False)
                f.write(json.dumps({"conversations": [{"content": prompt}, {"content": answer}]}) + "\n")
                rows += 1
    return rows


def engine_flags(options: dict) -> list[str]:
    flags = []
    for name, value in options.items():
        if name in ("max_inflight", "retries"):
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the local snapshot (model.path)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu-check")
    parser.add_argument("--dry-run", action="store_true", help="only preview the jobs (works without a GPU)")
    parser.add_argument("--in-process", action="store_true", help="engine.shared: false (an engine per job)")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = workflow_config(args.model, out)
    config["engine"]["shared"] = not args.in_process
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    if args.dry_run:
        snakemake(config_path, "-n", "--until", "generate")
        return
    started = time.monotonic()
    snakemake(config_path, "--until", "generate")
    wall = time.monotonic() - started
    found = shards(out)
    check_accounting(found)
    if config["engine"]["shared"]:
        from dflash_build.engines import host as engine_host

        history = out / "logs" / "engines" / "engines.jsonl"
        assert history.exists(), "engine.shared: no engine host ran"
        assert not engine_host.running(config["engine"].get("lock_dir", "/tmp/dflash-build-gpu-locks")), (
            "the shared engine outlived the workflow"
        )
    ours_tokens = sum(s["output_tokens"] for _, s in found if "output_tokens" in s)
    rows = benchmark_input(found, args.model, out / "bench.jsonl")
    result_file = out / "sglang_offline.jsonl"
    subprocess.run(
        [
            sys.executable, "-m", "sglang.benchmark.offline_throughput",
            "--model-path", args.model, "--dataset-name", "custom", "--dataset-path", str(out / "bench.jsonl"),
            "--num-prompts", str(rows), "--result-filename", str(result_file),
            *engine_flags(config["engine"]["options"]),
        ],
        check=True,
    )  # fmt: skip
    theirs = json.loads(result_file.read_text().splitlines()[-1])
    result = {
        "rows": rows,
        "workflow_wall_seconds": round(wall, 1),
        "workflow_output_tokens": ours_tokens,
        "workflow_output_tok_per_s_incl_start": round(ours_tokens / wall, 1) if wall else None,
        "sglang_offline": {k: theirs.get(k) for k in ("output_throughput", "total_latency", "successful_requests")},
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
