"""The SpecForge runner: ``python specforge_run.py RUN.json [--plan]``, run by the trainer's interpreter
(``.venv-specforge``, which has SpecForge 0.2.0 and its dependencies, not dflash_build: this script
imports the standard library, pyarrow, yaml and specforge only).

It trains the DFlash drafter of one run file (:class:`dflash_build.trainers.base.Run` as a dict):

1. the dataset's rows (parquet files, ``input_ids`` and ``loss_mask``) become SpecForge's pre-tokenized
   prompts JSONL in the run's work folder, cut at ``data.max_length`` and without the rows SpecForge's
   DFlash loader drops (fewer than two supervised tokens, or no two adjacent ones:
   ``specforge/data/prompt_builder.py``, ``specforge/data/loss_mask.py``), so that the file holds exactly
   the rows it trains on, and the count of those left out, by reason, goes to the record;
2. SpecForge's YAML config: online mode (``data.prompts_path``), the target, the settings by section,
   ``output_dir`` in the work folder, and the managed single-node deployment SpecForge's online mode
   requires (``deployment.mode: disaggregated``, ``backend: mooncake``, ``managed_local``: a Mooncake
   master and one SGLang capture server on the first ``capture_server.tp_size`` GPUs, the trainer's
   ranks on the rest of the run's GPUs, on free ports);
3. ``specforge train -c run.yaml``, its lines passed through and each step it logs printed again as
   ``step N/M loss X`` (what :func:`dflash_build.trainers.specforge.progress` reads); with ``--plan``,
   only the plan SpecForge prints, exit 0, and nothing started;
4. ``specforge export --to hf`` of the newest checkpoint into a temporary sibling of ``out``, with the
   draft config SpecForge derives from the same YAML and the mask token, capture layers and block size
   the checkpoint records (what vLLM's DFlash reads from ``dflash_config``), ``train.json`` beside it,
   and one rename to ``out``: the checkpoint is there whole or not at all.

SpecForge's managed deployment cannot resume (``managed_local does not support resume``) and needs a
fresh control folder: a run after a failed one starts over.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUN_ID = "dflash"
PROMPTS = "prompts.jsonl"
CONFIG = "run.yaml"
DRAFT_CONFIG = "draft_config.json"
CONTROL = "control"  # the managed deployment's own folder (Mooncake, the capture server, the consumer's state)
OUTPUT = "output"  # SpecForge's output_dir: its checkpoints
RECORD = "train.json"  # dflash_build.trainers.base.TRAINER_RECORD
MIN_LOSS_TOKENS = 2  # DFlash's minimum (algorithms/model_providers.py, dflash_min_loss_tokens)
DEFAULT_HIGH, DEFAULT_LOW = 256, 192  # RuntimeConfig's in-flight watermarks
ID_COLUMNS = ("prompt_id", "sample_idx", "turn", "variant")

DROP_FEW_LOSS = "few_loss_tokens_within_max_length"
DROP_NOT_ADJACENT = "no_adjacent_loss_tokens_within_max_length"


# -- rows ------------------------------------------------------------------------------------------


def _row_id(row: dict[str, Any], fallback: str) -> str:
    """The sample's id as the build's exports write it (``prompt:sample[:turn][@variant]``)."""
    if row.get("prompt_id") is None or row.get("sample_idx") is None:
        return fallback
    base = f"{row['prompt_id']}:{row['sample_idx']}"
    if row.get("turn") is not None:
        base = f"{base}:{row['turn']}"
    return base if row.get("variant") is None else f"{base}@{row['variant']}"


def rows(files: list[str]) -> Iterator[dict[str, Any]]:
    """The dataset's rows: ``id``, ``input_ids``, ``loss_mask``."""
    import pyarrow.parquet as pq

    for name in files:
        path = Path(name)
        if path.suffix != ".parquet":
            continue
        parquet = pq.ParquetFile(path)
        present = set(parquet.schema_arrow.names)
        missing = {"input_ids", "loss_mask"} - present
        if missing:
            raise SystemExit(f"{path} has no {', '.join(sorted(missing))} column: not a dataset's row file")
        columns = ["input_ids", "loss_mask", *[c for c in ID_COLUMNS if c in present]]
        index = 0
        for batch in parquet.iter_batches(batch_size=2048, columns=columns):
            for row in batch.to_pylist():
                yield {
                    "id": _row_id(row, f"{path.name}:{index}"),
                    "input_ids": row["input_ids"],
                    "loss_mask": row["loss_mask"],
                }
                index += 1


