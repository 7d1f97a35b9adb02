"""The build plan: every content key, shard count and store path, computed when the Snakefile is parsed.

Keys are known before any job runs, so ``snakemake -n`` lists every shard job. Shard counts come from
cheap row counts (parquet footers, JSONL line counts, cached by file content) capped by max_samples;
rows are assigned to shards by the order of their prompt ids, so the assignment does not depend on the
input's row order. Dropped rows make shards smaller, never fewer.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from dflash_build import hashing, keys, lsh, readers
from dflash_build.engines import registry
from dflash_build.engines.registry import loop_stop
from dflash_build.spec import LOCAL_SUFFIXES, TOOL_TURNS, Config, ConfigError, HubSpec, SourceSpec
from dflash_build.store import atomic, fingerprints, layout
from dflash_build.versions import (
    EVAL_VERSION,
    GEN_VERSION,
    LANGUAGE_VERSION,
    PREP_VERSION,
    TOK_VERSION,
    WORDS_VERSION,
)

TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tokenizer.model",
        "spiece.model",
        "chat_template.jinja",
        "chat_template.json",
    }
)


def shard_name(index: int) -> str:
    return f"{index:05d}"


@dataclass(frozen=True)
class SourcePlan:
    spec: SourceSpec
    input_files: tuple[Path, ...]
    n_shards: int
    planned_rows: int  # upper bound before prepare: raw rows capped by max_samples
    prompt_components: dict[str, Any]
    gen_components: dict[str, Any]
    tok_components: dict[str, Any]
    raw_rows: int | None = None  # rows of the input, when known before prepare
    above: tuple[str, ...] = ()  # the sources whose prompts it skips as copies (plan.ranked_above)

    @property
    def name(self) -> str:
        return self.spec.name

    @functools.cached_property
    def prompt_key(self) -> str:
        return hashing.content_key(self.prompt_components)

    @functools.cached_property
    def gen_key(self) -> str:
        return hashing.content_key(self.gen_components)

    @functools.cached_property
    def reuse_key(self) -> str:
        return keys.reuse_key(self.gen_components)

    @functools.cached_property
    def conversation_reuse_key(self) -> str:
        return keys.reuse_key(self.gen_components, conversations=True)

    @functools.cached_property
    def generation_key(self) -> str:
        return keys.generation_key(self.gen_components)

    @functools.cached_property
    def tok_key(self) -> str:
        return hashing.content_key(self.tok_components)

    @property
    def components(self) -> dict[str, dict[str, Any]]:
        """Each keyed stage's components, by the key they make (layout.KEYS)."""
        return dict(zip(layout.KEYS, (self.prompt_components, self.gen_components, self.tok_components), strict=True))

    @functools.cached_property
    def keys(self) -> dict[str, str]:
        """Each keyed stage's key, by name (layout.KEYS: ``prompt_key``, ``gen_key``, ``tok_key``)."""
        return dict(zip(layout.KEYS, (self.prompt_key, self.gen_key, self.tok_key), strict=True))

    @property
    def shards(self) -> list[str]:
        return [shard_name(i) for i in range(self.n_shards)]


