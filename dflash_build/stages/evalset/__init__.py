"""The eval split (config key `eval`): the prompts prepare held out of training, and the benchmark sets,
rendered as the target is prompted, into ``dist/NAME-eval``: one row per prompt and turn, with its slice.

A held-out prompt is rendered at each of its answer slots (``turns: all``: every turn, under the dataset's
own history before it) with its source's template kwargs (a variant's included) and tools, exactly as
generate renders a first turn; a benchmark item's first text is a user turn under the config's template
kwargs, worded as z-lab's benchmark script words that set (:data:`BENCHMARK_PROMPTS`). Each row names
its slice: ``source``, ``category``, ``language`` (of the prompt, as tokenize detects it), ``variant``,
``turn`` (the answer's position in its conversation) and ``tool_context`` (the turn answers a tool
result), and carries the slice's own sampling. ``split_key``, the digest of what the rows hold, is what
``accept`` keys each drafter's measurement by.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import hashing, language
from dflash_build.plan import Plan
from dflash_build.publish import release
from dflash_build.spec import Sampling
from dflash_build.stages.common import chat, decontaminate
from dflash_build.stages.common.job import Job
from dflash_build.store import atomic, layout
from dflash_build.versions import EVAL_VERSION

log = logging.getLogger(__name__)

BENCHMARK_CATEGORY = "benchmark"
# How z-lab's benchmark script (z-lab/dflash, dflash/benchmark.py) prompts the sets drafters are judged on,
# by reference set name; a set not named here is prompted with its text as it is.
_REASON = "{text}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
BENCHMARK_PROMPTS = {
    "gsm8k": _REASON,
    "math500": _REASON,
    "humaneval": "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{text}\n```",
    "mbpp": "{text}",
    "mt_bench": "{text}",
}
DATA_FILE = "data/eval-00000.parquet"
SLICES = ("source", "category", "language", "variant", "turn", "tool_context")  # what a row's slice is
EVAL_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("category", pa.string()),
        ("language", pa.string()),
        ("variant", pa.string()),
        ("turn", pa.int32()),
        ("tool_context", pa.bool_()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("top_k", pa.int32()),
        ("min_p", pa.float64()),
        ("seed", pa.int64()),
    ]
)


def run(job: Job) -> dict[str, Any]:
    """Render every held-out prompt and benchmark item into a new version of the eval folder."""
    plan = job.plan
    record = job.output("record")
    folder = release.folder_of(record)
    tokenizer = chat.load_tokenizer(plan.config.model, plan.tokenizer_cache())
    rows = [row for source in sorted(plan.sources) for row in _held_out_rows(plan, source, tokenizer)]
    for name in plan.config.eval_benchmarks:
        rows += _benchmark_rows(plan, name, tokenizer)
    table = pa.Table.from_pylist(rows, schema=EVAL_SCHEMA)
    with release.publish(folder, record) as tmp:
        written = atomic.write_parquet(tmp / DATA_FILE, table)
        manifest = {
            "stage": "evalset",
            "scheme": EVAL_VERSION,
            "split_key": split_key(table),
            "eval_key": plan.eval_key,
            "rows": table.num_rows,
            "prompts": len(set(table.column("prompt_id").to_pylist())),
            "files": [{"path": DATA_FILE, **written}],
            "slices": slice_counts(table),
        }
        atomic.write_json(tmp / layout.MANIFEST, manifest)
    log.info("eval split: %d rows of %d prompts in %s", manifest["rows"], manifest["prompts"], folder)
    return manifest


def split_key(table: pa.Table) -> str:
    """What the rows ask an engine for, as one key: the split's identity for ``accept``."""
    rows = table.sort_by([("source", "ascending"), ("prompt_id", "ascending"), ("turn", "ascending")]).to_pylist()
    return hashing.content_key({"scheme": EVAL_VERSION, "rows": rows})


def slice_counts(table: pa.Table) -> dict[str, dict[str, int]]:
    """Rows by the value of each slice column."""
    counts: dict[str, dict[str, int]] = {}
    for column in SLICES:
        values = [str(v) for v in table.column(column).to_pylist()]
        counts[column] = {v: values.count(v) for v in sorted(set(values))}
    return counts


def read(placed: release.InPlace) -> pa.Table:
    """The rows of the eval split in place (``release.in_place(dist/NAME-eval)``)."""
    tables = [pq.read_table(f) for f in placed.files]
    return pa.concat_tables(tables) if tables else EVAL_SCHEMA.empty_table()


def _sampling_columns(sampling: Sampling) -> dict[str, Any]:
    """The sampling fields a row carries: all but the budgets (accept asks for its own) and
    samples_per_prompt (a slice is measured once a prompt)."""
    return {k: v for k, v in sampling.as_dict().items() if k in EVAL_SCHEMA.names}


def _held_out_rows(plan: Plan, source: str, tokenizer: Any) -> list[dict[str, Any]]:
    sp = plan.sources[source]
    kwargs = dict(sp.gen_components["chat_template_kwargs"])
    rows = []
    for p in pq.read_table(plan.held_out_file(source)).to_pylist():
        messages = json.loads(p["messages"])
        tools = json.loads(p["tools"]) if p["tools"] else None
        row_kwargs = {**kwargs, **(json.loads(p["template_kwargs"]) if p.get("template_kwargs") else {})}
        lang = language.of_messages(messages)
        for turn, slot in enumerate(chat.answer_slots(messages, sp.spec.turns)):
            history = messages[:slot]
            text = chat.render_text(tokenizer, history, tools, row_kwargs)
            rows.append(
                {
                    "prompt_id": p["prompt_id"],
                    "source": source,
                    "category": sp.spec.category,
                    "language": lang,
                    "variant": sp.spec.variant,
                    "turn": turn,
                    "tool_context": bool(history) and history[-1].get("role") == "tool",
                    "prompt_ids": chat.encode(tokenizer, text),
                    **_sampling_columns(sp.spec.sampling),
                }
            )
    return rows


def _benchmark_rows(plan: Plan, name: str, tokenizer: Any) -> list[dict[str, Any]]:
    cfg = plan.config
    assert cfg.decontaminate is not None, "config checks eval.benchmarks against decontaminate.references"
    reference = cfg.decontaminate.references[name]
    rows = []
    form = BENCHMARK_PROMPTS.get(name.lower().replace("-", "_"), "{text}")
    for _where, texts in decontaminate.reference_items(reference, plan.reference_files.get(name, ())):
        messages = [{"role": "user", "content": form.format(text=texts[0])}]
        text = chat.render_text(tokenizer, messages, None, dict(cfg.model.chat_template_kwargs))
        rows.append(
            {
                "prompt_id": hashing.content_key({"benchmark": name, "text": texts[0]}),
                "source": f"benchmark:{name}",
                "category": BENCHMARK_CATEGORY,
                "language": language.of_messages(messages),
                "variant": None,
                "turn": 0,
                "tool_context": False,
                "prompt_ids": chat.encode(tokenizer, text),
                **_sampling_columns(cfg.sampling),
            }
        )
    return rows