def kept(ids: list[int], mask: list[int], max_length: int) -> tuple[list[int], list[int]] | str:
    """The row SpecForge's DFlash loader trains on (cut at ``max_length``), or why it drops it."""
    ids, mask = ids[:max_length], [int(m) for m in mask[:max_length]]
    if sum(mask) < MIN_LOSS_TOKENS:
        return DROP_FEW_LOSS
    if not any(a and b for a, b in itertools.pairwise(mask)):
        return DROP_NOT_ADJACENT
    return ids, mask


def write_prompts(files: list[str], path: Path, max_length: int) -> dict[str, Any]:
    """SpecForge's pre-tokenized prompts JSONL (``{id, input_ids, loss_mask}`` a line) of the rows it
    trains on; the counts."""
    counts: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for row in rows(files):
            counts["rows_in"] += 1
            if len(row["input_ids"]) != len(row["loss_mask"]):
                raise SystemExit(f"row {row['id']}: input_ids and loss_mask differ in length")
            shaped = kept(row["input_ids"], row["loss_mask"], max_length)
            if isinstance(shaped, str):
                dropped[shaped] += 1
                continue
            ids, mask = shaped
            counts["rows"] += 1
            counts["tokens"] += len(ids)
            counts["loss_tokens"] += sum(mask)
            counts["cut"] += len(row["input_ids"]) > max_length
            out.write(json.dumps({"id": row["id"], "input_ids": ids, "loss_mask": mask}) + "\n")
    os.replace(tmp, path)
    return {
        "rows_in": counts["rows_in"],
        "rows": counts["rows"],
        "tokens": counts["tokens"],
        "loss_tokens": counts["loss_tokens"],
        "cut_at_max_length": counts["cut"],
        "dropped": dict(sorted(dropped.items())),
    }


# -- config ----------------------------------------------------------------------------------------


def devices(gpus: int) -> list[str]:
    """The run's GPUs as CUDA ordinals: the ones CUDA_VISIBLE_DEVICES names (SpecForge's launcher sets it
    for each of its processes), else the first ``gpus``."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return (visible or [str(i) for i in range(gpus)])[:gpus]


def free_ports(n: int) -> list[int]:
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(n):
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    return ports


def deployment(run: dict[str, Any], work: Path, ports: list[int]) -> dict[str, Any]:
    """SpecForge's managed single-node online deployment over the run's GPUs."""
    tp = int(run["settings"]["capture_server"]["tp_size"])
    gpus = devices(int(run["gpus"]))
    if len(gpus) < tp + 1:
        raise SystemExit(
            f"SpecForge's online DFlash run needs the capture server's {tp} GPU(s) (capture_server.tp_size) "
            f"and one for the trainer at least, on separate GPUs: train.gpus is {run['gpus']}"
            + (f" ({len(gpus)} visible)" if len(gpus) != int(run["gpus"]) else "")
        )
    capture, trainer = gpus[:tp], gpus[tp:]
    rpc, metadata, metrics, port = ports
    return {
        "mode": "disaggregated",
        "trainer": {"nnodes": 1, "nproc_per_node": len(trainer)},
        "disaggregated": {
            "control_dir": str(work / CONTROL),
            "backend": "mooncake",
            "managed_local": {
                "trainer_cuda_visible_devices": trainer,
                "mooncake": {"rpc_port": rpc, "metadata_port": metadata, "metrics_port": metrics},
                "capture_servers": [{"port": port, "cuda_visible_devices": capture, "tp_size": tp}],
            },
        },
    }


def config(run: dict[str, Any], work: Path, ports: list[int] | None = None) -> dict[str, Any]:
    """SpecForge's run config for ``run`` (its settings by section, defaults filled in by the stage)."""
    settings = run["settings"]  # every section and key, the defaults filled in (Trainer.settings)
    training = {"strategy": "dflash", **settings["training"]}
    plan = deployment(run, work, ports or free_ports(4))
    quantum = plan["trainer"]["nproc_per_node"] * int(training["batch_size"]) * int(training["accumulation_steps"])
    cfg: dict[str, Any] = {
        "model": {"target_model_path": str(run["target"]), **settings["model"]},
        "data": {"prompts_path": str(work / PROMPTS), "cache_dir": str(work / "cache"), **settings["data"]},
        "training": training,
        "deployment": plan,
        "run_id": RUN_ID,
        "output_dir": str(work / OUTPUT),
    }
    if quantum > DEFAULT_LOW:  # the producer's window must hold one global optimizer step (speed, not weights)
        cfg["runtime"] = {
            "in_flight_high_watermark": max(DEFAULT_HIGH, 2 * quantum),
            "in_flight_low_watermark": quantum,
        }
    return cfg


