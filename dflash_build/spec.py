"""The config as typed, frozen values, and the error that names a config key: a leaf of the package.

:mod:`dflash_build.config` builds these from a validated config file; every other module reads them.
Nothing here imports another module of the package.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_new_tokens", "seed", "samples_per_prompt")
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


class ConfigError(ValueError):
    """A config value is wrong; the message names the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key '{key}': {message}")
        self.key = key


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int
    seed: int
    samples_per_prompt: int

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in SAMPLING_FIELDS}


@dataclass(frozen=True)
class HubSpec:
    path: str
    name: str | None
    split: str
    revision: str | None
    data_files: str | list[str] | None

    @property
    def is_local(self) -> bool:
        return os.path.isdir(self.path)


TOOL_TURNS = 1  # how turns: all prepares tool conversations (plan.prompt_spec); bump when it changes
TOOL_MATCHES = ("arguments", "name")

# How ``turns: all`` makes samples of a conversation. sequence: one sample, each turn's prompt the ids
# before it + the template's ids in between (needs a template that writes history as a prefix of the
# next prompt); per_turn: one sample per turn, its prompt the template's own render of the history so
# far; auto: sequence while the template is prefix-stable for the conversation, else per_turn.
TURN_SAMPLES = ("auto", "sequence", "per_turn")
# Whose earlier answers a later turn of ``turns: all`` is prompted on. regenerated: the target's own
# (a tool conversation goes on while its calls are the dataset's); source: the dataset's, as it has
# them, so every assistant turn is a sample on its own history, whatever the target answered before.
HISTORIES = ("regenerated", "source")


@dataclass(frozen=True)
class TemplateKwargFrom:
    """One chat-template kwarg read from each row: ``field``'s value, through ``map`` when given."""

    field: str
    map: Mapping[str, Any] | None = None
    default: Any = None  # for rows without the field; None: such a row is dropped and counted

    def as_dict(self) -> dict[str, Any]:
        return {"field": self.field, "map": None if self.map is None else dict(self.map), "default": self.default}


# A source with sampling variants (config ``variants``) is expanded into one source per variant, named
# PARENT@VARIANT: ``@`` is outside the source-name pattern, so no config source can take that name.
VARIANT_SEPARATOR = "@"


def variant_source_name(parent: str, variant: str) -> str:
    return f"{parent}{VARIANT_SEPARATOR}{variant}"


def parent_name(source: str) -> str:
    """The config source a source name belongs to: PARENT of PARENT@VARIANT, else the name itself."""
    return source.split(VARIANT_SEPARATOR)[0]


def trained_drafter_of(dataset_dir: Path) -> Path:
    """The drafter the train stage trains on a dataset folder: beside it."""
    return dataset_dir.with_name(f"{dataset_dir.name}-drafter")


def acceptance_report_of(dataset_dir: Path) -> Path:
    """The acceptance report of a dataset folder: beside it (a registered dataset's, too)."""
    return dataset_dir.with_name(f"{dataset_dir.name}-acceptance")


@dataclass(frozen=True)
class VariantDraw:
    """How a source's prompts are split among its variants: ``shares`` (variant -> weight, normalised)
    draws one variant a prompt; each variant of ``every`` takes every prompt."""

    shares: Mapping[str, float]
    every: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"shares": dict(sorted(self.shares.items())), "every": sorted(self.every)}

    def share(self, variant: str) -> float | None:
        """The part of the prompts drawn to ``variant``; None for a variant that takes every prompt."""
        return self.shares[variant] / sum(self.shares.values()) if variant in self.shares else None


@dataclass(frozen=True)
class HeldOut:
    """Config key `eval`: the prompts of each source held out of training, to measure a drafter on
    (``stages.prepare.identity.held_out``: by prompt id, a ``share`` of them, at most ``cap``)."""

    share: float
    cap: int

    def as_dict(self) -> dict[str, Any]:
        return {"share": self.share, "cap": self.cap}


