"""The key contract: every config field and engine option, whether it enters a key, and why.

A store path's key must name everything that decides the bytes under it, and nothing else: a field
that changes what the model writes but stays out of the key mixes stale rows into a build; a field
that enters a key but changes nothing regenerates GPU-days of data for no reason. Each field below
carries its decision. ``tests/test_keys.py`` walks ``config/schema.yaml`` and every backend's accepted
options and fails when one has no decision here, so a new field cannot be added without one.

A decision names the first key the field enters; every key downstream follows (prompt_key is part of
gen_key, gen_key of tok_key). ``None``: in no key (recorded in the stats sidecars where it matters).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PROMPT = "prompt_key"
GEN = "gen_key"
TOK = "tok_key"


@dataclass(frozen=True)
class Decision:
    key: str | None
    why: str


def _d(key: str | None, why: str) -> Decision:
    return Decision(key, why)


_MIX = "the dataset folder is not content-addressed: Snakemake's params trigger reruns the mix"
_CHECK = "decides whether a build passes, never what it writes"
_WHERE = "where files go or how jobs are scheduled, not what they hold"
_SAMPLING = "changes the distribution of answers"

# Every field of config/schema.yaml; `sources.*` stands for each source.
CONFIG_FIELDS: dict[str, Decision] = {
    "store": _d(None, _WHERE),
    "logs": _d(None, _WHERE),
    "dataset.name": _d(None, _MIX),
    "dataset.out": _d(None, _MIX),
    "dataset.rows_per_file": _d(None, _MIX),
    "model.path": _d(GEN, "by content, not by path: weights, config.json, generation_config.json, tokenizer files"),
    "model.revision": _d(GEN, "a hub model is identified by id and pinned commit"),
    "model.tokenizer": _d(GEN, "by content: what the model is shown"),
    "model.chat_template": _d(GEN, "by content: what the model is shown"),
    "model.chat_template_kwargs": _d(GEN, "e.g. enable_thinking changes the prompt"),
    "model.context_length": _d(GEN, "decides which prompts are skipped"),
    "engine.backend": _d(None, "backends sample the same distribution; their numerics options are keyed below"),
    "engine.options": _d(None, "per backend and option: ENGINE_OPTIONS"),
    "engine.gpus": _d(None, _WHERE),
    "engine.lock_dir": _d(None, _WHERE),
    "engine.gpu_wait_seconds": _d(None, _WHERE),
    "engine.base_port": _d(None, _WHERE),
    "engine.journal_flush_rows": _d(None, "how often finished rows are synced, not which"),
    "engine.journal_flush_seconds": _d(None, "how often finished rows are synced, not which"),
    "sampling.temperature": _d(GEN, _SAMPLING),
    "sampling.top_p": _d(GEN, _SAMPLING),
    "sampling.top_k": _d(GEN, _SAMPLING),
    "sampling.min_p": _d(GEN, _SAMPLING),
    "sampling.max_new_tokens": _d(GEN, "the answer limit (rows reuse across it by prefix, see rowindex)"),
    "sampling.seed": _d(GEN, "every row's seed derives from it"),
    "sampling.samples_per_prompt": _d(GEN, "how many answers each prompt gets"),
    "shard_size": _d(PROMPT, "fixes the shard count, so which prompts share a shard"),
    "truncated": _d(TOK, "whether truncated answers become samples"),
    "mix.categories": _d(None, _MIX),
    "mix.budget_tokens": _d(None, _MIX),
    "mix.seed": _d(None, _MIX),
    "checks.max_drop_fraction": _d(None, _CHECK),
    "checks.max_failed_fraction": _d(None, _CHECK),
    "checks.share_tolerance": _d(None, _CHECK),
    "checks.allow_shortfall": _d(None, _CHECK),
    "sources.*": _d(PROMPT, "the source's name is a store path segment and a column of every row"),
    "sources.*.category": _d(PROMPT, "a column of every row"),
    "sources.*.hf": _d(PROMPT, "hub id, config, split and pinned commit, or a local folder's file digests"),
    "sources.*.files": _d(PROMPT, "by content digests, not names or order"),
    "sources.*.format": _d(PROMPT, "how rows become prompts"),
    "sources.*.fields": _d(PROMPT, "how rows become prompts"),
    "sources.*.roles": _d(PROMPT, "how rows become prompts"),
    "sources.*.turns": _d(PROMPT, "how rows become prompts"),
    "sources.*.max_samples": _d(PROMPT, "which prompts are kept"),
    "sources.*.seed": _d(PROMPT, "which prompts max_samples keeps"),
    "sources.*.filters.min_chars": _d(PROMPT, "which prompts are kept"),
    "sources.*.filters.max_chars": _d(PROMPT, "which prompts are kept"),
    "sources.*.sampling": _d(GEN, _SAMPLING),
    "sources.*.chat_template_kwargs": _d(GEN, "e.g. enable_thinking changes the prompt"),
    "sources.*.max_drop_fraction": _d(None, _CHECK),
}

_NUMERICS = "changes the numbers the model computes, so the answers"
_SPEED = "changes speed or memory only"
ENGINE_OPTIONS: dict[str, dict[str, Decision]] = {
    "transformers": {
        "dtype": _d(GEN, _NUMERICS),
        "device": _d(None, "the same computation on another device; dtype is keyed"),
        "batch_size": _d(None, "each row samples from its own seeds, whatever its batch"),
        "threads": _d(None, _SPEED),
    },
    "sglang": {
        "dtype": _d(GEN, _NUMERICS),
        "quantization": _d(GEN, _NUMERICS),
        "kv_cache_dtype": _d(GEN, _NUMERICS),
        "context_length": _d(GEN, "what the engine accepts and refuses"),
        "enable_deterministic_inference": _d(GEN, "whether the row seeds decide the answers"),
        "random_seed": _d(GEN, "the engine's own random state, which decides answers without deterministic mode"),
        "attention_backend": _d(None, "kernels of the same computation; rounding differs, the distribution does not"),
        "mem_fraction_static": _d(None, _SPEED),
        "max_running_requests": _d(None, _SPEED),
        "chunked_prefill_size": _d(None, _SPEED),
        "cuda_graph_max_bs": _d(None, _SPEED),
        "schedule_conservativeness": _d(None, _SPEED),
        "disable_radix_cache": _d(None, _SPEED),
        "disable_cuda_graph": _d(None, _SPEED),
        "log_level": _d(None, "logging only"),
        "trust_remote_code": _d(None, "the remote code itself is fingerprinted with the model (*.py)"),
        "max_inflight": _d(None, _SPEED),
    },
    "openai": {
        "prompt": _d(GEN, "token ids or re-tokenized text: what the server's model is shown"),
        "urls": _d(None, "which servers; the model they serve is checked against model.path"),
        "api": _d(None, "the same ids and sampling params through another endpoint"),
        "model": _d(None, "the name requests carry; the server's identity is checked against model.path"),
        "expect_model": _d(None, "the name a server reports for model.path's weights: an identity check only"),
        "concurrency": _d(None, _SPEED),
        "timeout": _d(None, "fault handling only"),
        "retries": _d(None, "fault handling only"),
        "backoff": _d(None, "fault handling only"),
        "max_backoff": _d(None, "fault handling only"),
    },
}

# Effective defaults of keyed options, so that spelling out a default changes no key.
_DEFAULTS: dict[str, dict[str, Any]] = {"openai": {"prompt": "auto"}}


def transformers_dtype(options: Mapping[str, Any]) -> str:
    """The transformers backend's dtype: float32 on CPU, bfloat16 on a GPU, unless set."""
    return str(options.get("dtype", "float32" if str(options.get("device", "cpu")) == "cpu" else "bfloat16"))


def keyed_engine_options(backend: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The engine options that enter gen_key, with their effective values."""
    table = ENGINE_OPTIONS.get(backend, {})
    values = {**_DEFAULTS.get(backend, {}), **options}
    if backend == "transformers":
        values["dtype"] = transformers_dtype(options)
    return {k: v for k, v in sorted(values.items()) if k in table and table[k].key == GEN}
