"""Train a drafter on CPU with one of NeMo Automodel 0.7.0's own recipes (``TrainDFlashRecipe``,
``TrainEagle3Recipe``) from the project's token rows, and publish a checkpoint folder vLLM 0.32 serves as
``method: dflash`` or ``method: eagle3``.

Run by the trainer environment's interpreter (``make setup`` creates it; envs/automodel.txt pins it)::

    .venv-automodel/bin/python dflash_build/trainers/automodel_run.py RUN.json

A standalone script: the standard library and that environment's packages only, nothing of ``dflash_build``
(which is not installed there); each recipe's table is ``automodel_recipes_run.py`` beside it. RUN.json holds
one object:

- ``recipe``: ``"dflash"`` or ``"eagle3"``.
- ``target``: a local Hugging Face folder of the target model, of an architecture the recipe's registry gives
  the draft vLLM serves: DFlash's Qwen3-shaped draft (the Qwen3 and Qwen3.5 families; not Kimi K3, whose MLA
  draft vLLM's DFlashDraftModel is not), EAGLE-3's Llama-shaped head (Llama, Phi-3, Qwen3, Qwen3-MoE).
- ``rows``: the row files, parquet or JSONL, each row with ``input_ids`` and ``loss_mask`` (1 on the answer's
  tokens, unshifted, as long as ``input_ids``); other columns are ignored.
- ``out``: the folder the checkpoint is published to. It must not exist; it appears whole at the end (a
  hidden sibling renamed), so a failed run leaves nothing there.
- ``work``: Automodel's scratch (its output_dir and checkpoint_dir). Absent or empty, or a former run's
  (which is emptied): Automodel resumes from any checkpoint it finds there, and one that finished trains
  nothing.
- ``settings`` (optional): the recipe's keys, by Automodel's own YAML sections, ``{"recipe_args": {...},
  "optimizer": {...}}`` (the recipe's ``settings`` list them). Left out, a key takes the recipe's
  ``defaults``, or Automodel's own default; its ``required`` ones (DFlash's ``mask_token_id``, EAGLE-3's
  ``ttt_steps`` and ``lr``) Automodel has no default for. ``recipe_args.seq_length`` defaults to the longest
  row (nothing cut).

The runner writes the rest of Automodel's YAML for a CPU (gloo, sdpa attention, float32, safetensors with a
consolidated copy), runs the recipe in this process (``setup()``, ``run_train_validation_loop()``), then
publishes ``<checkpoint_dir>/LATEST/model/consolidated`` with the config vLLM loads it by and ``train.json``
(steps, losses, seconds, the Automodel release). Automodel's own log lines pass through on stderr; on stdout
one line per optimizer step it logs, ``automodel: step N/M loss L acc A lr R`` (DFlash logs no line for the
step that flushes an epoch's last partial accumulation window), then ``automodel: published OUT``. Bad
input stops it in one line before anything trains. One RUN.json trains the same weights again: the draft's
initial weights are seeded with ``shuffle_seed`` too.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from automodel_recipes_run import RECIPES, Recipe

PROG = "automodel"
# The Automodel release the CPU patches below were written for and tested on (envs/automodel.txt pins it).
RELEASE = "0.7.0"
RUN_KEYS = ("recipe", "target", "rows", "out", "work", "settings", "gpus")
OPTIONAL_RUN_KEYS = ("settings", "gpus")  # gpus: the build's train.gpus, 0 here (one CPU process)
# A former run's scratch folder carries this file: the next run may empty it.
WORK_MARK = ".automodel-cpu-work"


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return _int(v) or isinstance(v, float)


_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer", _int),
    "pos": ("a positive integer", lambda v: _int(v) and v > 0),
    "pos?": ("a positive integer or null", lambda v: v is None or (_int(v) and v > 0)),
    "num": ("a number", _num),
    "num?": ("a number or null", lambda v: v is None or _num(v)),
    "ints": ("a list of integers", lambda v: isinstance(v, list) and all(_int(x) for x in v)),
    "ints?": ("a list of integers or null", lambda v: v is None or (isinstance(v, list) and all(_int(x) for x in v))),
    "str": ("a string", lambda v: isinstance(v, str)),
    "str?": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "pair": ("a list of two numbers", lambda v: isinstance(v, list) and len(v) == 2 and all(_num(x) for x in v)),
}


class Stop(Exception):
    """Bad input or an Automodel this runner was not written for: one line, no traceback."""


def closest(name: str, names: list[str], prefix: str = "") -> str:
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    return f"; did you mean {prefix}{match[0]}?" if match else f" (known: {', '.join(prefix + n for n in names)})"


def load_run(path: Path) -> dict[str, Any]:
    """RUN.json, its shape and its settings checked (no file it names is read yet)."""
    try:
        run = json.loads(path.read_text())
    except OSError as e:
        raise Stop(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise Stop(f"{path} is not JSON: {e}") from None
    if not isinstance(run, dict):
        raise Stop(f"{path} holds no object")
    for key in run:
        if key not in RUN_KEYS:
            raise Stop(f"{path}: {key} is not a key of RUN.json{closest(key, list(RUN_KEYS))}")
    for key in RUN_KEYS:
        if key not in run and key not in OPTIONAL_RUN_KEYS:
            raise Stop(f"{path}: {key} is missing")
    if run["recipe"] not in RECIPES:
        raise Stop(f"{path}: recipe {run['recipe']!r} is not one this runner trains ({', '.join(RECIPES)})")
    for key in ("target", "out", "work"):
        if not isinstance(run[key], str) or not run[key]:
            raise Stop(f"{path}: {key} must be a path")
    rows = run["rows"]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, str) and r for r in rows):
        raise Stop(f"{path}: rows must be a list of row files (parquet or JSONL)")
    run["settings"] = merge_settings(run.get("settings") or {}, RECIPES[run["recipe"]])
    return run


def merge_settings(given: Any, recipe: Recipe) -> dict[str, dict[str, Any]]:
    """The run's settings over the recipe's defaults, every key known and of its kind."""
    if not isinstance(given, dict):
        raise Stop(f"settings must be an object of Automodel's sections ({', '.join(recipe.settings)})")
    sections, owned = recipe.settings, recipe.owned
    every = [f"{s}.{k}" for s, keys in sections.items() for k in keys]
    merged = {section: dict(recipe.defaults.get(section, {})) for section in sections}
    for section, values in given.items():
        if section in owned:
            raise Stop(f"settings.{section} is the runner's ({owned[section]}); remove it")
        if section not in sections:
            raise Stop(
                f"settings.{section} is not a section of settings{closest(section, list(sections), 'settings.')}"
            )
        if not isinstance(values, dict):
            raise Stop(f"settings.{section} must be an object of keys")
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if dotted in owned:
                raise Stop(f"settings.{dotted} is the runner's ({owned[dotted]}); remove it")
            if key not in sections[section]:
                # the key under another section, or else the nearest spelling of any
                elsewhere = [name for name in every if name.endswith(f".{key}")]
                hint = f"; did you mean settings.{elsewhere[0]}?" if elsewhere else closest(dotted, every, "settings.")
                raise Stop(f"settings.{dotted} is not a setting of the automodel trainer's {recipe.name} recipe{hint}")
            what, ok = _KINDS[sections[section][key]]
            if not ok(value):
                raise Stop(f"settings.{dotted} must be {what}, not {json.dumps(value)}")
            merged[section][key] = value
    for dotted, what in recipe.required.items():
        section, key = dotted.split(".")
        if key not in merged[section]:
            raise Stop(f"settings.{dotted} is required: {what} (Automodel has no default)")
    return merged


COLUMNS = ("input_ids", "loss_mask")


def read_rows(path: Path) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` of every row of one parquet or JSONL file."""
    if not path.is_file():
        raise Stop(f"rows file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as e:  # pyarrow's errors: not a parquet file, a truncated one
            raise Stop(f"rows file {path} is not a parquet file ({e})") from None
        missing = [c for c in COLUMNS if c not in names]
        if missing:
            raise Stop(f"rows file {path} has no {' or '.join(missing)} column (it has {', '.join(names)})")
        table = pq.read_table(path, columns=list(COLUMNS))
        pairs = zip(*(table.column(c).to_pylist() for c in COLUMNS), strict=True)
        rows = [(ids, mask) for ids, mask in pairs]
    elif path.suffix in (".jsonl", ".ndjson", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    raise Stop(f"rows file {path} line {n} is not JSON") from None
                missing = [c for c in COLUMNS if not isinstance(row, dict) or c not in row]
                if missing:
                    raise Stop(f"rows file {path} line {n} has no {' or '.join(missing)} field")
                rows.append((row["input_ids"], row["loss_mask"]))
    else:
        raise Stop(f"rows file {path} is neither parquet nor JSONL (.parquet, .jsonl)")
    for n, (ids, mask) in enumerate(rows, 1):
        if not isinstance(ids, list) or not isinstance(mask, list) or not all(_int(x) for x in ids + mask):
            raise Stop(f"rows file {path} row {n}: input_ids and loss_mask must be lists of integers")
        if len(ids) != len(mask):
            raise Stop(f"rows file {path} row {n}: {len(ids)} input_ids but {len(mask)} loss_mask values")
    return rows


def read_all_rows(files: list[str]) -> list[tuple[list[int], list[int]]]:
    rows = [row for f in files for row in read_rows(Path(f))]
    if not any(any(mask) for _, mask in rows):
        raise Stop(f"the rows ({len(rows)} in {len(files)} files) hold no answer token (loss_mask is 0 everywhere)")
    return rows


def installed_release() -> str:
    """The installed nemo_automodel's version (read without importing it)."""
    try:
        version = importlib.metadata.version("nemo_automodel")
    except importlib.metadata.PackageNotFoundError:
        raise Stop(
            f"nemo_automodel is not installed in {sys.prefix} (`make setup` creates .venv-automodel, "
            "envs/automodel.txt)"
        ) from None
    if version != RELEASE:
        raise Stop(
            f"nemo_automodel {version} is installed; the CPU patches (triton, tokens_loader, cpu_target, "
            f"progress) were written for {RELEASE} (envs/automodel.txt pins it)"
        )
    return version


def import_automodel(recipe: Recipe) -> Any:
    """Automodel's module of ``recipe``, imported without triton (patch ``triton``: Automodel's LoRA kernels
    run triton's decorators at import when it is installed; every import of it there is guarded) and
    without the import-time noise of torchao's CUDA libraries and torch's deprecation notes."""
    if "torch" not in sys.modules:
        sys.modules.setdefault("triton", None)
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the target is a local folder: no hub look-up
    os.environ.setdefault("NO_COLOR", "1")  # Automodel's log lines are read, not looked at
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return importlib.import_module(f"nemo_automodel.recipes.llm.{recipe.module}")


def patch_automodel(
    td: Any, recipe: Recipe, rows: list[tuple[list[int], list[int]]], progress: Callable[..., None]
) -> type:
    """The recipe class with the CPU patches, once each checks that the release's code is what it was
    written for (``recipe.checks``); one that does not stops the run in one line naming it and the release.

    - ``tokens_loader``: the module's ``build_eagle3_dataloader`` renders chats with the chat template
      itself; the project's rows are tokens already. Replaced by a loader over the rows
      (:func:`tokens_loader`, the same keywords).
    - ``cpu_target``: the recipe loads the target with ``NeMoAutoModelForCausalLM``, whose
      ``from_pretrained`` calls ``torch.cuda.current_device()`` whatever its arguments. Replaced by
      transformers' own loader (float32, sdpa, on the CPU) with the same side effects (no mesh).
    - ``progress``: the loop's tqdm bar (carriage returns, not lines) is left out, and each per-step line
      it logs is also printed as ``automodel: step N/M loss L``.
    """
    missed = [name for name, ok in recipe.checks(td).items() if not ok]
    if missed:
        raise Stop(
            f"nemo_automodel {RELEASE}'s code is not what the CPU patch {', '.join(missed)} was written for "
            f"(its module {getattr(td, '__file__', td)})"
        )

    from transformers import AutoModelForCausalLM

    td.build_eagle3_dataloader = lambda **kwargs: tokens_loader(td, rows, **kwargs)
    logging.getLogger(td.__name__).addHandler(_StepLines(progress, recipe.steps))
    return recipe.cpu(td, AutoModelForCausalLM)


def tokens_loader(td: Any, rows: list[tuple[list[int], list[int]]], **kw: Any) -> Any:
    """What ``build_eagle3_dataloader`` returns (its keywords), over token rows: batches of ``input_ids``,
    ``loss_mask`` and ``attention_mask`` (long), right-padded to the batch's longest row, cut at
    ``seq_length``; with ``packed_sequence_size`` > 0, Automodel's own packer and collate. The order is
    ``shuffle_seed``'s."""
    import torch
    from torch.utils.data import DataLoader

    tokenizer = kw["tokenizer"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    packed = int(kw.get("packed_sequence_size") or 0)
    limit = packed or int(kw["seq_length"])
    samples = [{"input_ids": ids[:limit], "loss_mask": mask[:limit]} for ids, mask in rows]
    if packed:
        from nemo_automodel.components.datasets.llm import eagle3

        dataset: Any = eagle3.build_packed_eagle3_dataset(samples, packed_sequence_size=packed, pad_token_id=pad)
        collate: Any = eagle3._pack_collate
    else:
        dataset = samples

        def collate(batch: list[dict[str, list[int]]]) -> dict[str, Any]:
            width = max(len(s["input_ids"]) for s in batch)
            out = {"input_ids": [], "loss_mask": [], "attention_mask": []}
            for s in batch:
                n = len(s["input_ids"])
                out["input_ids"].append(s["input_ids"] + [pad] * (width - n))
                out["loss_mask"].append([int(bool(m)) for m in s["loss_mask"]] + [0] * (width - n))
                out["attention_mask"].append([1] * n + [0] * (width - n))
            return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}

    seed = kw.get("shuffle_seed")
    return DataLoader(
        dataset,
        batch_size=int(kw["batch_size"]),
        shuffle=bool(kw.get("shuffle")),
        generator=torch.Generator().manual_seed(42 if seed is None else int(seed)),
        num_workers=0,
        collate_fn=collate,
        drop_last=False,
    )


class _StepLines(logging.Handler):
    """Reads the recipe's own per-step log records (their arguments, not their text)."""

    def __init__(self, progress: Callable[..., None], formats: dict[str, tuple[int, int, int, int, int]]) -> None:
        super().__init__(logging.INFO)
        self.progress, self.formats = progress, formats

    def emit(self, record: logging.LogRecord) -> None:
        at = self.formats.get(record.msg) if isinstance(record.msg, str) else None
        if at is not None and isinstance(record.args, tuple):
            epoch, step, loss, acc, lr = (record.args[i] for i in at)
            self.progress(epoch=int(epoch), step=int(step), loss=float(loss), acc=float(acc), lr=float(lr))


def target_architectures(target: Path) -> list[str]:
    try:
        config = json.loads((target / "config.json").read_text())
    except OSError:
        raise Stop(f"target {target} is not a model folder (no config.json)") from None
    except ValueError:
        raise Stop(f"target {target}: config.json is not JSON") from None
    return list(config.get("architectures") or [])


def check_work(work: Path) -> bool:
    """Whether ``work`` holds a former run's scratch (to empty); absent or empty, False; else it stops."""
    if not work.exists():
        return False
    if not work.is_dir():
        raise Stop(f"work {work} is a file, not a folder")
    if any(work.iterdir()) and not (work / WORK_MARK).exists():
        raise Stop(
            f"work {work} holds files of something else; give an empty or absent folder (Automodel resumes "
            "from any checkpoint there)"
        )
    return any(work.iterdir())


def prepare_work(work: Path) -> None:
    """``work`` empty, and marked as this runner's scratch."""
    if check_work(work):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_MARK).write_text("scratch of dflash_build/trainers/automodel_run.py: the next run empties it\n")


def automodel_yaml(run: dict[str, Any], rows: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """Automodel's YAML for this run on a CPU."""
    recipe = RECIPES[run["recipe"]]
    work = Path(run["work"]).resolve()
    settings = run["settings"]
    recipe_args = {
        "target_model_name_or_path": str(Path(run["target"]).resolve()),
        "train_data_path": [str(Path(f).resolve()) for f in run["rows"]],
        "output_dir": str(work),
        **recipe.fixed,
        **settings["recipe_args"],  # merge_settings gives every section
    }
    if recipe_args.get("seq_length") is None:
        recipe_args["seq_length"] = max(len(ids) for ids, _ in rows)
    return {
        "recipe": recipe.cls,
        "dist_env": {"backend": "gloo", "timeout_minutes": 30},
        "recipe_args": recipe_args,
        "optimizer": dict(settings["optimizer"]),
        "checkpoint": {
            "enabled": True,
            "checkpoint_dir": str(work / "checkpoints"),
            "model_save_format": "safetensors",
            "save_consolidated": True,
            "v4_compatible": False,  # true copies the target's config.json into the draft's folder
        },
    }


def publish(consolidated: Path, out: Path, served: Callable[[dict[str, Any]], dict[str, Any]], strip: str,
            record: dict[str, Any]) -> None:  # fmt: skip
    """The consolidated checkpoint at ``out``, whole or not at all: its config as ``served`` makes it, its
    weights' names without the prefix ``strip``."""
    if out.exists():
        raise Stop(f"out {out} appeared while training; nothing published (the checkpoint is in {consolidated})")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        shutil.copytree(consolidated, partial)
        config = json.loads((partial / "config.json").read_text())
        (partial / "config.json").write_text(json.dumps(served(config), indent=2) + "\n")
        if strip:
            strip_prefix(partial, strip)
        # a key a line, its value on it (the losses too)
        lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in record.items())
        (partial / "train.json").write_text("{\n" + lines + "\n}\n")
        os.rename(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def strip_prefix(folder: Path, prefix: str) -> None:
    """Every weight of ``folder``'s safetensors files (and its index) named without ``prefix``."""
    from safetensors.torch import load_file, save_file

    def name(key: str) -> str:
        return key[len(prefix) :] if key.startswith(prefix) else key

    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(file))
        save_file({name(k): v for k, v in tensors.items()}, str(file), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        table = json.loads(index.read_text())
        table["weight_map"] = {name(k): v for k, v in table.get("weight_map", {}).items()}
        index.write_text(json.dumps(table, indent=2) + "\n")


def check_architecture(target: Path, architectures: list[str], recipe: Recipe, release: str) -> None:
    """The target is one Automodel's registry gives the draft vLLM serves (``recipe.registry``)."""
    module, table, served = recipe.registry
    registry = getattr(importlib.import_module(module), table)
    accepted = sorted(a for a, spec in registry.items() if spec.draft_cls.__name__ == served)
    if not any(a in accepted for a in architectures):
        raise Stop(
            f"target {target} is {', '.join(architectures) or 'of no architecture'}: Automodel {release}'s "
            f"{recipe.name} recipe trains vLLM's {recipe.name} drafters for {', '.join(accepted)} only"
        )


def train(run: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic()
    release = installed_release()
    rows = read_all_rows(run["rows"])
    target, out, work = Path(run["target"]), Path(run["out"]), Path(run["work"])
    architectures = target_architectures(target)
    check_work(work)
    if out.exists():
        raise Stop(f"out {out} exists: the runner publishes a new folder there")
    recipe = RECIPES[run["recipe"]]
    config = automodel_yaml(run, rows)
    td = import_automodel(recipe)
    losses: list[tuple[int, float]] = []
    total = {"steps": 0}

    def progress(epoch: int, step: int, loss: float, acc: float, lr: float) -> None:
        losses.append((step, loss))
        print(f"{PROG}: step {step}/{total['steps']} loss {loss:.4f} acc {acc:.4f} lr {lr:.3g}", flush=True)

    recipe_cls = patch_automodel(td, recipe, rows, progress)
    check_architecture(target, architectures, recipe, release)
    prepare_work(work)
    trained, train_seconds = run_recipe(td, recipe_cls, config, work, len(rows), lambda n: total.update(steps=n))
    consolidated = work / "checkpoints" / "LATEST" / "model" / "consolidated"
    if not (consolidated / "config.json").exists():
        raise Stop(f"Automodel saved no consolidated checkpoint at {consolidated}")
    record = {
        **{"trainer": "automodel", "automodel": release, "recipe": run["recipe"], "target": str(target.resolve())},
        **{
            "rows": len(rows),
            "steps": trained.runtime.global_step,
            "skipped_micro_batches": getattr(trained, "_skipped_micro_batches", 0),  # DFlash's short batches
        },
        "first_loss": losses[0][1] if losses else None,
        "final_loss": losses[-1][1] if losses else None,
        "losses": [[step, round(loss, 6)] for step, loss in losses],
        **{"train_seconds": round(train_seconds, 1), "wall_seconds": round(time.monotonic() - started, 1)},
        "settings": run["settings"],
    }
    publish(consolidated.resolve(), out, lambda c: recipe.served(c, trained), recipe.strip, record)
    print(f"{PROG}: published {out} ({record['steps']} steps, final loss {record['final_loss']})", flush=True)
    return record


def run_recipe(
    td: Any, recipe_cls: type, config: dict[str, Any], work: Path, rows: int, steps: Callable[[int], None]
) -> tuple[Any, float]:
    """The recipe set up from ``config`` (its YAML written into ``work``) and trained: it, and the seconds its
    loop took."""
    import torch
    import yaml

    (work / "automodel.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    cfg = td.parse_args_and_load_config(str(work / "automodel.yaml"), argv=[])
    recipe = recipe_cls(cfg)
    # the draft's initial weights: Automodel seeds its own generator after building the draft
    torch.manual_seed(int(config["recipe_args"].get("shuffle_seed", 42)))
    try:
        recipe.setup()
    except (ValueError, NotImplementedError) as e:  # Automodel's own refusals of a setting, before training
        raise Stop(f"Automodel's recipe refused the run: {' '.join(str(e).split())}") from None
    steps(recipe.total_optim_steps)
    print(f"{PROG}: training {rows} rows, {recipe.total_optim_steps} steps", flush=True)
    started = time.monotonic()
    recipe.run_train_validation_loop()
    return recipe, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: {Path(sys.argv[0]).name} RUN.json", file=sys.stderr)
        return 2
    try:
        train(load_run(Path(args[0])))
    except Stop as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    finally:
        _end_process_group()
    return 0


def _end_process_group() -> None:
    """The gloo group Automodel's setup started (its atexit hook does it too, later than the interpreter's
    own teardown likes)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