@dataclass(frozen=True)
class SourceSpec:
    name: str
    category: str
    format: str
    files: tuple[str, ...]
    hf: HubSpec | None
    fields: Mapping[str, str]
    roles: Mapping[str, str]
    max_samples: int | None
    seed: int
    min_chars: int
    max_chars: int | None
    sampling: Sampling
    chat_template_kwargs: Mapping[str, Any]
    turns: str = "first"
    max_drop_fraction: float = 0.2  # prepare fails when more rows than this are dropped for defects
    turn_samples: str = "auto"  # turns: all only; see TURN_SAMPLES
    # template kwarg -> where each row's value comes from (see TemplateKwargFrom)
    chat_template_kwargs_from: Mapping[str, TemplateKwargFrom] = field(default_factory=dict)
    languages: tuple[str, ...] | None = None  # keep only prompts in these languages (dflash_build.language)
    weight: float | None = None  # mix.generate as_needed: share of its category's target (None: by supply)
    tool_match: str = "arguments"  # turns: all with tools: when a regenerated turn's calls are the dataset's
    history: str = "regenerated"  # turns: all only; see HISTORIES
    # a variant source (PARENT@VARIANT): its variant's name, its parent's name, the parent's draw table
    variant: str | None = None
    parent: str | None = None
    draw: VariantDraw | None = None
    variant_tolerance: float | None = None  # the mix fails when its share of prompts is this far short
    held_out: HeldOut | None = None  # config key `eval`: prompts kept out of training, for `accept`

    @property
    def config_name(self) -> str:
        """The source's name in the config (a variant source's parent)."""
        return self.parent or self.name

    @property
    def drawn_share(self) -> float | None:
        """A variant source's part of its parent's prompts, drawn by share; None without variants and for
        a variant that takes every prompt."""
        return None if self.draw is None or self.variant is None else self.draw.share(self.variant)


@dataclass(frozen=True)
class ModelSpec:
    path: str
    revision: str | None
    tokenizer: str | None
    chat_template: str | None
    chat_template_kwargs: Mapping[str, Any]
    context_length: int | None = None
    tool_call_parser: str | None = None  # dflash_build.toolcalls.PARSERS


@dataclass(frozen=True)
class EngineSpec:
    backend: str
    options: Mapping[str, Any]
    gpus: tuple[str, ...] | None
    lock_dir: Path
    gpu_wait_seconds: float
    base_port: int
    journal_flush_rows: int
    journal_flush_seconds: float
    # Long-lived engines shared by the generate jobs (dflash_build.engines.host).
    shared: bool = False
    jobs_per_engine: int = 2
    idle_timeout: float = 600.0
    start_timeout: float = 1800.0
    stall_timeout: float = 300.0  # no answer this long with requests in flight: the job warns
    # the drafter that serves generation (config engine.drafter): speculative decoding writes the target's
    # own distribution, so it enters no key; each row records what the engine counted of it
    drafter: DrafterSpec | None = None


@dataclass(frozen=True)
class LoopRule:
    """When a repeated span is a loop (config ``degenerate.loop``; defaults measured in docs/benchmarks.md)."""

    max_period: int = 64
    min_repeats: int = 3
    min_span: int = 96

    def as_dict(self) -> dict[str, int]:
        return {"max_period": self.max_period, "min_repeats": self.min_repeats, "min_span": self.min_span}


DEGENERATE_POLICIES = ("drop", "keep", "regenerate")
# The reasons an answer is no training data, in the order they are tested (stages.common.degenerate)
DEGENERATE_REASONS = ("loop", "repetitive", "unclosed_reasoning", "empty")


