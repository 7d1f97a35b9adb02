"""The store's layout: every path and file name in it, built here and nowhere else.

```
STORE/prompts/SOURCE/PROMPT_KEY/{SHARD.parquet, manifest.json, bands.parquet}
STORE/completions/SOURCE/GEN_KEY/{SHARD.parquet, SHARD.stats.json}
STORE/tokens/SOURCE/TOK_KEY/{SHARD.parquet, SHARD.stats.json}
STORE/journal/GEN_KEY/SHARD/{rows.jsonl, published.parquet, published.stats.json, lock}
STORE/index/rows.sqlite      STORE/configs/      (the row index; the configs registered on the store)
STORE/drafters/TRAIN_KEY/{checkpoint files, trained.json}   (the train stage's drafters; KEY.work: its scratch)
STORE/.cache/{fingerprints.json, components/KEY.json}   (file digests; what each planned key is made of)
LOGS/STAGE_DIR/SOURCE/KEY/SHARD.log              (one log per job, mirroring its store path)
```

A keyed stage's store folder is one :class:`Keyed` (the stage that writes it, its folder, the key that
names each source's folder there); every stage is declared by its own package
(:mod:`dflash_build.stages.registry`). Rules format :func:`shard_pattern`; stages, commands and the plan
call the functions below.
``tests/test_layout.py`` fails when a store path is built anywhere else.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_build.keys import GEN, PROMPT, TOK


@dataclass(frozen=True)
class Keyed:
    """A keyed stage's folder in the store: the stage (and rule) that writes it, the folder, and the
    content key that names each source's folder there."""

    name: str
    folder: str
    key: str

    @property
    def rule(self) -> str:
        """The rule that writes it (prepare's, one per source: ``prepare_SOURCE``, :func:`prepare_rule_name`)."""
        return self.name


# The keyed stages' folders, in the order the data flows: each key includes the one before.
PROMPTS = Keyed("prepare", "prompts", PROMPT)
COMPLETIONS = Keyed("generate", "completions", GEN)
TOKENS = Keyed("tokenize", "tokens", TOK)
STAGES = {s.folder: s for s in (PROMPTS, COMPLETIONS, TOKENS)}  # the keyed stages, by store folder
KEYS = tuple(s.key for s in STAGES.values())  # prompt_key, gen_key, tok_key: each includes the one before


JOURNAL = "journal"
CONFIGS = "configs"  # the configs registered on the store (gc keeps what they reference)
INDEX_FILE = Path("index") / "rows.sqlite"
INDEX_LOCK = Path("index") / "rebuild.lock"

DATA = ".parquet"
SIDECAR = ".stats.json"
LOG = ".log"
MANIFEST = "manifest.json"  # a prompt folder's, and a dataset, pack or export folder's
BANDS = "bands.parquet"  # the selected prompts' near-duplicate band keys (dedup.near)
HELD_OUT = "eval.parquet"  # config eval: a source's prompts held out of training, beside its manifest
HELD_OUT_BANDS = "eval-bands.parquet"  # with dedup.near: their near-duplicate band keys
JOURNAL_ROWS = "rows.jsonl"
JOURNAL_LOCK = "lock"  # one job at a time per shard; who holds it is written in it
PUBLISHED_DATA = "published" + DATA
PUBLISHED_STATS = "published" + SIDECAR


ACCEPTANCE = "acceptance"  # each drafter's measurement on the eval split, by accept_key (stages.accept)
# A measurement's files: each request's counts, then the summary, written last (it marks the measurement done).
ACCEPTANCE_REQUESTS = "requests.parquet"
ACCEPTANCE_SUMMARY = "summary.json"
ACCEPTANCE_REPORT = "acceptance.json"  # the report in dist/NAME-acceptance (its README.md renders it)
ACCEPTANCE_PLOT = "plots/acceptance.png"


TRAINED = "drafters"  # each drafter the train stage trained, by train_key (stages.train)
TRAINED_RECORD = "trained.json"  # in a trained drafter's folder, written last: what it was trained on, and how


