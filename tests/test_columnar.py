"""Prepare's batch conversion (dflash_build.stages.columnar) writes exactly what the row path writes.

Every test here runs prepare twice on the same quirky rows, once as it is and once with the batch
conversion switched off (every row through ``inputs.to_prompt``), and requires the same manifest
(counts, drops, drop examples, shard hashes) and the same shard rows; and that the batch conversion
really took most of the rows, so the comparison cannot pass by everything falling back.
"""

from __future__ import annotations

import json
import random
import unicodedata
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import plan as plan_mod
from dflash_build.stages import prepare
from dflash_build.stages.prepare import columnar
from dflash_build.stages.registry import planned
from tests.conftest import write_jsonl

TEXTS = [
    "plain words here",
    "two  spaces",
    " leading and trailing ",
    "tab\tand\nnewline\r\n",
    'a "quote" and a \\ backslash',
    "control \x01 \x1f \x7f chars",
    "caf\u00e9 composed",
    "cafe\u0301 decomposed",
    "no\u00a0break\u3000ideographic\u2028line\x85next",
    "emoji \U0001f600 and \u0130 dotted",
    "file sep\x1cgroup\x1drecord\x1eunit\x1f",
    "\u037e greek question mark",
    "x" * 300,
    "",
    "   ",
    "\u3000",
    "\x1c",
]
ROLES_IN = ["human", "gpt", "system", "user", "assistant", "tool", "Human", "GPT", "narrator", "\uff48uman"]


def _text(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.03:
        return None
    return " ".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 3))) if r > 0.2 else rng.choice(TEXTS)


def _row(rng: random.Random, fmt: str) -> dict[str, Any]:
    row: dict[str, Any] = {}
    if fmt in ("sharegpt", "hermes", "messages"):
        role, content = ("from", "value") if fmt != "messages" else ("role", "content")
        weights = [6, 6, 1, 2, 2, 1, 1, 1, 0.3, 0.2]
        turns = []
        for _ in range(rng.randint(0, 5)):
            turn = {role: rng.choices(ROLES_IN, weights)[0], content: _text(rng)}
            if rng.random() < 0.02:
                del turn[role]
            turns.append(turn)
        if turns and turns[0].get(role) not in ("human", "user", "Human") and rng.random() < 0.7:
            turns.insert(0, {role: "human", content: rng.choice(TEXTS[:13])})
        row["conversations" if fmt != "messages" else "messages"] = turns
        if fmt == "hermes" and rng.random() < 0.2:
            schema = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
            row["conversations"].insert(0, {"from": "system", "value": f"Use <tools> {json.dumps(schema)} </tools>"})
        if fmt == "messages" and rng.random() < 0.15:
            row["tools"] = json.dumps([{"type": "function", "function": {"name": "f"}}])
    elif fmt == "alpaca":
        row["instruction"] = _text(rng)
        row["input"] = rng.choice([None, "", "  ", "extra context", "more\ttext"])
    else:
        row["p"] = _text(rng)
    if fmt != "messages" and rng.random() < 0.3:
        row["system"] = rng.choice([None, "", " ", "You are helpful.", "sys\twith  space"])
    return row


