"""What a prompt is: its id (the digest of what the model is shown), the key duplicates share, its
seeded selection rank and the shard a run of prompt ids falls in."""

from __future__ import annotations

import unicodedata
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_build import hashing
from dflash_build.spec import HeldOut, VariantDraw
from dflash_build.stages.prepare import columnar


def _body(
    messages: list[dict[str, str]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None
) -> dict[str, Any]:
    body = {"messages": messages, "tools": None if tools is None else hashing.normalise(tools)}
    if kwargs:  # only when a source reads them, so every other prompt keeps its id
        body["template_kwargs"] = hashing.normalise(kwargs)
    return body


def prompt_id(
    messages: list[dict[str, str]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None = None
) -> str:
    """The prompt's identity: its messages, tools and (where a source reads them) template kwargs, as
    the same messages rendered with thinking on or off are two prompts."""
    # messages are str-to-str dicts already (to_prompt makes them), so only the tools need normalising
    return hashing.digest_normalised(_body(messages, tools, kwargs))[: hashing.KEY_LENGTH]


def dedup_key(
    messages: list[dict[str, str]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None = None
) -> str:
    """What duplicates share: the digest a prompt id takes (:func:`prompt_id`'s body, whole) of the
    messages after Unicode NFC, whitespace folding and trimming. So a row that folding leaves as it
    is has its prompt id's digest. Only compared within one prepare, never stored."""
    normalize = unicodedata.normalize
    folded = [{"role": m["role"], "content": " ".join(normalize("NFC", m["content"]).split())} for m in messages]
    return hashing.digest_normalised(_body(folded, tools, kwargs))


def selection_rank(seed: int, pid: str) -> str:
    return hashing.digest({"seed": seed, "prompt_id": pid})


def selection_ranks(seed: int, pids: Any) -> bytes:
    """:func:`selection_rank` of each prompt id (64-bit integers): the first 16 bytes of each digest."""
    head, tail = b'{"prompt_id":"', f'","seed":{hashing.canonical_json(seed)}}}'.encode()
    bodies = np.empty((len(pids), len(head) + 16 + len(tail)), dtype=np.uint8)
    bodies[:, : len(head)] = np.frombuffer(head, dtype=np.uint8)
    hex_ids = np.asarray(pids, dtype=">u8").tobytes().hex().encode("ascii")
    bodies[:, len(head) : len(head) + 16] = np.frombuffer(hex_ids, dtype=np.uint8).reshape(-1, 16)
    bodies[:, len(head) + 16 :] = np.frombuffer(tail, dtype=np.uint8)
    width = bodies.shape[1]
    offsets = pa.py_buffer(np.arange(0, width * len(pids) + 1, width, dtype=np.int64).tobytes())
    texts = pa.LargeStringArray.from_buffers(len(pids), offsets, pa.py_buffer(bodies.tobytes()))
    return columnar.digests(texts, 16)


# Set apart from the mix's ranks, which also hash prompt ids: a variant draw does not track a rank.
_DRAW_SALT = np.uint64(0x76617269616E7473)  # "variants"


def drawn_variant(pids: Any, draw: VariantDraw) -> np.ndarray:
    """The variant each prompt (64-bit prompt ids) is generated under, by ``draw``'s shares: a uniform
    value from SplitMix64 of the prompt id against the cumulative shares in variant-name order. It
    depends on the prompt id alone: the same in any row order, for every source that holds the prompt,
    and unchanged for the other prompts when prompts are added or removed. Names of ``draw.every`` are
    never drawn (they take every prompt)."""
    names = sorted(draw.shares)
    weights = np.array([draw.shares[n] for n in names], dtype=np.float64)
    bounds = np.cumsum(weights / weights.sum())
    uniform = (hashing.splitmix64(np.asarray(pids, dtype=np.uint64) ^ _DRAW_SALT) >> np.uint64(11)).astype(
        np.float64
    ) / float(1 << 53)
    at = np.minimum(np.searchsorted(bounds, uniform, side="right"), len(names) - 1)
    return np.array(names, dtype=object)[at]


_HELD_OUT_SALT = np.uint64(0x68656C645F6F7574)  # "held_out"


def held_out(pids: Any, spec: HeldOut | None) -> np.ndarray:
    """The prompt ids (64-bit, ascending) held out of training for the eval split (config key `eval`):
    those whose SplitMix64 value (salted apart from the variant draw) falls below ``spec.share``, the
    ``spec.cap`` smallest of them. A function of the prompt id alone, so a prompt is held out of every
    source that holds it (unless the cap stops it there), and adding prompts holds out no other."""
    pids = np.asarray(pids, dtype=np.uint64)
    if spec is None or not len(pids):
        return np.zeros(0, dtype=np.uint64)
    value = hashing.splitmix64(pids ^ _HELD_OUT_SALT)
    below = value < np.uint64(min(int(spec.share * 2.0**64), 2**64 - 1))
    chosen = pids[below][np.argsort(value[below], kind="stable")[: spec.cap]]
    return np.sort(chosen)


def shard_bounds(n_rows: int, n_shards: int) -> list[tuple[int, int]]:
    return [(i * n_rows // n_shards, (i + 1) * n_rows // n_shards) for i in range(n_shards)]
