"""Fill efficiency and speed of the pack stage's packer against naive concatenation in file order.

One million synthetic sample lengths drawn like the target data (log-normal, mean ~2,068 tokens, P90
~4,200, capped at the answer limit of 8,192), packed at seq_len 8,192 / 16,384 / 32,768:

- ours: ``dflash_build.stages.pack.plan_rows`` as the stage runs it (seeded order, windows of 100,000 samples,
  longest-first fill of each row), on one core;
- baseline: greedy concatenation in file order (a row is closed when the next sample does not fit),
  measured in the same run.

Fill = real tokens / (rows × seq_len). Targets (issue 15): ≥ 98% fill at 16,384 and under a minute per
million samples. Prints a table and writes bench/results/pack_fill.json.

    python bench/pack_fill.py [--samples 1000000]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_build.spec import PackSpec  # noqa: E402
from dflash_build.stages.pack import plan_rows  # noqa: E402

MEAN, P90, CAP = 2068, 4200, 8192


def synthetic_lengths(n: int, seed: int = 0) -> list[int]:
    """Log-normal lengths with the target's mean and P90, capped at the answer limit."""
    sigma = (math.log(P90) - math.log(MEAN)) / 1.2816 + 0.3  # + the cap's pull on the mean
    mu = math.log(MEAN) - sigma**2 / 2
    rng = random.Random(seed)
    return [max(1, min(CAP, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def naive_rows(lengths: list[int], seq_len: int) -> int:
    rows, used = 0, seq_len + 1
    for n in lengths:
        if used + n > seq_len:
            rows, used = rows + 1, 0
        used += n
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1_000_000)
    args = parser.parse_args()
    lengths = synthetic_lengths(args.samples)
    ranks = [f"{random.Random(i).getrandbits(64):016x}" for i in range(len(lengths))]
    total = sum(lengths)
    p90 = sorted(lengths)[int(0.9 * len(lengths))]
    print(f"{len(lengths)} samples: mean {statistics.mean(lengths):.0f}, P90 {p90}, max {max(lengths)} tokens")
    results = {"samples": len(lengths), "mean": round(statistics.mean(lengths), 1), "p90": p90, "runs": []}
    print(f"{'seq_len':>8} {'ours fill':>10} {'naive fill':>11} {'ours rows':>10} {'naive rows':>11} {'ours s':>7}")
    for seq_len in (8192, 16384, 32768):
        started = time.process_time()
        rows, counts = plan_rows(lengths, ranks, PackSpec(seq_len=seq_len))
        seconds = time.process_time() - started
        packed = total - counts.get("dropped_long_tokens", 0)
        ours = packed / (len(rows) * seq_len)
        naive_count = naive_rows(lengths, seq_len)
        naive = total / (naive_count * seq_len)
        print(f"{seq_len:>8} {ours:>10.2%} {naive:>11.2%} {len(rows):>10} {naive_count:>11} {seconds:>7.1f}")
        results["runs"].append(
            {
                "seq_len": seq_len,
                "fill": round(ours, 5),
                "naive_fill": round(naive, 5),
                "fill_ratio_vs_naive": round(ours / naive, 4),
                "rows": len(rows),
                "naive_rows": naive_count,
                "cpu_seconds": round(seconds, 2),
            }
        )
    out = REPO / "bench" / "results" / "pack_fill.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written to {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