def _rows(rng: random.Random, fmt: str, n: int) -> list[dict[str, Any]]:
    rows = [_row(rng, fmt) for _ in range(n)]
    return rows + [json.loads(json.dumps(rows[i])) for i in rng.sample(range(n), n // 5)]  # exact copies


def _prepare_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: dict[str, Any]
) -> tuple[dict[str, Any], int, int]:
    """prepare.run with and without the batch conversion; returns the manifest, the rows in, and how
    many rows the batch conversion took."""
    monkeypatch.setattr(prepare.read, "JSONL_CHUNK_BYTES", 3000)  # many chunks: some Arrow reads, some not
    monkeypatch.setattr(prepare.read, "BATCH_ROWS", 64)
    monkeypatch.setattr(prepare.spill, "ROWS_PER_BUCKET", 16)
    plain_rows = []
    convert = columnar.convert

    def counting(*args: Any) -> columnar.Converted | None:
        result = convert(*args)
        plain_rows.append(0 if result is None else int(result.plain.sum()))
        return result

    results = []
    for label, converter in (("batch", counting), ("rows", lambda *args: None)):
        monkeypatch.setattr(columnar, "convert", converter)
        raw = {
            "store": str(tmp_path / f"store-{label}"),
            "shard_size": 13,
            "model": {"path": str(tmp_path / "model.gguf")},
            "sources": {"s": {"category": "c", "max_drop_fraction": 1.0, **source}},
            "mix": {"categories": {"c": 1}},
        }
        (tmp_path / "model.gguf").write_bytes(b"gguf")
        (tmp_path / f"{label}.yaml").write_text(yaml.safe_dump(raw))
        plan = plan_mod.build(cfg.load(tmp_path / f"{label}.yaml"))
        manifest = prepare.run(planned(plan, "prepare", "s"))
        shards = [
            pq.read_table(plan.prompt_dir("s") / f"{name}.parquet").to_pylist() for name in plan.sources["s"].shards
        ]
        results.append((manifest, shards))
    (batch_manifest, batch_shards), (row_manifest, row_shards) = results
    assert batch_shards == row_shards
    for manifest in (batch_manifest, row_manifest):
        del manifest["prompt_key"], manifest["components"]  # their store paths differ
    assert batch_manifest == row_manifest
    return batch_manifest, batch_manifest["rows_in"], sum(plain_rows)


@pytest.mark.parametrize("turns", ["first", "all"])
@pytest.mark.parametrize("fmt", ["sharegpt", "hermes", "messages", "alpaca", "prompt"])
def test_batch_conversion_equals_the_row_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, turns: str
) -> None:
    if turns == "all" and fmt in ("alpaca", "prompt"):
        pytest.skip("turns only applies to conversations")
    rng = random.Random(f"{fmt}-{turns}")
    rows = _rows(rng, fmt, 400)
    folder = tmp_path / "in"
    write_jsonl(folder / "a.jsonl", rows[:150])
    lines = (folder / "a.jsonl").read_bytes().split(b"\n")
    lines[7:7] = [b"", b"  ", b"{broken", b'{"x": 1} {"x": 2}', b"\xff\xfe not utf-8", b"null"]
    # a chunk whose only quirks cancel out in a row count: a blank line and two objects on one line
    lines[90:90] = [b" \t\r", lines[95] + b" " + lines[96]]
    (folder / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines))  # a BOM, blank and bad lines
    write_jsonl(folder / "c.jsonl", rows[150:300])
    (folder / "c.jsonl").write_text((folder / "c.jsonl").read_text().replace('"value": null', '"value": 7', 3))
    pq.write_table(pa.Table.from_pylist(rows[300:]), folder / "d.parquet")
    source: dict[str, Any] = {"format": fmt, "files": [str(folder / "*.jsonl"), str(folder / "d.parquet")]}
    if fmt in ("sharegpt", "hermes", "messages"):
        source["turns"] = turns
    if fmt == "prompt":
        source["fields"] = {"prompt": "p"}
    if fmt in ("sharegpt", "alpaca"):
        source["filters"] = {"min_chars": 12, "max_chars": 200}
    manifest, _, by_batch = _prepare_both(tmp_path, monkeypatch, source)
    assert manifest["rows_out"] > 50 and manifest["drops"]
    assert by_batch > manifest["rows_out"] * 0.5, f"the batch conversion took only {by_batch} rows"


def test_batch_conversion_of_a_local_hub_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hub").mkdir()
    pq.write_table(pa.Table.from_pylist(_rows(random.Random(3), "sharegpt", 300)), tmp_path / "hub" / "train.parquet")
    source = {"format": "sharegpt", "hf": {"path": str(tmp_path / "hub")}}
    manifest, rows_in, by_batch = _prepare_both(tmp_path, monkeypatch, source)
    assert rows_in == 360 and by_batch > manifest["rows_out"] * 0.5