@dataclass(frozen=True)
class Plan:
    config: Config
    model_fingerprint: dict[str, Any]
    template_fingerprint: dict[str, Any]
    sources: dict[str, SourcePlan]
    reference_files: dict[str, tuple[Path, ...]] = field(default_factory=dict)  # decontaminate's local files
    drafter_fingerprints: dict[str, str] = field(default_factory=dict)  # accept: each drafter's files, by name

    @functools.cached_property
    def eval_components(self) -> dict[str, Any] | None:
        """What the eval split asks an engine for (None without `eval`): each source's gen components
        less :data:`keys.NOT_IN_EVAL_KEY` (its held-out prompts by prompt key, the model, the template and
        its kwargs, the sampling without its budgets: accept asks for its own), and each benchmark's
        reference set by content with the config's kwargs and sampling, which its rows are rendered and
        sampled under."""
        cfg = self.config
        if not cfg.held_out:
            return None
        sources = {
            name: {
                **{k: v for k, v in sp.gen_components.items() if k not in keys.NOT_IN_EVAL_KEY},
                "sampling": keys.sampling_without_budgets(sp.gen_components),  # accept has its own budget
            }
            for name, sp in sorted(self.sources.items())
        }
        references = next(iter(self.sources.values())).prompt_components.get("decontaminate", {}).get("references", {})
        benchmarks = {name: references.get(name) for name in cfg.eval_benchmarks}
        if benchmarks:
            benchmarks = {
                "sets": benchmarks,
                "model": self.model_fingerprint["digest"],
                "template": self.template_fingerprint["digest"],
                "chat_template_kwargs": dict(cfg.model.chat_template_kwargs),
                "sampling": keys.sampling_without_budgets({"sampling": cfg.sampling.as_dict()}),
            }
        return {"scheme": EVAL_VERSION, "sources": sources, **keys.unless_default({"benchmarks": (benchmarks, {})})}

    @functools.cached_property
    def eval_key(self) -> str | None:
        """The eval split's key: its rule's params, so Snakemake renders it again when it changes."""
        return None if self.eval_components is None else hashing.content_key(self.eval_components)

    # This plan's store paths (from layout, which owns them).
    def stage_dir(self, stage: layout.Keyed, source: str) -> Path:
        """A keyed stage's folder of ``source`` under this plan's key."""
        assert stage.key is not None, f"{stage.name} has no key"
        return layout.stage_dir(self.config.store, stage, source, self.sources[source].keys[stage.key])

    def prompt_dir(self, source: str) -> Path:
        return self.stage_dir(layout.PROMPTS, source)

    def prompt_manifest(self, source: str) -> Path:
        return self.prompt_dir(source) / layout.MANIFEST

    def prompt_bands(self, source: str) -> Path:
        """The selected prompts' near-duplicate band keys (with dedup.near): what the mix compares across sources."""
        return self.prompt_dir(source) / layout.BANDS

    def held_out_file(self, source: str) -> Path:
        """The source's prompts held out of training (config key `eval`), beside its manifest."""
        return self.prompt_dir(source) / layout.HELD_OUT

    def held_out_bands_file(self, source: str) -> Path:
        """With eval and dedup.near: the held-out prompts' band keys, beside the manifest."""
        return self.prompt_dir(source) / layout.HELD_OUT_BANDS

    def completion_dir(self, source: str) -> Path:
        return self.stage_dir(layout.COMPLETIONS, source)

    def tokenizer_cache(self) -> Path:
        """The loaded tokenizer's cache: keyed by its files and template and by the versions of the
        libraries whose objects the pickle holds."""
        versions = {name: metadata.version(name) for name in ("transformers", "tokenizers")}
        components = {"template": self.template_fingerprint["digest"], "python": platform.python_version(), **versions}
        return layout.tokenizer_cache_file(hashing.content_key(components))

    def token_dir(self, source: str) -> Path:
        return self.stage_dir(layout.TOKENS, source)

    def journal_dir(self, source: str, shard: str) -> Path:
        return layout.journal_dir(self.config.store, self.sources[source].gen_key, shard)

    def copies_inputs(self, source: str) -> list[Path]:
        """What tells a source's generate job which of its prompts the sources ranked above it keep: their
        prompt manifests (the shards lie beside them) and, with dedup.near, their band keys and its own."""
        above = list(self.sources[source].above)
        if not above:
            return []
        manifests = [self.prompt_manifest(a) for a in above]
        bands = [self.prompt_bands(s) for s in [*above, source]] if self.config.dedup.near else []
        return manifests + bands

    def prompt_shards(self, source: str) -> list[Path]:
        return [layout.shard_file(self.prompt_dir(source), s) for s in self.sources[source].shards]

    def completion_shards(self, source: str) -> list[Path]:
        return [layout.shard_file(self.completion_dir(source), s) for s in self.sources[source].shards]

    def token_shards(self, source: str) -> list[Path]:
        return [layout.shard_file(self.token_dir(source), s) for s in self.sources[source].shards]

    def all_token_shards(self) -> list[Path]:
        return [p for s in self.sources for p in self.token_shards(s)]


# What decides a model's answers: weights (and their shard index), the config and generation config,
# remote modeling code, and the tokenizer files. A README, licence or .gitattributes decide nothing.
MODEL_CONFIG_FILES = frozenset({"config.json", "generation_config.json"})
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")
CODE_SUFFIXES = (".py",)


def is_model_file(name: str) -> bool:
    return name in MODEL_CONFIG_FILES or name in TOKENIZER_FILES or name.endswith(WEIGHT_SUFFIXES + CODE_SUFFIXES)