def optimizer_steps(cfg: dict[str, Any], prompts: int) -> int:
    """The steps SpecForge's online schedule runs (training/schedule.py, resolve_online_total_steps), capped
    by max_steps."""
    training = cfg["training"]
    quantum = cfg["deployment"]["trainer"]["nproc_per_node"] * int(training["batch_size"])
    quantum *= int(training["accumulation_steps"])
    steps = prompts * int(training["num_epochs"]) // quantum
    cap = training["max_steps"]
    return min(steps, int(cap)) if cap else steps


def check(path: Path) -> None:
    """The config as SpecForge reads it (its pydantic classes refuse an unknown or wrong key) and resolves
    it against its DFlash registration: one line before anything starts."""
    import specforge.config
    from specforge.application import resolve_run

    try:
        resolve_run(specforge.config.load_config(str(path)))
    except ValueError as e:  # pydantic's ValidationError is one
        raise SystemExit(f"SpecForge refuses {path}: {e}") from None


def write_config(cfg: dict[str, Any], path: Path) -> None:
    import yaml

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
    os.replace(tmp, path)


# -- training --------------------------------------------------------------------------------------

# SpecForge's console logger (training/assembly.py, _logger): "step 12: {'loss': 3.2, 'accuracy': ...}";
# through a tracker the keys are "train/loss", ...
_LOGGED = re.compile(r"^step (?P<step>\d+): \{")
_LOSS = re.compile(r"'(?:train/)?loss': (?P<loss>[-+]?(?:[0-9.]+(?:[eE][-+]?\d+)?|nan|inf))")


class Follow:
    """SpecForge's lines, passed through, and a progress line for each step it logs."""

    def __init__(self, steps: int) -> None:
        self.steps, self.step, self.loss = steps, 0, None

    def line(self, line: str) -> None:
        print(line, flush=True)
        logged, loss = _LOGGED.match(line), _LOSS.search(line)
        if logged is None or loss is None or int(logged["step"]) <= self.step:  # each rank may log it
            return
        self.step, self.loss = int(logged["step"]), float(loss["loss"])
        print(f"step {self.step}/{self.steps} loss {self.loss:.4f}", flush=True)


