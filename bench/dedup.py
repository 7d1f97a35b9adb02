"""Prepare with near-duplicate removal and decontamination against today's prepare, on the same rows.

    .venv/bin/python bench/dedup.py                 # 1M and 10M rows (about 25 minutes on 2 cores)
    .venv/bin/python bench/dedup.py --rows 200000   # a quick look

writes bench/results/dedup.json. Each size runs prepare three times, each in a fresh process (peak RSS
is that process's own): without the filters (the baseline), with ``dedup.near`` alone, and with
``dedup.near`` and ``decontaminate`` (1,000 reference items of GSM8K's shape, 60 of them planted in
the rows). The rows are bench/scale.py's synthetic ShareGPT rows (a ~550-character user turn; every
tenth an exact copy with other spacing) plus, every 50th, a near-copy of an earlier row (one word
changed). ``--corpus cjk`` writes the same rows in Chinese words without spaces, ``mixed`` alternates
English and Chinese words (issue 42: words of scripts without spaces are characters). The target
(issue 29): at least 50,000 rows per CPU-second with both filters on, memory bounded by the band keys
(``8 × bands`` bytes a converted row, stated below).

The MinHash library was chosen by measurement, in the same run (``library``): rensa's batch digest
against datasketch's bulk MinHash, on the same shingle sets.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import scale  # noqa: E402 (bench/scale.py: rows, configs and child processes)

RESULTS = Path(__file__).resolve().parent / "results" / "dedup.json"
REFERENCE_ITEMS = 1000
PLANTED = 60
NEAR_EVERY = 50


def _question(rng: random.Random, i: int) -> str:
    names = ["Janet", "Tom", "Ava", "Raj", "Mei", "Olu", "Sven", "Ines"]
    return (
        f"{rng.choice(names)} has {rng.randint(2, 90)} apples and buys {rng.randint(2, 90)} more every week for "
        f"{rng.randint(2, 12)} weeks, then gives {rng.randint(2, 30)} to each of {rng.randint(2, 9)} friends; "
        f"how many apples are left at the end of week {i}?"
    )


# Chinese words of one to three characters from the 3,000 most common Han characters' block (U+4E00...)
def _han_vocab(size: int) -> list[str]:
    rng = random.Random(3)
    return ["".join(chr(0x4E00 + rng.randrange(3000)) for _ in range(rng.choice((1, 2, 2, 3)))) for _ in range(size)]


CORPORA = ("english", "cjk", "mixed")


def _vocab(corpus: str) -> list[str]:
    english = [f"{w}{i}" for i, w in enumerate(["al", "be", "ka", "do", "mi", "ru"] * 834)][:5000]
    if corpus == "english":
        return english
    han = _han_vocab(5000)
    # mixed: English and Chinese words interleaved in one text, as code-switched prompts are
    return han if corpus == "cjk" else [w for pair in zip(english[:2500], han[:2500], strict=True) for w in pair]


def write_rows(root: Path, rows: int, corpus: str = "english") -> None:
    """ShareGPT rows of random words (a Zipf-like draw from 5,000, ~550 characters in English); every
    tenth an exact copy of an earlier row with other spacing, every 50th a near-copy (one word changed),
    and the first near-copies with a reference question in them. ``cjk``: the words are Chinese, written
    without spaces (90 words, ~180 characters); ``mixed``: English and Chinese words alternate."""
    import numpy as np

    rng = random.Random(7)
    questions = [_question(rng, i) for i in range(REFERENCE_ITEMS)]
    with open(root / "ref.jsonl", "w") as f:
        for q in questions:
            f.write(json.dumps({"question": q, "answer": "42"}) + "\n")
    vocab = np.array(_vocab(corpus))
    joiner = "" if corpus == "cjk" else " "
    weights = 1 / np.arange(1, len(vocab) + 1)
    draw = np.random.default_rng(0)
    chunk = 100_000
    planted = 0
    with open(root / "in.jsonl", "w") as f:
        for lo in range(0, rows, chunk):
            n = min(chunk, rows - lo)
            picks = vocab[draw.choice(len(vocab), size=(n, 90), p=weights / weights.sum())]
            lines = []
            for i in range(n):
                words = picks[i] if (lo + i) % 10 else picks[max(i - 5, 0)]
                text = joiner.join(words)
                if (lo + i) % 10 == 0:
                    text = text.replace(" ", "  ", 3)  # Chinese alone has no spaces: an exact copy
                elif (lo + i) % NEAR_EVERY == 1 and i >= 7:
                    copy = list(picks[i - 7])
                    copy[45] = "changed" if joiner else "改"
                    text = joiner.join(copy)
                    if planted < PLANTED:
                        text = f"Please solve: {questions[planted]} {text}"
                        planted += 1
                row = {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "an answer"}]}
                lines.append(json.dumps(row))
            f.write("\n".join(lines) + "\n")


def measure_prepare(root: str, rows: int, filters: str, corpus: str = "english") -> dict[str, Any]:
    from dflash_build import lsh
    from dflash_build import plan as plan_mod
    from dflash_build.stages import prepare
    from dflash_build.stages.registry import planned

    base = Path(root)
    extra: dict[str, Any] = {"store": str(base / f"store-{filters}")}
    if filters != "none":
        extra["dedup"] = {"near": {}}
    if filters == "near+decontaminate":
        extra["decontaminate"] = {"references": {"gsm8k": {"files": [str(base / "ref.jsonl")], "field": "question"}}}
    source = {"s": {"category": "c", "format": "sharegpt", "files": [str(base / "in.jsonl")]}}
    config = scale._config(base, source, shard_size=4096, **extra)
    plan = plan_mod.build(config)
    start, cpu = time.perf_counter(), time.process_time()
    manifest = prepare.run(planned(plan, "prepare", "s"))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    bands = lsh.bands_rows(config.dedup.near)[0] if config.dedup.near is not None else 0
    return {
        "rows": rows,
        "corpus": corpus,
        "filters": filters,
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),
        "rows_per_cpu_s": round(rows / cpu_seconds),
        "kept": manifest["rows_out"],
        "drops": manifest["drops"],
        "band_index_bytes_per_row": 8 * bands,
        "band_index_mb": round(8 * bands * rows / 2**20, 1),
    }


def measure_library(rows: int) -> dict[str, Any]:
    """MinHash signatures of the same shingle sets: rensa's batch digest (and reading it into numpy)
    against datasketch's bulk MinHash."""
    import datasketch
    import numpy as np
    import pyarrow as pa
    import rensa

    from dflash_build.stages.common import neardup
    from dflash_build.stages.common import words as W

    rng = random.Random(1)
    vocab = [f"w{i}" for i in range(20000)]
    texts = pa.array([" ".join(rng.choices(vocab, k=90)) for _ in range(rows)])
    shingles, text_of = W.words(texts).ngrams(5, whole_if_shorter=True)
    offsets = np.zeros(rows + 1, dtype=np.uint64)
    np.cumsum(np.bincount(text_of, minlength=rows), out=offsets[1:])
    cpu = time.process_time()
    matrix = rensa.RMinHash.digest_matrix_from_flat_token_hashes(shingles, offsets, 128, 0)
    rensa_digest = time.process_time() - cpu
    neardup._values(matrix, rows * 128)  # the values out of rensa's lists, as prepare reads them
    rensa_total = time.process_time() - cpu
    sets = [shingles[int(a) : int(b)].tobytes() for a, b in itertools.pairwise(offsets)]
    sets = [[s[i : i + 8] for i in range(0, len(s), 8)] for s in sets]
    cpu = time.process_time()
    datasketch.MinHash.bulk(sets, num_perm=128)
    datasketch_total = time.process_time() - cpu
    return {
        "rows": rows,
        "rensa_digest_us_per_row": round(1e6 * rensa_digest / rows, 2),
        "rensa_with_numpy_us_per_row": round(1e6 * rensa_total / rows, 2),
        "datasketch_us_per_row": round(1e6 * datasketch_total / rows, 2),
        "datasketch_over_rensa": round(datasketch_total / rensa_total, 1),
    }


