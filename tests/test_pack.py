"""The optional pack stage: every mixed sample packed exactly once (or counted), exact boundaries.

The packer is checked on random lengths; the stage on the real workflow (tiny model, real Snakemake),
against the mixed dataset it reads.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build.stages.pack import pack_lengths
from tests.conftest import Workflow, base_config, once_per_session, write_jsonl


@pytest.mark.parametrize("seed", range(5))
def test_every_item_lands_in_exactly_one_bin_within_capacity(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([16, 100, 1000])
    lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 3000))]
    bins = pack_lengths(lengths, capacity)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # no two bins could be merged, and the result is the same every time
    totals = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(totals) < 2 or totals[0] + totals[1] > capacity
    assert pack_lengths(lengths, capacity) == bins


def test_an_item_longer_than_the_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="item 1 has length 9"):
        pack_lengths([3, 9], 8)


PROMPTS = [f"task {i}: " + "word " * (i % 7) for i in range(40)]


def _config(root: Path, model: Path, **pack: Any) -> dict[str, Any]:
    data = write_jsonl(root / "p.jsonl", [{"instruction": p} for p in PROMPTS])
    # two shards: nothing here is about sharding
    config = base_config(model, {"s": {"category": "c", "files": [str(data)], "format": "alpaca"}}, shard_size=20)
    config["pack"] = pack
    return config


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Workflow:

    def build(root: Path) -> None:
        # samples are 41-48 tokens here: some do not fit a row, and several small windows are packed
        Workflow.at(root, _config(root, tiny_model, seq_len=45, window=7)).build()

    return Workflow(once_per_session(tmp_path_factory, "pack", build))


def mixed_samples(wf: Workflow) -> dict[tuple[str, int], dict[str, Any]]:
    dist = wf.workdir / "dist" / "test-mix"
    out = {}
    for f in json.loads((dist / "manifest.json").read_text())["files"]:
        for row in pq.read_table(dist / f["path"]).to_pylist():
            out[(row["prompt_id"], row["sample_idx"])] = row
    return out


def packed_rows(wf: Workflow, seq_len: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    folder = wf.workdir / "dist" / f"test-mix-packed-{seq_len}"
    manifest = json.loads((folder / "manifest.json").read_text())
    rows = [r for f in manifest["files"] for r in pq.read_table(folder / f["path"]).to_pylist()]
    return manifest, rows


def check_packing(wf: Workflow, seq_len: int, split: bool) -> dict[str, Any]:
    """Each mixed sample exactly once (whole, or in pieces when split), or dropped and counted."""
    samples = mixed_samples(wf)
    manifest, rows = packed_rows(wf, seq_len)
    seen: dict[tuple[str, int], list[tuple[int, list[int], list[int]]]] = {}
    for row in rows:
        assert sum(row["seq_lens"]) == len(row["input_ids"]) == len(row["loss_mask"]) == len(row["position_ids"])
        assert len(row["input_ids"]) == seq_len, "padded to seq_len"
        at = 0
        for i, n in enumerate(row["seq_lens"]):
            positions = row["position_ids"][at : at + n]
            assert positions == list(range(positions[0], positions[0] + n)), "positions run within a segment"
            if i < row["num_samples"]:
                key = (row["prompt_id"][i], row["sample_idx"][i])
                piece = (positions[0], row["input_ids"][at : at + n], row["loss_mask"][at : at + n])
                seen.setdefault(key, []).append(piece)
                assert positions[0] == 0 or split, "whole samples start at position 0"
            else:  # the padding
                assert row["loss_mask"][at : at + n] == [0] * n and row["n_pad"] == n
            at += n
    long = {k for k, s in samples.items() if s["n_tokens"] > seq_len}
    assert manifest["dropped_long"] == (0 if split else len(long))
    assert set(seen) == (set(samples) if split else set(samples) - long)
    for key, pieces in seen.items():
        pieces.sort()
        assert [t for _, ids, _ in pieces for t in ids] == samples[key]["input_ids"]
        assert [m for _, _, mask in pieces for m in mask] == samples[key]["loss_mask"]
        assert len(pieces) == 1 or split
    real = sum(len(ids) for pieces in seen.values() for _, ids, _ in pieces)
    assert manifest["tokens"] == real and manifest["rows"] == len(rows)
    assert manifest["fill_efficiency"] == pytest.approx(real / (len(rows) * seq_len), abs=1e-6)
    return manifest


@pytest.mark.workflow
def test_every_mixed_sample_is_packed_once_or_dropped_and_counted(built: Workflow) -> None:
    manifest = check_packing(built, 45, split=False)
    assert manifest["dropped_long"] > 0, "the fixture should have samples longer than a row"
    assert manifest["rows"] > 1 and "fill" in (built.workdir / "dist" / "test-mix-packed-45" / "README.md").read_text()


@pytest.mark.workflow
def test_the_packed_folder_loads_with_datasets(built: Workflow) -> None:
    import datasets

    folder = built.workdir / "dist" / "test-mix-packed-45"
    ds = datasets.load_dataset(str(folder), split="train")
    assert len(ds) == json.loads((folder / "manifest.json").read_text())["rows"]
    assert set(ds.column_names) >= {"input_ids", "loss_mask", "position_ids", "seq_lens"}


def _copy(built: Workflow, dest: Path) -> Workflow:
    return built.copy_to(dest, registration=True)


def _edit(wf: Workflow, **pack: Any) -> None:
    config = yaml.safe_load((wf.workdir / "config.yaml").read_text())
    config["pack"].update(pack)
    wf.write_config(config)


@pytest.mark.workflow
def test_split_long_samples_come_back_in_pieces_and_nothing_upstream_reruns(built: Workflow, tmp_path: Path) -> None:
    wf = _copy(built, tmp_path / "copy")
    _edit(wf, split_long=True)
    assert set(wf.dry_run()) == {"pack"}
    wf.build()
    manifest = check_packing(wf, 45, split=True)
    assert manifest["split"] > 0


@pytest.mark.workflow
def test_another_seq_len_is_another_folder_and_only_the_pack_job(built: Workflow, tmp_path: Path) -> None:
    wf = _copy(built, tmp_path / "copy")
    _edit(wf, seq_len=256, pad=True)
    assert set(wf.dry_run()) == {"pack"}
    wf.build()
    first, _ = packed_rows(wf, 256)
    check_packing(wf, 256, split=False)
    wf.run("--forcerun", "pack")
    assert packed_rows(wf, 256)[0]["files"] == first["files"], "the same rows for the same seed"
    again = _copy(wf, tmp_path / "again")
    _edit(again, seed=3)
    assert set(again.dry_run()) == {"pack"}, "the pack's own seed reruns it alone"


@pytest.mark.workflow
def test_verify_checks_the_packed_files_and_repair_rebuilds_only_the_pack(built: Workflow, tmp_path: Path) -> None:
    wf = _copy(built, tmp_path / "copy")
    assert wf.cli("verify", check=False).returncode == 0
    folder = wf.workdir / "dist" / "test-mix-packed-45"
    data = next((folder / "data").glob("*.parquet"))
    data.write_bytes(data.read_bytes()[:-10])
    found = wf.cli("verify", check=False)
    assert found.returncode == 1 and "test-mix-packed-45" in found.stdout
    assert wf.cli("verify", "--repair", check=False).returncode == 0
    assert set(wf.dry_run()) == {"pack"}