def environment() -> dict[str, str]:
    """This interpreter's bin folder first on PATH: Mooncake's mooncake_master installs there."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def train(argv: list[str], work: Path, follow: Follow) -> int:
    """``specforge train``; a SIGTERM to this runner stops it (SpecForge's supervisor stops its own)."""
    proc = subprocess.Popen(
        argv, cwd=work, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            follow.line(line.rstrip("\n"))
        return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def latest_checkpoint(output: Path) -> Path:
    """The newest ``{run_id}-step{N}`` folder (training/checkpoint.py's layout; ``-latest`` points at it)."""
    link = output / f"{RUN_ID}-latest"
    if link.exists():
        return link.resolve()
    steps = [(int(m[1]), p) for p in output.glob(f"{RUN_ID}-step*") if (m := re.search(r"-step(\d+)$", p.name))]
    if not steps:
        raise SystemExit(f"SpecForge finished without a checkpoint in {output}")
    return max(steps)[1]


def draft_config(config_path: Path, state: dict[str, Any], path: Path) -> None:
    """The draft config SpecForge derives from the run's config (the one it trained), with the mask token,
    capture layers and block size the checkpoint records."""
    from specforge.application import resolve_run
    from specforge.config import load_config
    from specforge.training.model_loading import resolve_draft_config

    cfg = load_config(str(config_path))
    provider = resolve_run(cfg).algorithm.providers.model.draft_config
    draft = resolve_draft_config(cfg, provider=provider)
    method = dict(getattr(draft, "dflash_config", None) or {})
    if state.get("dflash_mask_token_id") is not None:
        method["mask_token_id"] = int(state["dflash_mask_token_id"])
    if state.get("dflash_target_layer_ids") is not None:
        method["target_layer_ids"] = [int(i) for i in state["dflash_target_layer_ids"]]
    if state.get("dflash_block_size") is not None:
        draft.block_size = int(state["dflash_block_size"])
    draft.dflash_config = method
    draft.to_json_file(str(path), use_diff=False)


def export(run: dict[str, Any], work: Path, config_path: Path, out: Path) -> dict[str, Any]:
    """``specforge export --to hf`` of the newest checkpoint into ``out`` (a folder that does not exist)."""
    from specforge.export.checkpoint_io import resolve_training_state

    checkpoint = latest_checkpoint(work / OUTPUT)
    state = resolve_training_state(str(checkpoint))
    draft_config(config_path, state, work / DRAFT_CONFIG)
    argv = [
        sys.executable,
        "-m",
        "specforge.cli",
        "export",
        "--to",
        "hf",
        "--checkpoint",
        str(checkpoint),
        "--draft-config",
        str(work / DRAFT_CONFIG),
        "--output-dir",
        str(out),
        "--embedding-source",
        str(run["target"]),
    ]
    print(" ".join(argv), flush=True)
    done = subprocess.run(argv, cwd=work, env=environment())
    if done.returncode != 0 or not (out / "config.json").exists():
        raise SystemExit(f"specforge export stopped (exit {done.returncode}) on {checkpoint}")
    return {"checkpoint": checkpoint.name, "steps": int(state.get("global_step", 0))}


def version() -> str:
    import importlib.metadata

    return importlib.metadata.version("specforge")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specforge_run", description=__doc__.splitlines()[0])
    parser.add_argument("run_file")
    parser.add_argument("--plan", action="store_true", help="write the prompts and config, print SpecForge's plan")
    args = parser.parse_args(argv)
    run = json.loads(Path(args.run_file).read_text())
    work, out = Path(run["work"]).resolve(), Path(run["out"]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    # the managed deployment wants a fresh control folder and cannot resume: a new run starts over
    shutil.rmtree(work / CONTROL, ignore_errors=True)
    if not args.plan:
        shutil.rmtree(work / OUTPUT, ignore_errors=True)
    cfg = config(run, work)
    counts = write_prompts(run["rows"], work / PROMPTS, int(cfg["data"]["max_length"]))
    if counts["rows"] == 0:
        print(f"no row of the dataset is one SpecForge's DFlash trains on: {counts}", file=sys.stderr)
        return 2
    steps = optimizer_steps(cfg, counts["rows"])
    if steps < 1:
        print(
            f"{counts['rows']} rows make no optimizer step at a global batch of "
            f"{cfg['deployment']['trainer']['nproc_per_node']} GPUs x batch_size x accumulation_steps",
            file=sys.stderr,
        )
        return 2
    write_config(cfg, work / CONFIG)
    check(work / CONFIG)
    command = [sys.executable, "-m", "specforge.cli", "train", "-c", str(work / CONFIG)]
    if args.plan:
        return subprocess.run([*command, "--plan"], cwd=work, env=environment()).returncode
    print(
        f"specforge: {counts['rows']} rows of {counts['rows_in']} ({counts['dropped'] or 'none dropped'})", flush=True
    )
    started = time.monotonic()
    follow = Follow(steps)
    code = train(command, work, follow)
    if code != 0:
        print(f"specforge train stopped (exit {code})", file=sys.stderr)
        return code
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    exported = export(run, work, work / CONFIG, tmp)
    record = {
        "trainer": "specforge",
        "version": version(),
        "steps": exported["steps"] or follow.step,
        "steps_planned": steps,
        "final_loss": follow.loss,
        "train_seconds": round(time.monotonic() - started, 1),
        "checkpoint": exported["checkpoint"],
        "data": counts,
    }
    (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"specforge: {out} ({record['steps']} steps, loss {record['final_loss']})", flush=True)
    return 0


def _unshadow() -> None:
    """Run as a script, this file's folder is first on sys.path, and it holds dflash_build's own
    ``specforge.py`` (the trainer's descriptor), which would shadow the package: leave it out."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != here]


if __name__ == "__main__":
    _unshadow()
    raise SystemExit(main())