def model_files(path: Path) -> list[Path]:
    """The files of a model (or tokenizer) folder that decide its answers; a file path is itself."""
    if path.is_file():
        return [path]
    found = (p for p in path.rglob("*") if p.is_file() and is_model_file(p.name))
    return sorted(p for p in found if not any(part.startswith(".") for part in p.relative_to(path).parts))


def model_digest(root: Path, cache: fingerprints.FingerprintCache) -> str | None:
    """One digest of what :func:`model_files` finds in ``root``, by content; None where it finds nothing."""
    files = model_files(root)
    return hashing.digest(cache.files(files, root if root.is_dir() else root.parent)) if files else None


def fingerprint_model(config: Config, cache: fingerprints.FingerprintCache) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model fingerprint, tokenizer + chat template fingerprint).

    A folder's weights and config are hashed apart from its tokenizer files, so the manifest says which
    of the two changed. A GGUF file carries both, so both derive from its one digest.
    """
    model = config.model
    if model.revision is not None and not os.path.exists(model.path):
        weights: dict[str, Any] = {"hub": model.path, "revision": model.revision}
        template: dict[str, Any] = {"hub": model.path, "revision": model.revision}
    else:
        root = Path(model.path)
        files = model_files(root)
        if not files:
            raise ConfigError("model.path", f"'{root}' holds no model files (weights, config.json, tokenizer files)")
        digests = cache.files(files, root if root.is_dir() else root.parent)
        weights = {"files": {k: v for k, v in digests.items() if Path(k).name not in TOKENIZER_FILES}}
        template = {
            "files": {k: v for k, v in digests.items() if Path(k).name in TOKENIZER_FILES or k.endswith(".gguf")}
        }
    if model.tokenizer is not None:
        tok_root = Path(model.tokenizer)
        template = {"files": cache.files(model_files(tok_root), tok_root if tok_root.is_dir() else tok_root.parent)}
    if model.chat_template is not None:
        template = {**template, "chat_template": cache.file(model.chat_template)}
    return {"digest": hashing.digest(weights), **weights}, {"digest": hashing.digest(template), **template}


def _count_rows(path: Path, cache: fingerprints.FingerprintCache) -> int | None:
    """Rows of a local file, cached by content; None for a format we cannot count cheaply."""
    if path.suffix not in LOCAL_SUFFIXES:
        return None
    sha = cache.file(path)
    memo_key = f"rows:{sha}"
    if (hit := cache.memo(memo_key)) is not None:
        return int(hit)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        n = pq.ParquetFile(path).metadata.num_rows
    elif path.suffix == ".jsonl":
        n = readers.count_jsonl(path)
    else:
        try:
            n = len(readers.load_json(path))
        except json.JSONDecodeError as e:
            raise ConfigError("sources", f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
    cache.set_memo(memo_key, n)
    return n


def hf_local_files(hf: HubSpec, key: str) -> list[Path]:
    """The files ``datasets.load_dataset(hf.path, hf.name, split=hf.split)`` reads from a local folder.

    Resolved by ``datasets`` itself from the folder's card (``configs:``) or its file layout, so the
    plan counts exactly the rows prepare will read, and a wrong config or split fails at parse time.
    """
    import datasets

    try:
        builder = datasets.load_dataset_builder(hf.path, hf.name, data_files=hf.data_files)
    except Exception as e:  # datasets raises many types here; each names the folder or config
        raise ConfigError(key, f"local dataset '{hf.path}' (name {hf.name!r}): {e}") from e
    data_files = builder.config.data_files or {}
    if hf.split not in data_files:
        raise ConfigError(
            key,
            f"local dataset '{hf.path}' (name {hf.name!r}) has no split '{hf.split}' (splits: {sorted(data_files)})",
        )
    return sorted(Path(str(f)) for f in data_files[hf.split])


def expand_files(patterns: tuple[str, ...] | list[str], key: str) -> list[Path]:
    """Expand globs, in sorted order; a pattern that matches nothing is an error."""
    out: list[Path] = []
    for i, pattern in enumerate(patterns):
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise ConfigError(f"{key}[{i}]", f"'{pattern}' matches no file (working directory {os.getcwd()})")
        for m in matches:
            if not m.endswith(LOCAL_SUFFIXES):
                raise ConfigError(f"{key}[{i}]", f"'{m}' is not a {'/'.join(LOCAL_SUFFIXES)} file")
            out.append(Path(m))
    return out


def _source_input(
    key: str, patterns: tuple[str, ...], hf: HubSpec | None, cache: fingerprints.FingerprintCache
) -> tuple[tuple[Path, ...], dict[str, Any], int | None]:
    """(local files, content identity, raw row count or None when unknown) of a source or reference set."""
    if hf is None:
        files = expand_files(patterns, f"{key}.files")
        # Sorted digests: prepare is order-independent, so file names and order do not matter.
        identity = {"files": sorted(cache.file(f) for f in files)}
        counts = [_count_rows(f, cache) for f in files]
        return tuple(files), identity, sum(c or 0 for c in counts)
    ident: dict[str, Any] = {"name": hf.name, "split": hf.split, "data_files": hf.data_files}
    if hf.is_local:
        files = tuple(hf_local_files(hf, f"{key}.hf"))
        ident["local"] = sorted(cache.file(f) for f in files)
        counts = [_count_rows(f, cache) for f in files]
        return files, ident, None if None in counts else sum(c or 0 for c in counts)
    ident.update(hub=hf.path, revision=hf.revision)
    return (), ident, None


def _filtering(
    config: Config, cache: fingerprints.FingerprintCache
) -> tuple[dict[str, Any], dict[str, tuple[Path, ...]]]:
    """What of dedup.near and decontaminate decides every source's prompts (absent when off, so configs
    without them keep their keys), and the reference sets' local files."""
    components: dict[str, Any] = {}
    files: dict[str, tuple[Path, ...]] = {}
    if config.dedup.near is not None:
        components["near_dedup"] = lsh.components(config.dedup.near)
    if config.dedup.near is not None or config.decontaminate is not None:
        components["words"] = WORDS_VERSION
    decon = config.decontaminate
    if decon is not None:
        references = {}
        for name, ref in sorted(decon.references.items()):
            files[name], identity, _ = _source_input(f"decontaminate.references.{name}", ref.files, ref.hf, cache)
            references[name] = {"field": ref.field, "input": identity}
        components["decontaminate"] = {"ngram": decon.ngram, "references": references}
    return components, files


