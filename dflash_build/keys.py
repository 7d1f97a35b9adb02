"""The key contract: every config field and engine option, whether it enters a key, and why.

A store path's key must name everything that decides the bytes under it, and nothing else: a field
that changes what the model writes but stays out of the key mixes stale rows into a build; a field
that enters a key but changes nothing regenerates GPU-days of data for no reason. Each field below
carries its decision. ``tests/test_keys.py`` walks ``config/schema.yaml`` and fails when a field has no
decision here, so a new field cannot be added without one. Engine options are decided by each backend's
own descriptor (:mod:`dflash_build.engines.registry`, an ``Option`` per name), which the same test walks.

A decision names the first key the field enters; every key downstream follows (prompt_key is part of
gen_key, gen_key of tok_key; both, less :data:`NOT_IN_EVAL_KEY`, of the eval split's eval_key). ``None``:
in no key (recorded in the stats sidecars where it matters).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dflash_build import hashing
from dflash_build.versions import ACCEPT_VERSION, CALIBRATION_VERSION, TRAIN_VERSION

# The keys, one per keyed stage (store.layout's table names each stage's): each includes the one before.
PROMPT = "prompt_key"
GEN = "gen_key"
TOK = "tok_key"
# The gen component naming the sources ranked above a source (dedup.across_sources), with their prompt
# keys: which of its prompts are copies another source keeps, skipped before any GPU time.
CROSS_SOURCE = "cross_source"
# The gen component of a turns: all source under model.tool_call_parser: the parser and tool_match,
# which decide where a tool conversation goes on. A conversation without tools does not depend on it.
TOOL_CALLS = "tool_calls"
# The gen component of a build whose engine stops a looping row (config degenerate.loop.stop_early): the
# rule, which decides where such a row ends. Not in the reuse key: a row is checked against it as reused.
LOOP_STOP = "loop_stop"
# The gen component of a build that asks a degenerate row again (a degenerate policy regenerate): the
# reasons, the bound and the detector's settings, which decide which seed a row's answer comes from.
REGENERATE = "regenerate"

# What gen_key holds that is not how a row is generated: the prompt set, which of it other sources keep,
# and the budgets (a row generated under another max_new_tokens or window is cut or continued;
# samples_per_prompt only adds rows).
NOT_IN_GENERATION_KEY = ("prompt_key", CROSS_SOURCE, "trainer_window")
SAMPLING_NOT_IN_REUSE_KEY = ("max_new_tokens", "samples_per_prompt")
# What a request to the engine is, apart from what each row holds itself (its prompt token ids and its
# seed) and its budget: the model, the engine options that change the numbers, and the sampling (the
# base seed included, from which every row's seed derives).
REQUEST_COMPONENTS = ("model", "engine", "sampling")
# The eval split's key (config key `eval`): what its rows ask an engine for. Each source's gen components
# enter it, less these, which change how a build generates or which rows it keeps but never a held-out
# prompt's render or sampling: the split is rendered from the held-out prompts with the template at each
# answer slot, under the source's sampling, whatever the engine's numerics (accept_key has those), the
# window, the parser, the turn_samples policy or the copies another source keeps.
EVAL = "eval_key"
NOT_IN_EVAL_KEY = (
    *("engine", "trainer_window", "context_length", TOOL_CALLS, "turn_samples", CROSS_SOURCE),
    *(LOOP_STOP, REGENERATE),
)


def sampling_without_budgets(components: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in components["sampling"].items() if k not in SAMPLING_NOT_IN_REUSE_KEY}


def reuse_key(gen_components: Mapping[str, Any], conversations: bool = False) -> str:
    """The key the row index finds earlier rows under: what the engine is asked besides each row's own
    prompt ids, seed and budget (:data:`REQUEST_COMPONENTS`). A row found under it is reused when its
    prompt ids and seed are the ones this build would send and its answer is what the engine returns
    under this build's stop ids and budget (``stages.generate.reuse`` checks each): GPU time goes only to
    requests no engine has answered, whatever re-keyed them (a template edit no prompt uses, a scheme
    bump). The one rule, for a plan and for a sidecar's recorded components alike.

    ``conversations``: the key of ``turns: all`` rows, which are reused turn by turn from the first
    while each turn's request is the same (its prompt on the history, its seed, its budget)."""
    parts = {k: gen_components[k] for k in REQUEST_COMPONENTS}
    parts["sampling"] = sampling_without_budgets(gen_components)
    return hashing.content_key({"conversations": parts} if conversations else parts)


