"""The scale benchmark (issue 12): every measurement a ratio against a baseline measured in the same run.

One command, from a fresh clone (after `make setup`), under 15 minutes on 2 cores:

    make bench            # = .venv/bin/python bench/scale.py

writes bench/results/scale.json and prints each result as it comes. Sizes are the largest that fit the
time on 2 cores; the larger sizes the issue names are extrapolated with the measured slope, in the
results file under ``extrapolated``. Every measurement runs in a fresh child process (peak RSS is that
process's own ``ru_maxrss``).

- ``plan``: ``snakemake -n`` of the real Snakefile against plain Snakefiles with the same jobs
  (bench/plan_dryrun.py): bare, with input functions, and with ``script:`` jobs, the two things the
  real rules need that cost Snakemake per job; the four alternate, twice, and each takes its median.
- ``prepare``: streaming prepare of synthetic ShareGPT rows (10% whitespace duplicates) at two sizes:
  rows/s and peak RSS, against the floor of any per-row Python work (read the line, ``json.loads``,
  one SHA-256).
- ``mix``: the mix over synthetic token shards at two sizes: time and peak RSS, against copying the
  same shards (read every row, write it out).
- ``index``: the row index at two sizes: one shard's lookup, add (write-lock hold) and delete.
- ``fingerprint``: a model folder with a 4 GB (sparse) weights file: first fingerprint against cached.
- ``generate``: the generate driver (prompts → journal → published shard) against a plain loop over
  the same transformers engine, on the same prompts and a small random Llama.
- ``tokenize``: tokenize stage (ids kept from generation) against re-rendering every conversation
  with the chat template and re-tokenizing it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import scale_generate  # the generate driver and tokenize: their measurements run in a child, by name
from scale_common import config as _config
from scale_generate import GEN_ROUNDS, build_model

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "scale.json"
PLAN_REPEATS = 2  # alternating rounds of the four Snakefiles: one run of each varies by ~10%


# -- child-process measurements ------------------------------------------------------------------------
def child(name: str, **kwargs: Any) -> dict[str, Any]:
    """Run ``measure_<name>(**kwargs)`` in a fresh interpreter; its result plus its own peak RSS."""
    code = (
        f"import json, sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'bench')!r}]; import scale; "
        f"print('@@' + json.dumps(scale._in_child({name!r}, {kwargs!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{name} {kwargs} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("@@"))
    return json.loads(line[2:])


def _in_child(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    import logging

    logging.disable(logging.WARNING)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    measure = globals().get(f"measure_{name}") or getattr(scale_generate, f"measure_{name}")
    result = measure(**kwargs)
    result.setdefault("peak_rss_mb", round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    result["rss_at_start_mb"] = round(rss_before / 1024, 1)
    return result


# -- prepare -----------------------------------------------------------------------------------------
def write_sharegpt(path: Path, rows: int) -> None:
    """Synthetic ShareGPT rows, a ~550-character user turn and a short answer; every tenth repeats an
    earlier one with other spacing."""
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "for",
        "that",
        "with",
        "on",
        "as",
        "by",
        "this",
        "from",
        "it",
        "at",
        "be",
        "are",
        "or",
        "an",
        "we",
        "can",
    ]
    with open(path, "w") as f:
        for i in range(rows):
            n = i if i % 10 else i // 3
            text = " ".join(words[(n * 7 + k * 13) % len(words)] for k in range(150)) + f" #{n}"
            if i % 10 == 0:
                text = text.replace(" ", "  ", 3)
            row = {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "an answer"}]}
            f.write(json.dumps(row) + "\n")


def measure_prepare(root: str, rows: int) -> dict[str, Any]:
    from dflash_build import plan as plan_mod
    from dflash_build.stages import prepare
    from dflash_build.stages.registry import planned

    base = Path(root)
    config = _config(
        base, {"s": {"category": "c", "format": "sharegpt", "files": [str(base / "in.jsonl")]}}, shard_size=4096
    )
    plan = plan_mod.build(config)
    start, cpu = time.perf_counter(), time.process_time()
    manifest = prepare.run(planned(plan, "prepare", "s"))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return {
        "rows": rows,
        "seconds": round(seconds, 2),
        "rows_per_s": round(rows / seconds),
        "cpu_seconds": round(cpu_seconds, 2),
        "rows_per_cpu_s": round(rows / cpu_seconds),  # per core: every thread's time counts
        "kept": manifest["rows_out"],
    }


def measure_prepare_floor(root: str, rows: int) -> dict[str, Any]:
    import hashlib

    start = time.perf_counter()
    with open(Path(root) / "in.jsonl", "rb") as f:
        for line in f:
            json.loads(line)
            hashlib.sha256(line).digest()
    seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": round(seconds, 2), "rows_per_s": round(rows / seconds)}


# -- mix -----------------------------------------------------------------------------------------------
MIX_SOURCES = 4
MIX_SHARD_ROWS = 16384


def _mix_config(root: Path, rows: int) -> Any:
    per_source = rows // MIX_SOURCES
    sources = {}
    for i in range(MIX_SOURCES):
        listing = root / f"s{i}.jsonl"
        if not listing.exists():
            listing.write_bytes(b"{}\n" * per_source)  # only counted: it sets the shard count
        sources[f"s{i}"] = {"category": f"c{i}", "format": "prompt", "fields": {"prompt": "p"}, "files": [str(listing)]}
    return _config(root, sources, shard_size=MIX_SHARD_ROWS)


def write_token_shards(root: str, rows: int) -> None:
    import numpy as np
    import pyarrow as pa

    from dflash_build import plan as plan_mod
    from dflash_build.store import atomic
    from dflash_build.store import records as R

    plan = plan_mod.build(_mix_config(Path(root), rows))
    rng = np.random.default_rng(0)
    serial = 0
    for source, sp in plan.sources.items():
        for path in plan.token_shards(source):
            n = MIX_SHARD_ROWS
            lengths = rng.integers(16, 112, size=n).astype(np.int32)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            ids = pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(rng.integers(0, 49152, offsets[-1], dtype=np.int32))
            )
            mask = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ones(offsets[-1], dtype=np.int8)))
            pids = [f"{serial + i:016x}" for i in range(n)]
            serial += n
            table = pa.table(
                {
                    "input_ids": ids,
                    "loss_mask": mask,
                    "source": pa.array([source] * n),
                    "category": pa.array([sp.spec.category] * n),
                    "prompt_id": pa.array(pids),
                    "sample_idx": pa.array(np.zeros(n, dtype=np.int32)),
                    "finish_reason": pa.array(["stop"] * n),
                    "n_tokens": pa.array(lengths),
                    "n_loss_tokens": pa.array(lengths // 2),
                },
                schema=R.SAMPLE_SCHEMA,
            )
            atomic.write_parquet(path, table)


def measure_mix(root: str, rows: int) -> dict[str, Any]:
    from dflash_build import plan as plan_mod
    from dflash_build.stages import mix
    from dflash_build.stages.registry import planned

    plan = plan_mod.build(_mix_config(Path(root), rows))
    start = time.perf_counter()
    manifest = mix.run(planned(plan, "mix"))
    seconds = time.perf_counter() - start
    return {"rows_in": rows, "rows_out": manifest["rows"], "seconds": round(seconds, 2)}


def measure_mix_copy(root: str, rows: int) -> dict[str, Any]:
    import pyarrow.parquet as pq

    from dflash_build import plan as plan_mod
    from dflash_build.publish.files import RollingWriter

    plan = plan_mod.build(_mix_config(Path(root), rows))
    start = time.perf_counter()
    writer = RollingWriter(Path(root) / "copy", 100_000)
    for path in plan.all_token_shards():
        writer.write(pq.read_table(path))
    writer.close()
    seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": round(seconds, 2)}


# -- row index -----------------------------------------------------------------------------------------
INDEX_SHARD = 4096


def _index_rows(shard: int) -> list[dict[str, Any]]:
    return [
        {"prompt_id": f"{shard:08x}{i:08x}", "sample_idx": 0, "finish_reason": "stop", "n_output_tokens": 100}
        for i in range(INDEX_SHARD)
    ]


def measure_index(root: str, rows: int) -> dict[str, Any]:
    """Fill an index to ``rows``, then time one more shard's lookup, add and delete (and the lock hold)."""
    import contextlib

    from dflash_build.store import rowindex

    store = Path(root) / f"store-{rows}"
    index = rowindex.RowIndex(store)
    components = {"model": "m", "engine": {}, "sampling": {"seed": 0, "max_new_tokens": 128}}
    key = rowindex.reuse_key(components)
    shards = rows // INDEX_SHARD
    start = time.perf_counter()
    for shard in range(shards):
        index.add_shard("gk", components, store / f"completions/s/gk/{shard:05d}.parquet", _index_rows(shard))
    fill = time.perf_counter() - start
    holds: list[float] = []
    original = rowindex.RowIndex._writing

    @contextlib.contextmanager
    def timed(self: Any) -> Any:
        began = time.perf_counter()
        with original(self):
            yield
        holds.append(time.perf_counter() - began)

    rowindex.RowIndex._writing = timed  # type: ignore[method-assign]
    new = store / "completions/s/gk/new.parquet"
    rows_new = _index_rows(shards + 1)
    t = time.perf_counter()
    found = index.lookup(key, [(r["prompt_id"], 0) for r in _index_rows(shards // 2)], 128)
    lookup = time.perf_counter() - t
    t = time.perf_counter()
    index.add_shard("gk", components, new, rows_new)
    add = time.perf_counter() - t
    t = time.perf_counter()
    index.remove_shard(new)
    delete = time.perf_counter() - t
    index.close()
    assert len(found) == INDEX_SHARD
    return {
        "rows": shards * INDEX_SHARD,
        "fill_rows_per_s": round(shards * INDEX_SHARD / fill),
        "lookup_shard_s": round(lookup, 4),
        "add_shard_s": round(add, 4),
        "delete_shard_s": round(delete, 4),
        "lock_hold_add_s": round(holds[0], 4),
        "lock_hold_delete_s": round(holds[1], 4),
    }


# -- model fingerprint -------------------------------------------------------------------------------------
def measure_fingerprint(root: str, gigabytes: int) -> dict[str, Any]:
    from dflash_build import plan as plan_mod

    base = Path(root)
    model = base / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(gigabytes << 30)  # sparse: read back as zeros, at the speed of hashing
    (base / "p.jsonl").write_text('{"p": "x"}\n')
    source = {"category": "c", "format": "prompt", "fields": {"prompt": "p"}, "files": [str(base / "p.jsonl")]}
    config = _config(base, {"s": source}, model=model)
    times = []
    for _ in range(4):
        t = time.perf_counter()
        cache = plan_mod.fingerprint_cache(config)  # read from disk each time, as a new Snakemake run does
        plan_mod.fingerprint_model(config, cache)
        cache.save()
        times.append(time.perf_counter() - t)
    return {"gigabytes": gigabytes, "first_s": round(times[0], 3), "cached_s": round(min(times[1:]), 4)}


# -- the suite ---------------------------------------------------------------------------------------------
def _slope(small: dict[str, Any], large: dict[str, Any], x: str, y: str, at: int) -> float:
    """``y`` at ``x = at``, on the line through the two measured points."""
    rate = (large[y] - small[y]) / (large[x] - small[x])
    return round(large[y] + rate * (at - large[x]), 2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan-sizes", type=int, nargs=2, default=[1000, 10000])
    parser.add_argument("--prepare-rows", type=int, nargs=2, default=[200_000, 800_000])
    parser.add_argument("--mix-rows", type=int, nargs=2, default=[262_144, 1_048_576])
    parser.add_argument("--index-rows", type=int, nargs=2, default=[1_000_000, 10_000_000])
    parser.add_argument("--fingerprint-gb", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None, help="run these parts only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    parts = args.only or ["plan", "prepare", "mix", "index", "fingerprint", "generate"]
    results: dict[str, Any] = {}
    if args.only and args.out.exists():  # a partial run updates its parts of the last full results
        results = json.loads(args.out.read_text())
    results.update(machine={"cpus": os.cpu_count()}, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    began = time.perf_counter()

    def report(part: str, value: Any) -> None:
        results[part] = value
        print(f"{part}: {json.dumps(value)}", flush=True)

    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        root = Path(tmp)
        if "plan" in parts:
            import plan_dryrun

            rows = [plan_dryrun.measure(n, PLAN_REPEATS) for n in args.plan_sizes]
            columns = ("real_s", "plain_s", "plain_script_s")
            at = {k: _slope(rows[0], rows[1], "shards", k, 100_000) for k in columns}
            at["ratio"] = round(at["real_s"] / at["plain_s"], 3)
            at["ratio_to_plain_script"] = round(at["real_s"] / at["plain_script_s"], 3)
            report("plan", {"measured": rows, "extrapolated": {"100000_shards": at}})
        if "prepare" in parts:
            measured = []
            for rows in args.prepare_rows:
                folder = root / f"prepare-{rows}"
                folder.mkdir()
                write_sharegpt(folder / "in.jsonl", rows)
                ours = child("prepare", root=str(folder), rows=rows)
                floor = child("prepare_floor", root=str(folder), rows=rows)
                ours["floor_rows_per_s"] = floor["rows_per_s"]
                ours["ratio_to_floor"] = round(ours["rows_per_s"] / floor["rows_per_s"], 3)
                ours["digest_set_mb"] = round(rows * 24 / 2**20, 1)
                measured.append(ours)
            small, large = measured
            report("prepare", {"measured": measured, "extrapolated": {
                "10000000_rows": {
                    "seconds": _slope(small, large, "rows", "seconds", 10_000_000),
                    "cpu_seconds": (cpu := _slope(small, large, "rows", "cpu_seconds", 10_000_000)),
                    # the rate at scale: a prepare's fixed start (imports, first batch) is spread thin
                    "rows_per_cpu_s": round(10_000_000 / cpu),
                    "peak_rss_mb": _slope(small, large, "rows", "peak_rss_mb", 10_000_000),
                    "digest_set_mb": round(10_000_000 * 24 / 2**20, 1),
                }
            }, "rss_growth_per_million_rows_mb": round(
                (large["peak_rss_mb"] - small["peak_rss_mb"]) / (large["rows"] - small["rows"]) * 1e6, 1
            )})  # fmt: skip
        if "mix" in parts:
            measured = []
            for rows in args.mix_rows:
                folder = root / f"mix-{rows}"
                folder.mkdir()
                child("write_token_shards_", root=str(folder), rows=rows)
                ours = child("mix", root=str(folder), rows=rows)
                copy = child("mix_copy", root=str(folder), rows=rows)
                ours.update(copy_s=copy["seconds"], copy_peak_rss_mb=copy["peak_rss_mb"])
                ours["ratio_to_copy"] = round(ours["seconds"] / copy["seconds"], 3)
                measured.append(ours)
            small, large = measured
            report("mix", {"measured": measured, "extrapolated": {
                "10000000_rows": {k: _slope(small, large, "rows_in", k, 10_000_000) for k in ("seconds", "peak_rss_mb")}
            }})  # fmt: skip
        if "index" in parts:
            measured = [child("index", root=str(root), rows=rows) for rows in args.index_rows]
            report("index", {"measured": measured, "target_lock_hold_s": 0.1})
        if "fingerprint" in parts:
            report(
                "fingerprint", {**child("fingerprint", root=str(root), gigabytes=args.fingerprint_gb), "target_s": 0.05}
            )
        if "generate" in parts:
            folder = root / "generate"
            folder.mkdir()
            child("build_model_", root=str(folder))
            runs: dict[str, list[dict[str, Any]]] = {"driver": [], "plain": []}
            for round_ in range(GEN_ROUNDS):  # alternating: a slow stretch of the machine hits both
                runs["driver"].append(child("generate_driver", root=str(folder), round_=round_))
                runs["plain"].append(child("generate_plain", root=str(folder), round_=round_))
            driver = min(r["seconds"] for r in runs["driver"])
            plain = min(r["seconds"] for r in runs["plain"])
            paired = sorted(d["seconds"] / p["seconds"] for d, p in zip(runs["driver"], runs["plain"], strict=True))
            report(
                "generate",
                {
                    "runs": runs,
                    "driver_s": driver,
                    "plain_s": plain,
                    "ratio": round(driver / plain, 3),  # fastest against fastest
                    "ratio_paired_median": round(paired[len(paired) // 2], 3),  # round by round
                    # the code around the model (tokenizer load, engine load, engine.generate), median
                    "driver_own_s": sorted(r["own_s"] for r in runs["driver"])[GEN_ROUNDS // 2],
                    "plain_own_s": sorted(r["own_s"] for r in runs["plain"])[GEN_ROUNDS // 2],
                    "target": 1.02,
                },
            )
            report("tokenize", child("tokenize", root=str(folder)))
    took = "seconds" if not args.only else f"seconds_{'_'.join(parts)}"
    results[took] = round(time.perf_counter() - began, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out} in {results[took]} s")
    return results


def measure_write_token_shards_(root: str, rows: int) -> dict[str, Any]:
    write_token_shards(root, rows)
    return {}


def measure_build_model_(root: str) -> dict[str, Any]:
    return build_model(root)


if __name__ == "__main__":
    main()