def trained_dir(store: Path, key: str) -> Path:
    """One trained drafter's checkpoint, as the engine serves it, and its record. By key alone."""
    return store / TRAINED / key


def trained_work_dir(store: Path, key: str) -> Path:
    """The trainer's own scratch for that drafter (its checkpoints as it goes): left when a training fails,
    to look at (the next run trains again, and gc removes it once it is old); removed once the drafter is in
    place."""
    return store / TRAINED / f"{key}.work"


def trained_entries(store: Path) -> list[Path]:
    """Every trained drafter's folder in the store."""
    return sorted(p for p in (Path(store) / TRAINED).glob("*") if p.is_dir() and not p.name.endswith(".work"))


def trained_scratch(store: Path) -> list[Path]:
    """Every trainer's scratch folder in the store (a training that failed, or is running)."""
    return sorted(p for p in (Path(store) / TRAINED).glob("*.work") if p.is_dir())


def acceptance_dir(store: Path, key: str) -> Path:
    """One drafter's measurement: its requests (each with its slice and the engine's counts) and summary.
    By key alone: a drafter renamed in the config is not measured again."""
    return store / ACCEPTANCE / key


def acceptance_entries(store: Path) -> list[Path]:
    """Every measurement folder in the store."""
    return sorted(p for p in (Path(store) / ACCEPTANCE).glob("*") if p.is_dir())


def stage_dir(store: Path, stage: Keyed, source: str, key: str) -> Path:
    assert stage.folder is not None, f"{stage.name} has no folder in the store"
    return Path(store) / stage.folder / source / key


def shard_file(folder: Path, shard: str) -> Path:
    return folder / f"{shard}{DATA}"


def sidecar(data: Path) -> Path:
    """The stats sidecar beside a shard's data file."""
    return data.with_name(data.name.removesuffix(DATA) + SIDECAR)


def data_of(stats: Path) -> Path:
    """The data file a stats sidecar describes."""
    return stats.with_name(stats.name.removesuffix(SIDECAR) + DATA)


def shard_of(path: Path) -> str:
    """The shard a data file or sidecar belongs to."""
    return path.name.removesuffix(SIDECAR).removesuffix(DATA)


def sidecars(folder: Path) -> list[Path]:
    """One stage folder's stats sidecars, in shard order."""
    return sorted(folder.glob(f"*{SIDECAR}"))


def store_sidecars(store: Path, stage: Keyed) -> Iterator[Path]:
    """Every stats sidecar of a stage in the store, of every source and key."""
    yield from sorted((Path(store) / stage.folder).glob(f"*/*/*{SIDECAR}"))


def journal_dir(store: Path, gen_key: str, shard: str | None = None) -> Path:
    """A generation key's journal folder, or one shard's in it."""
    folder = Path(store) / JOURNAL / gen_key
    return folder if shard is None else folder / shard


def shard_pattern(root: str | Path, stage: Keyed, suffix: str) -> str:
    """A rule's path pattern of a stage's shard files under ``root`` (the store or the logs)."""
    return f"{root}/{stage.folder}/{{source}}/{{key}}/{{shard}}{suffix}"


def prepare_log(logs: str | Path, source: str, prompt_key: str) -> str:
    return f"{logs}/{PROMPTS.folder}/{source}/{prompt_key}/{PROMPTS.rule}{LOG}"


def prepare_rule_name(source: str) -> str:
    """The Snakemake rule that prepares ``source`` (rule names allow letters, digits and _ only)."""
    return "prepare_" + re.sub(r"[^A-Za-z0-9_]", "_", source)


SIZING_ROUNDS = (1, 2)  # mix.generate as_needed: the pilot's sizing, then the top-up's