def generation_key(gen_components: Mapping[str, Any]) -> str:
    """gen_key without the prompt set and the budgets: rows under one generation key were generated with
    the same settings (template, template kwargs, scheme, turns policy); one reused across two of them
    is counted apart (a template, prepare or scheme change that left its request as it was)."""
    parts = {k: v for k, v in gen_components.items() if k not in NOT_IN_GENERATION_KEY}
    parts["sampling"] = sampling_without_budgets(gen_components)
    return hashing.content_key(parts)


# An acceptance measurement's key (config `accept`, ``store/acceptance/KEY``): the target and the engine's
# numerics (``measurements.engine_components``), the drafter, the eval split (its split_key, the digest of
# its rows), the measurement's budget and the degenerate rule that leaves answers out of τ. Not a stage's
# folder key: no dataset row depends on it.
ACCEPT = "accept_key"


def accept_key(
    engine: Mapping[str, Any],
    drafter: Mapping[str, Any],
    split_key: str,
    max_new_tokens: int,
    degenerate: Mapping[str, Any],
) -> str:
    """One drafter's measurement: ``drafter`` has its method, fingerprint and options."""
    return hashing.content_key(
        {
            "scheme": ACCEPT_VERSION,
            **engine,
            "method": drafter["method"],
            "drafter": drafter["fingerprint"],
            "options": dict(drafter["options"]),
            "split": split_key,
            "max_new_tokens": max_new_tokens,
            "degenerate": dict(degenerate),
        }
    )