@dataclass(frozen=True)
class Degenerate:
    """Answers that are no training data (config ``degenerate``, :mod:`dflash_build.stages.common.degenerate`):
    each reason's thresholds and policy, and whether the engine stops a loop as it happens."""

    loop: LoopRule = LoopRule()
    loop_policy: str = "drop"
    stop_early: bool = True
    repetitive_ngram: int = 4
    repetitive_min_distinct: float = 0.2
    repetitive_min_tokens: int = 256
    repetitive_policy: str = "drop"
    unclosed_reasoning_policy: str = "drop"
    empty_policy: str = "drop"
    reasoning_markers: tuple[str, ...] = ("<think>", "</think>")
    retries: int = 2  # policy regenerate: attempts after the first, each with the next seed

    def policy(self, reason: str) -> str:
        return str(getattr(self, f"{reason}_policy"))

    @property
    def stopping(self) -> LoopRule | None:
        """The loop rule the engine stops rows on: where a loop is dropped or generated again (a kept one
        runs to its end)."""
        return self.loop if self.stop_early and self.loop_policy != "keep" else None

    def regenerating(self) -> dict[str, Any] | None:
        """What decides which rows generate sees as degenerate and asks again (its gen component): the
        reasons whose policy is regenerate, the detector's settings, the bound; None when none is."""
        reasons = [r for r in DEGENERATE_REASONS if self.policy(r) == "regenerate"]
        if not reasons:
            return None
        return {"reasons": reasons, "retries": self.retries, "detector": self.components()}

    def components(self) -> dict[str, Any]:
        """What decides tokenize's verdicts (its key component)."""
        return {
            "loop": {**self.loop.as_dict(), "policy": self.loop_policy},
            "repetitive": {
                "ngram": self.repetitive_ngram,
                "min_distinct": self.repetitive_min_distinct,
                "min_tokens": self.repetitive_min_tokens,
                "policy": self.repetitive_policy,
            },
            "unclosed_reasoning": {"policy": self.unclosed_reasoning_policy},
            "empty": {"policy": self.empty_policy},
            "reasoning_markers": list(self.reasoning_markers),
        }


@dataclass(frozen=True)
class PreflightSpec:
    """What `preflight` generates before the build (config key `preflight`)."""

    rows: int = 8
    speed_rows: int | None = None  # None: as many as the build keeps in flight
    max_length_share: float = 0.5
    # engine.drafter's parity guard (stages.preflight.parity): the share of temperature-0 answers that may
    # differ with the drafter beyond the engine's own disagreement with itself; and building without a verdict
    parity_allowance: float = 0.125
    skip_parity: bool = False


@dataclass(frozen=True)
class Checks:
    """When a build fails instead of losing data quietly (docs/configuration.md: "Loud failure")."""

    max_drop_fraction: float = 0.2
    max_failed_fraction: float = 0.5
    share_tolerance: float = 0.02
    allow_shortfall: frozenset[str] = frozenset()
    # a build refuses to start with less free on the store's filesystem: room for 8 jobs to finish the
    # shards they hold (each ~100 MB of journal and parquet at 2,000 rows of 8K tokens) and the row index's
    # journal; the estimate of the whole remaining work is a warning (`plan`)
    min_free_gb: float = 2.0


@dataclass(frozen=True)
class PackSpec:
    """The optional pack stage (dflash_build.stages.pack); config key `pack`."""

    seq_len: int
    split_long: bool = False
    pad: bool = True
    pad_token_id: int = 0
    seed: int = 0
    window: int = 100_000


@dataclass(frozen=True)
class ExportSpec:
    """One trainer-handoff export (dflash_build.stages.export); config key `export.<format>`.

    Every format records the same fields: a format's own settings are always given (the schema holds
    their defaults); a setting it does not have keeps the neutral value written here."""

    format: str
    max_length: int | None = None  # the trainer's window (SpecForge max_length, speculators seq_length)
    long: str = "warn"  # a sample longer than max_length: warn (kept whole), cut, drop, split
    min_loss_tokens: int = 1  # fewer after the length policy: dropped, as the trainer's loader would
    consecutive: bool = False  # SpecForge DFlash: at least two adjacent supervised tokens
    shard_rows: int = 100_000
    think: tuple[str, str] = ("<think>", "</think>")  # conversations: the reasoning's markers
    tool_call_parser: str | None = None  # conversations: model.tool_call_parser, which reads the calls