def measure_words(corpus: str, rows: int = 20000, repeats: int = 5) -> dict[str, Any]:
    """words() and 5-word shingles of one batch, against the same with no cut between characters of
    scripts without spaces (the words before issue 42), in the same process; best of ``repeats``."""
    import numpy as np
    import pyarrow as pa

    from dflash_build.stages.common import words as W

    rng = random.Random(0)
    vocab = _vocab(corpus)
    texts = pa.array([("" if corpus == "cjk" else " ").join(rng.choices(vocab, k=90)) for _ in range(rows)])
    cut, best = W._spaceless_edges, {}
    for label in ("uncut", "cut"):
        W._spaceless_edges = cut if label == "cut" else (lambda raw: np.zeros(0, dtype=np.int64))
        times = []
        for _ in range(repeats):
            start = time.process_time()
            W.words(texts).ngrams(5, whole_if_shorter=True)
            times.append(time.process_time() - start)
        best[label] = min(times)
    W._spaceless_edges = cut
    return {
        "corpus": corpus,
        "texts_per_cpu_s": round(rows / best["cut"]),
        "uncut_texts_per_cpu_s": round(rows / best["uncut"]),
        "ratio_to_uncut_cpu": round(best["cut"] / best["uncut"], 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--corpus", nargs="+", choices=CORPORA, default=list(CORPORA))
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"machine": {"cpus": scale.os.cpu_count()}, "started": time.strftime("%F %T")}
    results["library"] = measure_library(20000)
    print(f"library: {json.dumps(results['library'])}", flush=True)
    results["words"] = [measure_words(corpus) for corpus in args.corpus]
    for run in results["words"]:
        print(f"words: {json.dumps(run)}", flush=True)
    results["prepare"] = []
    for rows, corpus in itertools.product(args.rows, args.corpus):
        with tempfile.TemporaryDirectory(prefix="dflash-dedup-bench-") as tmp:
            root = Path(tmp)
            write_rows(root, rows, corpus)
            runs = {f: _child(root, rows, f, corpus) for f in ("none", "near", "near+decontaminate")}
            base = runs["none"]
            for run in runs.values():
                run["ratio_to_baseline_cpu"] = round(run["cpu_seconds"] / base["cpu_seconds"], 2)
                run["extra_rss_mb"] = round(run["peak_rss_mb"] - base["peak_rss_mb"], 1)
                print(f"prepare: {json.dumps(run)}", flush=True)
            results["prepare"].append(runs)
    both = [r["near+decontaminate"]["rows_per_cpu_s"] for r in results["prepare"] if r["none"]["corpus"] == "english"]
    results["target_rows_per_cpu_s"] = 50_000
    results["target_met"] = all(rate >= 50_000 for rate in both)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}; target met: {results['target_met']}")
    return results


def _child(root: Path, rows: int, filters: str, corpus: str) -> dict[str, Any]:
    import subprocess

    code = (
        f"import json, sys; sys.path[:0] = [{str(scale.REPO)!r}, {str(scale.REPO / 'bench')!r}]; import dedup, scale; "
        "import logging, resource; logging.disable(logging.WARNING); "
        f"r = dedup.measure_prepare({str(root)!r}, {rows}, {filters!r}, {corpus!r}); "
        "r['peak_rss_mb'] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1); "
        "print('@@' + json.dumps(r))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=scale.REPO)
    if done.returncode != 0:
        raise RuntimeError(f"prepare {filters} at {rows} rows of {corpus} failed:\n{done.stderr[-3000:]}")
    return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("@@"))[2:])


if __name__ == "__main__":
    main()