def train_key(dataset: str, target: str, trainer: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """A drafter trained on a dataset: the dataset version (its manifest's digest, which lists every file's),
    the target's fingerprint, the trainer (name, pinned release, recipe) and the settings that change the
    weights (the trainer's descriptor says which)."""
    return hashing.content_key(
        {"scheme": TRAIN_VERSION, "dataset": dataset, "target": target, **trainer, "settings": dict(settings)}
    )


def calibration_key(engine: Mapping[str, Any], calibration: Mapping[str, Any], split_key: str) -> str:
    """The engine's calibration on a split (``calibration``: its rows, budget and draft tokens)."""
    return hashing.content_key(
        {"scheme": CALIBRATION_VERSION, "calibration": dict(calibration), **engine, "split": split_key}
    )


def unless_default(optional: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The one rule for a key's optional components (``name: (value, default)``): each enters with its
    value unless that is its default, so a config that does not use a feature keeps the key it had before
    the feature existed, and a feature that does not apply to a source (a value of None) names nothing."""
    return {name: value for name, (value, default) in optional.items() if value != default}


@dataclass(frozen=True)
class Decision:
    key: str | None
    why: str


def _d(key: str | None, why: str) -> Decision:
    return Decision(key, why)


_MIX = "the dataset folder is not content-addressed: Snakemake's params trigger reruns the mix"
_CHECK = "decides whether a build passes, never what it writes"
_PACK = "only the packed folder: its name carries seq_len, the params trigger reruns it, pack_key names it"
_WHERE = "where files go or how jobs are scheduled, not what they hold"
_EXPORT = "only that export's folder: the params trigger reruns it, export_key names it"
_SAMPLING = "changes the distribution of answers"
_PREFLIGHT = "how many rows a check before the build generates (the build's own, under its keys) and when it fails"
_TRAIN = "only the trained drafter: keyed by its own train_key (keys.train_key)"
_ACCEPT = "only the acceptance report: each drafter's result is keyed by its own accept_key (keys.accept_key)"

_DEGENERATE = (
    "which answers are no training data, and whether each is dropped (tokenize's verdict); with a policy "
    "regenerate, generate's too (keys.REGENERATE)"
)
_DEGENERATE_FIELDS = (
    *("repetitive.policy", "repetitive.ngram", "repetitive.min_distinct", "repetitive.min_tokens"),
    *("unclosed_reasoning.policy", "empty.policy", "reasoning_markers"),
)
_LOOP_STOP = (
    "where the backend stops rows (Backend.stops_loops) and a loop is dropped, the rule decides where a looping "
    "row ends (keys.LOOP_STOP; not in the reuse key: an earlier row is checked against the rule as it is reused); "
    "elsewhere only tokenize's verdict (tok)"
)

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
    "model.tool_call_parser": _d(
        GEN,
        "turns: all sources: where a tool conversation goes on (its calls read as the server reads them); "
        "the conversations export's params name it too",
    ),
    "engine.backend": _d(None, "backends sample the same distribution; their numerics options are keyed below"),
    "engine.options": _d(None, "per backend and option: its descriptor's Option (engines.registry)"),
    "engine.gpus": _d(None, _WHERE),
    "engine.lock_dir": _d(None, _WHERE),
    "engine.gpu_wait_seconds": _d(None, _WHERE),
    "engine.base_port": _d(None, _WHERE),
    "engine.journal_flush_rows": _d(None, "how often finished rows are synced, not which"),
    "engine.journal_flush_seconds": _d(None, "how often finished rows are synced, not which"),
    "engine.shared": _d(None, "the same engine, started once instead of per job (answers are the same)"),
    "engine.jobs_per_engine": _d(None, "how many jobs feed one engine: scheduling only"),
    "engine.idle_timeout": _d(None, "when an unused shared engine stops"),
    "engine.start_timeout": _d(None, "how long a job waits for an engine to start"),
    "engine.stall_timeout": _d(None, "when a job warns that its engine stopped answering: fault handling"),
    "engine.drafter": _d(
        None,
        "drafts verified by the target's own rejection sampling: the target's distribution, so a row is reused "
        "whatever drafter served it; refused where the pinned engine is shown to get that sampling wrong",
    ),
    "sampling.temperature": _d(GEN, _SAMPLING),
    "sampling.top_p": _d(GEN, _SAMPLING),
    "sampling.top_k": _d(GEN, _SAMPLING),
    "sampling.min_p": _d(GEN, _SAMPLING),
    "sampling.max_new_tokens": _d(GEN, "the answer limit (rows reuse across it by prefix, see rowindex)"),
    "sampling.seed": _d(GEN, "every row's seed derives from it"),
    "sampling.samples_per_prompt": _d(GEN, "how many answers each prompt gets"),
    "train.trainer": _d(None, _TRAIN),
    "train.recipe": _d(None, _TRAIN),
    "train.target": _d(None, _TRAIN + " (by the target's content)"),
    "train.settings": _d(None, _TRAIN + " (those that change the weights, by the trainer's descriptor)"),
    "train.python": _d(None, "where the trainer runs: its pinned release is checked there, and keyed"),
    "train.gpus": _d(None, _WHERE),
    "trainer.max_length": _d(GEN, "each row's budget: no token past the window (rows reuse across it by prefix)"),
    "trainer.min_new_tokens": _d(GEN, "decides which prompts the window skips (keyed with the window only)"),
    "variants": _d(
        PROMPT,
        "each variant is a source of its own (SOURCE@VARIANT): its name and the draw table (shares, every) "
        "decide which prompts it holds; its sampling and chat_template_kwargs enter only its own gen key "
        "(tolerance: in none, a check)",
    ),
    "shard_size": _d(PROMPT, "fixes the shard count, so which prompts share a shard"),
    "truncated": _d(TOK, "whether truncated answers become samples"),
    **{f"degenerate.{name}": _d(TOK, _DEGENERATE) for name in _DEGENERATE_FIELDS},
    **{f"degenerate.loop.{name}": _d(GEN, _LOOP_STOP) for name in ("policy", "max_period", "min_repeats", "min_span")},
    "degenerate.loop.stop_early": _d(GEN, _LOOP_STOP),
    "degenerate.retries": _d(
        GEN, "with a policy regenerate, which attempt's seed a row's answer comes from (keys.REGENERATE)"
    ),
    "mix.categories": _d(None, _MIX),
    "mix.budget_tokens": _d(None, _MIX),
    "mix.seed": _d(None, _MIX),
    "mix.languages": _d(None, _MIX),
    "mix.by_acceptance": _d(None, _MIX),
    "mix.generate": _d(None, "how far down its shards a source is generated: which shards exist, never a shard's key"),
    "pack.seq_len": _d(None, _PACK),
    "pack.split_long": _d(None, _PACK),
    "pack.pad": _d(None, _PACK),
    "pack.pad_token_id": _d(None, _PACK),
    "pack.seed": _d(None, _PACK),
    "pack.window": _d(None, _PACK),
    "export.specforge.max_length": _d(None, _EXPORT),
    "export.specforge.long": _d(None, _EXPORT),
    "export.specforge.min_loss_tokens": _d(None, _EXPORT),
    "export.specforge.consecutive": _d(None, _EXPORT),
    "export.specforge.shard_rows": _d(None, _EXPORT),
    "export.speculators.max_length": _d(None, _EXPORT),
    "export.speculators.long": _d(None, _EXPORT),
    "export.speculators.min_loss_tokens": _d(None, _EXPORT),
    "export.speculators.consecutive": _d(None, _EXPORT),
    "export.speculators.shard_rows": _d(None, _EXPORT),
    "export.conversations.shard_rows": _d(None, _EXPORT),
    "export.conversations.think": _d(None, _EXPORT),
    "dedup.near.threshold": _d(PROMPT, "which near-copies are dropped (it sets the LSH bands, keyed with it)"),
    "dedup.near.ngram": _d(PROMPT, "which near-copies are dropped: the shingles compared"),
    "dedup.near.num_perm": _d(PROMPT, "which near-copies are dropped: the signature's length"),
    "dedup.near.seed": _d(PROMPT, "which near-copies are dropped: the MinHash permutations"),
    "dedup.across_sources": _d(
        GEN,
        "a source skips, before generation, the prompts (and near-copies) a source ranked above it keeps: "
        "the prompt keys of those sources are in its gen key (plan.ranked_above); rows it has are reused",
    ),
    "dedup.prefer": _d(GEN, "which sources rank above a source, so which of its prompts it skips as copies"),
    "decontaminate.ngram": _d(PROMPT, "which prompts count as contaminated"),
    "decontaminate.references": _d(PROMPT, "by content, like sources: file digests or hub id and pinned commit"),
    "eval.share": _d(PROMPT, "which prompts are held out of training (by prompt id): every source's prompts"),
    "eval.cap": _d(PROMPT, "which prompts are held out of training (by prompt id): every source's prompts"),
    "eval.benchmarks": _d(EVAL, "which reference sets the eval split renders (by content, as decontaminate's)"),
    "accept.drafters": _d(None, _ACCEPT),
    "accept.max_new_tokens": _d(None, _ACCEPT),
    "accept.engine_options": _d(None, _ACCEPT),
    "accept.weakest": _d(None, _ACCEPT),
    "accept.calibration": _d(None, "only the calibration's own measurement, keyed by it (stages.accept)"),
    "checks.max_drop_fraction": _d(None, _CHECK),
    "checks.max_failed_fraction": _d(None, _CHECK),
    "checks.share_tolerance": _d(None, _CHECK),
    "checks.allow_shortfall": _d(None, _CHECK),
    "checks.min_free_gb": _d(None, _CHECK),
    "preflight.rows": _d(None, _PREFLIGHT),
    "preflight.speed_rows": _d(None, _PREFLIGHT),
    "preflight.max_length_share": _d(None, _PREFLIGHT),
    "preflight.parity_allowance": _d(None, _PREFLIGHT),
    "preflight.skip_parity": _d(
        None, "whether generate builds with engine.drafter without its parity verdict (a line in the card)"
    ),
    "sources.*": _d(PROMPT, "the source's name is a store path segment and a column of every row"),
    "sources.*.category": _d(PROMPT, "a column of every row"),
    "sources.*.hf": _d(PROMPT, "hub id, config, split and pinned commit, or a local folder's file digests"),
    "sources.*.files": _d(PROMPT, "by content digests, not names or order"),
    "sources.*.format": _d(PROMPT, "how rows become prompts"),
    "sources.*.fields": _d(PROMPT, "how rows become prompts"),
    "sources.*.roles": _d(PROMPT, "how rows become prompts"),
    "sources.*.turns": _d(PROMPT, "how rows become prompts"),
    "sources.*.turn_samples": _d(
        GEN, "how later turns are prompted: the engine's ids in one sequence, or the template's render of the history"
    ),
    "sources.*.tool_match": _d(GEN, "turns: all with a tool_call_parser: whether a tool conversation goes on"),
    "sources.*.history": _d(
        PROMPT,
        "turns: all: source keeps the dataset's answers in the prompts (each turn's history); a gen component "
        "too, so a conversation is reused only under the same history",
    ),
    "sources.*.chat_template_kwargs_from": _d(PROMPT, "each row's kwargs are a column of its prompt and in its id"),
    "sources.*.max_samples": _d(PROMPT, "which prompts are kept"),
    "sources.*.weight": _d(None, "how far down its shards a source is generated (mix.generate: as_needed)"),
    "sources.*.languages": _d(PROMPT, "which prompts are kept (with the detector's version; absent when unset)"),
    "sources.*.seed": _d(PROMPT, "which prompts max_samples keeps"),
    "sources.*.filters.min_chars": _d(PROMPT, "which prompts are kept"),
    "sources.*.filters.max_chars": _d(PROMPT, "which prompts are kept"),
    "sources.*.sampling": _d(GEN, _SAMPLING),
    "sources.*.chat_template_kwargs": _d(GEN, "e.g. enable_thinking changes the prompt"),
    "sources.*.max_drop_fraction": _d(None, _CHECK),
    "sources.*.variants": _d(PROMPT, "as the top-level variants, for this source's variants only"),
}


# -- what changed between two keys' components (explain, and a job whose key moved) ---------------
def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested components as dotted names: {"sampling": {"seed": 0}} → {"sampling.seed": 0}."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per component that differs: ``name: old → new``."""
    a, b = flatten(old), flatten(new)
    return [
        f"{k}: {json.dumps(a.get(k))} → {json.dumps(b.get(k))}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k)
    ]