@dataclass(frozen=True)
class TrainerSpec:
    """The trainer's window (config key `trainer`): no token is generated past it."""

    max_length: int | None = None
    min_new_tokens: int = 32

    def budget(self, max_new_tokens: int, prompt_tokens: int) -> int:
        """New tokens an answer after ``prompt_tokens`` may have: ``max_new_tokens``, or what is left of
        the window when that is less, so no token is generated past it. The one rule of the window
        (generate applies it, ``plan`` estimates with it)."""
        return max_new_tokens if self.max_length is None else min(max_new_tokens, self.max_length - prompt_tokens)

    def leaves_too_little(self, budget: int) -> bool:
        """Whether a prompt whose budget is ``budget`` is skipped: fewer than ``min_new_tokens`` new
        tokens in the window (fewer than one without a window)."""
        return budget < (1 if self.max_length is None else self.min_new_tokens)


@dataclass(frozen=True)
class NearSpec:
    """Config key ``dedup.near`` (its band split: :mod:`dflash_build.lsh`)."""

    threshold: float = 0.8
    ngram: int = 5
    num_perm: int = 128
    seed: int = 0


@dataclass(frozen=True)
class DedupSpec:
    """Config key `dedup`: near-copies within a source (prepare) and prompts several sources hold (mix)."""

    near: NearSpec | None = None
    across_sources: bool = True
    prefer: tuple[str, ...] = ()

    def source_priority(self, sources: Iterable[str]) -> list[str]:
        """The sources in the order that decides which keeps a prompt several hold."""
        names = sorted(sources)
        # a variant source (PARENT@VARIANT) ranks as its parent, which dedup.prefer names
        parent = {n: parent_name(n) for n in names}
        ranked = [n for p in self.prefer for n in names if parent[n] == p]
        return ranked + [n for n in names if parent[n] not in self.prefer]


@dataclass(frozen=True)
class ReferenceSpec:
    """One reference set of `decontaminate.references`: benchmark items no prompt may contain."""

    name: str
    files: tuple[str, ...]
    hf: HubSpec | None
    field: str


@dataclass(frozen=True)
class DecontaminationSpec:
    """Config key `decontaminate`."""

    ngram: int
    references: Mapping[str, ReferenceSpec]


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter of `accept.drafters` (or `engine.drafter`, serving generation): the speculative method,
    its checkpoint (none for ngram) and the method's options, as the engine's pinned release names them."""

    name: str
    method: str
    path: str | None
    options: Mapping[str, Any]
    # the train stage's drafter (`trained: true`): its path is the build's published drafter, written by
    # `train`, which accept runs after (stages.train)
    trained: bool = False


@dataclass(frozen=True)
class TrainSpec:
    """Config key `train` (dflash_build.stages.train): a drafter trained on the dataset by a trainer backend
    (dflash_build.trainers), its settings by the trainer's own sections, defaults filled in."""

    trainer: str
    recipe: str
    target: str  # the model folder the trainer loads as its target (model.path unless set)
    python: str | None  # the interpreter with the trainer (None: this one)
    gpus: int
    settings: Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class Calibration:
    """Config key `accept.calibration`: the target drafting for itself on ``rows`` eval rows per sampling."""

    rows: int
    max_new_tokens: int
    draft_tokens: int


@dataclass(frozen=True)
class AcceptSpec:
    """Config key `accept` (dflash_build.stages.accept): acceptance per slice of the eval split."""

    drafters: Mapping[str, DrafterSpec]
    max_new_tokens: int
    engine_options: Mapping[str, Any]  # over engine.options, for the speculative server
    weakest: int
    calibration: Calibration