def components_file(store: Path, key: str) -> Path:
    return layout.components_file(store, key)


def record_components(plan: Plan) -> None:
    """Keep what each planned key is made of in the store (once per key: the file never changes)."""
    for sp in plan.sources.values():
        for name, components in sp.components.items():
            path = components_file(plan.config.store, sp.keys[name])
            if not path.exists():
                atomic.write_json(path, components)


def planned_components(store: Path, key: str) -> dict[str, Any] | None:
    """The components recorded for ``key``; None when there is no readable record."""
    try:
        return json.loads(components_file(store, key).read_text())
    except (OSError, ValueError):
        return None


def fingerprint_cache(config: Config) -> fingerprints.FingerprintCache:
    """The store's file-digest cache: parse time fills it, jobs read it instead of hashing again."""
    return fingerprints.FingerprintCache(
        layout.fingerprint_cache_file(config.store), layout.user_fingerprint_cache_file(config.store)
    )


def prompt_spec(spec: SourceSpec) -> dict[str, Any]:
    """What in a source's config changes its prompts (the ``spec`` of its prompt_key)."""
    return {
        "format": spec.format,
        "fields": dict(spec.fields),
        "roles": dict(spec.roles),
        "max_samples": spec.max_samples,
        "seed": spec.seed,
        "filters": {"min_chars": spec.min_chars, "max_chars": spec.max_chars},
        "turns": spec.turns,
        **keys.unless_default(
            {
                "chat_template_kwargs_from": ({k: v.as_dict() for k, v in spec.chat_template_kwargs_from.items()}, {}),
                "languages": (None if spec.languages is None else sorted(spec.languages), None),
                # turns: all keeps the dataset's tool calls in its answer slots (what a regenerated turn is
                # compared with) and its tool results without their <tool_response> wrapper
                "tool_turns": (TOOL_TURNS if spec.turns == "all" else None, None),
                # history: source keeps the dataset's answers in the prompts (each later turn's history)
                "history": (spec.history, "regenerated"),
                # a variant source keeps the prompts drawn to its variant: the draw table decides which
                "variant": (spec.variant if spec.draw is not None else None, None),
                "draw": (None if spec.draw is None else spec.draw.as_dict(), None),
                # config key `eval`: the prompts held out of training (by prompt id)
                "held_out": (None if spec.held_out is None else spec.held_out.as_dict(), None),
            }
        ),
    }