def test_every_python_whitespace_and_escape_is_handled_like_python() -> None:
    """Each whitespace and control character, in every position, folds and escapes as Python does."""
    specials = [chr(c) for c in range(0x3001) if chr(c).isspace() or c < 0x20 or c in (0x22, 0x5C, 0x7F)]
    assert not any(chr(c).isspace() for c in range(0x3001, 0x110000))
    texts = []
    for ch in specials:
        texts += [ch, f"a{ch}b", f"{ch}a", f"a{ch}", f"a {ch} b", f"a{ch}{ch}b", f"\u00e9{ch}x", f"e\u0301{ch}"]
    array = pa.array(texts)
    escaped, refolded_at, refolded = columnar.escaped_texts(array)
    assert escaped.to_pylist() == [encode_basestring(t)[1:-1] for t in texts]
    expected_fold = [" ".join(unicodedata.normalize("NFC", t).split()) for t in texts]
    changed = [i for i, (t, f) in enumerate(zip(texts, expected_fold, strict=True)) if t != f]
    assert refolded_at.tolist() == changed
    assert refolded.to_pylist() == [encode_basestring(expected_fold[i])[1:-1] for i in changed]
    blank = [not t.strip() for t in texts]
    assert columnar._blank(array).tolist() == blank


@pytest.mark.parametrize("block_words", [1, 3, 8192])
def test_the_scan_never_misses_a_string_that_escaping_or_folding_changes(
    monkeypatch: pytest.MonkeyPatch, block_words: int
) -> None:
    """Random strings of plain and special characters at every alignment to the 8-byte words, in
    arrays sliced at random offsets and scanned in blocks of every size."""
    monkeypatch.setattr(columnar, "SCAN_WORDS", block_words)
    specials = [chr(c) for c in range(0x20)] + ['"', "\\", "  ", "\x7f", "\u00e9", "\u3000", "\U0001f600", "~"]

    def changes(t: str) -> bool:
        return bool(t) and (not t.isascii() or encode_basestring(t)[1:-1] != t or " ".join(t.split()) != t)

    rng = random.Random(block_words)
    for _ in range(1500):
        texts = [
            "".join(
                rng.choice(specials) if rng.random() < 0.05 else rng.choice("ab c") for _ in range(rng.randint(0, 20))
            )
            for _ in range(rng.randint(1, 30))
        ]
        array = pa.array(texts).slice(rng.randint(0, min(3, len(texts) - 1)))
        flagged = columnar._may_change(array)
        missed = [t for t, f in zip(array.to_pylist(), flagged, strict=True) if changes(t) and not f]
        assert not missed
    plain = pa.array(["plain words with single spaces"] * 50)
    assert not columnar._may_change(plain).any(), "a plain string is never flagged"


def test_line_chunks_find_lines_and_blank_lines_as_python_does() -> None:
    from dflash_build import readers

    rng = random.Random(5)
    pieces = [b"", b" ", b"\t", b"\r", b"\x0b", b"\x0c", b"\x1c", b"{}", b'{"a": 1}', b"x", b"\xc2\xa0", b"  {} "]
    for _ in range(500):
        lines = [b"".join(rng.choices(pieces, k=rng.randint(0, 3))) for _ in range(rng.randint(1, 12))]
        data = b"\n".join(lines) + rng.choice([b"", b"\n"])
        if not data:
            continue
        chunk = readers.LineChunk.of(3, data)
        expected = data.split(b"\n")
        if data.endswith(b"\n"):
            expected.pop()
        assert [chunk.line(i) for i in range(len(chunk))] == expected
        assert chunk.has_blank_line() == (not all(map(bytes.strip, expected)))


def test_an_empty_string_is_appended_without_copying_the_characters() -> None:
    texts = pa.array(["ab", "", "c\u00e9", None, "d"])
    for array in (texts, texts.slice(1), texts.slice(4), texts.slice(0, 3), pa.array([], pa.string())):
        appended = columnar._and_empty(array)
        appended.validate(full=True)
        assert appended.to_pylist() == [*array.to_pylist(), ""]
    whole = columnar._and_empty(texts.slice(0, 3))
    assert whole.buffers()[2].address == texts.buffers()[2].address


def test_digests_are_sha256_prefixes() -> None:
    import hashlib

    bodies = pa.array(["", "a", "\u00e9" * 1000, "{}"]).slice(1)
    assert columnar.digests(bodies, 8) == b"".join(hashlib.sha256(t.encode()).digest()[:8] for t in bodies.to_pylist())
    assert len(columnar.digests(pa.array([], pa.string()), 16)) == 0
    assert np.frombuffer(columnar.digests(bodies, 16), dtype=np.uint8).size == 48