@dataclass(frozen=True)
class AcceptanceRule:
    """Config key `mix.by_acceptance.CATEGORY` (stages.mix.acceptance): the hard part's share of the
    category's token target, drawn from a pool of the lowest-τ rows ``pool`` times its size; under
    ``mix.generate: as_needed`` the category is generated to ``oversample`` times its target (stages.size),
    so that the rule has rows to choose from."""

    fraction: float
    pool: float
    oversample: float = 1.0

    def mix_params(self) -> dict[str, float]:
        """What the mix's choice depends on: oversample acts through the shards the mix reads."""
        return {"fraction": self.fraction, "pool": self.pool}


@dataclass(frozen=True)
class Config:
    store: Path
    logs: Path
    dataset_name: str
    dataset_out: Path
    rows_per_file: int
    model: ModelSpec
    engine: EngineSpec
    shard_size: int
    truncated: str
    mix_categories: Mapping[str, float]
    mix_budget_tokens: int | None
    mix_seed: int
    # category -> language -> the least share of the category's tokens in that language
    mix_languages: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    mix_generate: str = "all"  # all | as_needed (stages.size)
    mix_by_acceptance: Mapping[str, AcceptanceRule] = field(default_factory=dict)  # by category
    sources: Mapping[str, SourceSpec] = field(default_factory=dict)
    checks: Checks = field(default_factory=Checks)
    preflight: PreflightSpec = field(default_factory=PreflightSpec)
    pack: PackSpec | None = None
    exports: Mapping[str, ExportSpec] = field(default_factory=dict)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    dedup: DedupSpec = field(default_factory=DedupSpec)
    decontaminate: DecontaminationSpec | None = None
    held_out: HeldOut | None = None
    eval_benchmarks: tuple[str, ...] = ()  # decontaminate.references in the eval split, a slice each
    sampling: Sampling | None = None  # the top-level sampling (each source's holds it merged)
    accept: AcceptSpec | None = None
    train: TrainSpec | None = None
    degenerate: Degenerate = field(default_factory=Degenerate)
    # the validated dict it was built from (config.edited applies an edit through the same parser)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def dataset_dir(self) -> Path:
        return self.dataset_out / self.dataset_name

    @property
    def eval_dir(self) -> Path:
        """The held-out split, beside the dataset (config key `eval`)."""
        return self.dataset_out / f"{self.dataset_name}-eval"

    @property
    def acceptance_dir(self) -> Path:
        """The acceptance report, beside the dataset (config key `accept`)."""
        return acceptance_report_of(self.dataset_dir)

    @property
    def drafter_dir(self) -> Path:
        """The drafter the train stage trains on the dataset, beside it (config key `train`)."""
        return trained_drafter_of(self.dataset_dir)

    @property
    def packed_dir(self) -> Path | None:
        """Beside the dataset, named by seq_len: another seq_len is another folder."""
        if self.pack is None:
            return None
        return self.dataset_out / f"{self.dataset_name}-packed-{self.pack.seq_len}"

    def export_dir(self, fmt: str) -> Path:
        """Beside the dataset, named by the trainer's format."""
        return self.dataset_out / f"{self.dataset_name}-{fmt}"

    @property
    def dist_folders(self) -> tuple[Path, ...]:
        """The folders a build publishes: the dataset, then what is derived from it (packed, exports)."""
        derived = [] if self.packed_dir is None else [self.packed_dir]
        # the eval split is built with them; the acceptance report is not (`accept`, on request)
        split = [] if self.held_out is None else [self.eval_dir]
        return (self.dataset_dir, *derived, *(self.export_dir(fmt) for fmt in self.exports), *split)

    @property
    def backend(self) -> str:
        return self.engine.backend

    @property
    def engine_options(self) -> Mapping[str, Any]:
        return self.engine.options