def _gen_components(
    config: Config,
    spec: SourceSpec,
    prompt_components: dict[str, Any],
    model_fp: dict[str, Any],
    template_fp: dict[str, Any],
    above: dict[str, str],
) -> dict[str, Any]:
    """What determines a source's completions (its gen_key); ``above``: the prompt keys of the sources
    whose prompts it skips as copies (:func:`ranked_above`)."""
    multi_turn = spec.turns == "all"
    parser = config.model.tool_call_parser
    tool_calls = {"parser": parser, "match": spec.tool_match} if multi_turn and parser else None
    stop = loop_stop(config.engine, config.degenerate)
    return {
        "scheme": GEN_VERSION,
        "prompt_key": hashing.content_key(prompt_components),
        "model": model_fp["digest"],
        "template": template_fp["digest"],
        "chat_template_kwargs": {**config.model.chat_template_kwargs, **spec.chat_template_kwargs},
        "sampling": spec.sampling.as_dict(),
        # only the options that change the numbers (each backend's descriptor decides); speed options stay out
        "engine": registry.keyed_options(config.engine.backend, config.engine.options),
        **keys.unless_default(
            {
                # how later turns are prompted; nothing for turns: first, whose rows it does not change
                "turn_samples": (spec.turn_samples if multi_turn else None, None),
                # whose answers later turns follow; in the conversations' reuse key, which leaves out the prompts
                "history": (spec.history, "regenerated"),
                # where a tool conversation goes on; a conversation without tools is reused across it
                keys.TOOL_CALLS: (tool_calls, None),
                # an explicit window changes which prompts are skipped; the model's own is fingerprinted
                "context_length": (config.model.context_length, None),
                # each row's budget, under a trainer's window
                "trainer_window": (asdict(config.trainer) if config.trainer.max_length is not None else None, None),
                # which of its prompts another source keeps, skipped before generation (keys.CROSS_SOURCE)
                keys.CROSS_SOURCE: ([[name, key] for name, key in above.items()], []),
                # a row the engine stopped on the loop rule is shorter than the one it would have written
                keys.LOOP_STOP: (stop.as_dict() if stop is not None else None, None),
                # which attempt's seed a degenerate row's answer comes from
                keys.REGENERATE: (config.degenerate.regenerating(), None),
            }
        ),
    }


def ranked_above(config: Config, source: str) -> list[str]:
    """The sources whose prompts ``source`` skips as copies before generation: those of dedup.prefer
    before it (all of them, for a source not in the list); none without dedup.across_sources.

    Only the sources a config ranks by name settle copies before generation, so adding a source (or
    editing one) that dedup.prefer does not name re-keys no other source; copies between unranked
    sources are generated by each and the mix takes one (the same rule, applied after the fact)."""
    if not config.dedup.across_sources:
        return []
    # copies are settled within a variant: one prompt under two variants is two samples by design
    variant = config.sources[source].variant
    alike = [n for n, s in config.sources.items() if s.variant == variant]
    ranked = [n for n in config.dedup.source_priority(alike) if config.sources[n].config_name in config.dedup.prefer]
    return ranked[: ranked.index(source)] if source in ranked else ranked


def build(config: Config, only: str | None = None) -> Plan:
    """Compute every key and shard count for ``config``; hashes are cached in the store.

    ``only``: plan that one source, and the sources ranked above it whose prompts it skips as copies
    (their prompt keys are part of its gen key); a shard job needs nothing of the others, and with many
    sources their inputs would cost every job a look.
    """
    if only is not None and only not in config.sources:
        raise ConfigError("sources", f"no source '{only}' in the config")
    registry.check(config.engine)  # where the engine is chosen: its options, before any job
    registry.check_serving(config)  # the model, engine.drafter and accept's drafters on this engine
    cache = fingerprint_cache(config)
    model_fp, template_fp = fingerprint_model(config, cache)
    filtering, reference_files = _filtering(config, cache)
    names = list(config.sources) if only is None else [*ranked_above(config, only), only]
    prepared = {name: _prepared(config, name, cache, filtering) for name in config.sources if name in names}
    sources = {}
    for name, (files, raw_rows, rows, prompt_components) in prepared.items():
        spec = config.sources[name]
        above = {a: hashing.content_key(prepared[a][3]) for a in ranked_above(config, name)}
        gen_components = _gen_components(config, spec, prompt_components, model_fp, template_fp, above)
        tok_components = {
            "scheme": TOK_VERSION,
            "gen_key": hashing.content_key(gen_components),
            "truncated": config.truncated,
            # which answers are no training data, and whether each is dropped (stages.common.degenerate)
            "degenerate": config.degenerate.components(),
            "language": LANGUAGE_VERSION,
        }
        n_shards = prompt_components["n_shards"]
        sources[name] = SourcePlan(
            spec, files, n_shards, rows, prompt_components, gen_components, tok_components, raw_rows, tuple(above)
        )
    drafters = fingerprint_drafters(config, cache)
    cache.save()
    return Plan(config, model_fp, template_fp, sources, reference_files, drafters)