def sizing_file(logs: str | Path, name: str, round_: int) -> str:
    """Round ``round_``'s sizing of dataset ``name`` (mix.generate as_needed): derived from the shards it
    measured and the config, so it lives with the config's logs, not in the content-addressed store."""
    return f"{logs}/sizing/{name}-round-{round_}.json"


def prepared_record(logs: str | Path, name: str) -> str:
    """The record that every source of dataset ``name``'s config is prepared (the gate every generate job
    waits on, stages.prepared): derived from the config, so it lives with its logs."""
    return f"{logs}/prepared/{name}.json"


def preflight_summary(logs: str | Path, name: str) -> str:
    """The last preflight of dataset ``name``'s config (JSON; its Markdown beside it, :func:`preflight_table`):
    a check of this node and config, not content, so it lives with the logs."""
    return f"{logs}/preflight/{name}.json"


def preflight_table(summary: str | Path) -> Path:
    return Path(summary).with_suffix(".md")


def preflight_log(logs: str | Path, name: str) -> str:
    return f"{logs}/preflight/{name}{LOG}"


def sizing_round(path: str | Path) -> int:
    return int(Path(path).stem.rsplit("-", 1)[1])


def running_dir(logs: str | Path) -> Path:
    """Where each running job records itself (dflash_build.running), for `status`."""
    return Path(logs) / "running"


def dist_log(logs: str | Path, name: str) -> str:
    """The log of a job that writes ``dist/NAME`` (the mix, a pack, an export)."""
    return f"{logs}/dist/{name}{LOG}"


def stage_entries(store: Path, stage: Keyed) -> list[Path]:
    """Every SOURCE/KEY folder of a stage in the store."""
    return sorted(p for p in (Path(store) / stage.folder).glob("*/*") if p.is_dir())


def source_keys(store: Path, stage: Keyed, source: str) -> list[Path]:
    """Every KEY folder of one source's stage in the store."""
    return sorted(p for p in (Path(store) / stage.folder / source).glob("*") if p.is_dir())


def shard_files(store: Path, stage: Keyed, source: str, shard: str) -> list[Path]:
    """One shard's data file under every key of a source's stage."""
    return sorted((Path(store) / stage.folder / source).glob(f"*/{shard}{DATA}"))


def journal_entries(store: Path) -> list[Path]:
    """Every generation key's journal folder in the store."""
    return sorted(p for p in (Path(store) / JOURNAL).glob("*") if p.is_dir())


def journal_files(store: Path, name: str) -> list[Path]:
    """One file (``JOURNAL_ROWS``, ``PUBLISHED_DATA``) of every shard journal in the store."""
    return sorted((Path(store) / JOURNAL).glob(f"*/*/{name}"))


def is_completion_shard(path: Path) -> bool:
    return path.suffix == DATA and path.parent.parent.parent.name == COMPLETIONS.folder


def registration(store: Path, ident: str | None = None) -> Path:
    """The store's folder of registered configs, or one registration in it."""
    folder = Path(store) / CONFIGS
    return folder if ident is None else folder / f"{ident}.json"


CACHE = ".cache"  # derived state: file digests, and what each planned key is made of


def components_file(store: Path, key: str) -> Path:
    return Path(store) / CACHE / "components" / f"{key}.json"


def fingerprint_cache_file(store: Path) -> Path:
    return Path(store) / CACHE / "fingerprints.json"


def user_cache_dir() -> Path:
    """The user's cache folder for dflash-build: what is kept per machine and user, not per store."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-build"


def user_fingerprint_cache_file(store: Path) -> Path:
    """Where the file-digest cache goes when the store cannot take it (read-only, full): the user's cache
    folder, one file per store."""
    store_id = hashlib.sha256(os.path.realpath(store).encode()).hexdigest()[:16]
    return user_cache_dir() / "fingerprints" / f"{store_id}.json"


def tokenizer_cache_file(key: str) -> Path:
    """A loaded tokenizer, pickled: in the user's cache, shared by every store (its key is its content)."""
    return user_cache_dir() / "tokenizers" / f"{key}.pickle"