def fingerprint_drafters(config: Config, cache: fingerprints.FingerprintCache) -> dict[str, str]:
    """Each `accept` drafter's checkpoint digest by name (ngram: none); engine.drafter's is checked only."""
    digests = {}
    named = {f"accept.drafters.{name}.path": d for name, d in (config.accept.drafters if config.accept else {}).items()}
    named |= {"engine.drafter.path": config.engine.drafter} if config.engine.drafter else {}  # checked, not keyed
    for key, drafter in named.items():
        root = None if drafter.path is None else Path(drafter.path)
        digest = None if root is None else model_digest(root, cache)
        if root is None or (digest is None and drafter.trained):  # ngram; a trained one not published yet
            continue
        if digest is None:
            raise ConfigError(key, f"'{root}' holds no model files (weights, config.json)")
        if key.startswith("accept."):
            digests[drafter.name] = digest
        _check_vocabulary(config, key, drafter.method, root)
    return digests


def vocabulary_size(path: Path) -> int | None:
    """A checkpoint folder's vocabulary size, as its config.json states it (a multimodal model's text
    config's); None where it states none."""
    try:
        conf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = conf.get("vocab_size", (conf.get("text_config") or {}).get("vocab_size"))
    return int(size) if isinstance(size, int) else None


def _check_vocabulary(config: Config, key: str, method: str, drafter: Path) -> None:
    """A drafter its engine's method needs on the target's vocabulary, checked as the engine checks it when
    its server starts (before any server, in one line)."""
    speculative = registry.get(config.engine.backend).speculative
    if speculative is None or method.upper() not in {m.upper() for m in speculative.same_vocabulary}:
        return
    target, own = vocabulary_size(Path(config.model.path)), vocabulary_size(drafter)
    if target is not None and own is not None and target != own:
        raise ConfigError(
            key,
            f"'{drafter}' has a vocabulary of {own} tokens and the target {config.model.path} one of {target}: "
            f"the {method} method drafts in the target's vocabulary (the engine refuses it); use a drafter "
            "trained with the target's tokenizer",
        )


def _prepared(
    config: Config, name: str, cache: fingerprints.FingerprintCache, filtering: dict[str, Any]
) -> tuple[tuple[Path, ...], int | None, int, dict[str, Any]]:
    """(input files, raw row count, planned rows, prompt components) of one source."""
    spec = config.sources[name]
    files, identity, raw_rows = _source_input(f"sources.{name}", spec.files, spec.hf, cache)
    rows = raw_rows if spec.max_samples is None else min(spec.max_samples, raw_rows or spec.max_samples)
    if rows is not None and spec.drawn_share is not None:
        # the variant's part of the parent's selection (the draw is uniform over prompt ids)
        rows = math.ceil(rows * spec.drawn_share)
    if rows is None:
        raise ConfigError(
            f"sources.{name}.max_samples",
            "the row count of an 'hf' source is not known before loading it; set max_samples "
            "(it also fixes the shard count, so `snakemake -n` can list every shard)",
        )
    prompt_components = {
        "scheme": PREP_VERSION,
        "source": name,
        "category": spec.category,
        "spec": prompt_spec(spec),
        "input": identity,
        "n_shards": max(1, math.ceil(rows / config.shard_size)),
        **filtering,
        **({"language": LANGUAGE_VERSION} if spec.languages is not None else {}),
    }
    return files, raw_rows, rows, prompt_components
