"""Transformers backend: CPU demo, tests and small GPU runs.

It runs its own decoding loop instead of ``model.generate`` so that every sampled position draws from
a generator seeded with (the row's seed, the position in the sequence), as SGLang's seeded sampler
does: a row's answer does not depend on which rows share its batch, and an answer continued from a
prefix (prompt + prefix as the prompt) draws exactly what the fresh answer drew at each position.
Rows are batched by prompt length; finished rows leave the batch (and the KV cache) at once.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from dflash_build import killpoints, loops
from dflash_build.engines import registry
from dflash_build.engines.base import Request, Result, position_seed

log = logging.getLogger(__name__)
BACKEND = registry.get("transformers")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(path: str, device: str, dtype: torch.dtype, revision: str | None = None) -> Any:
    """A local folder or .gguf file, or a hub id at its pinned ``revision`` (the one gen_key names)."""
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path), dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, revision=revision)
    return model.to(device).eval()


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Apply temperature, then top-k, min-p and top-p cut-offs, to a (batch, vocab) tensor of logits."""
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0:
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


class TransformersEngine:
    def __init__(
        self, model_path: str, options: Mapping[str, Any], stop_token_ids: list[int], revision: str | None = None
    ) -> None:
        BACKEND.check(options)
        self.device = str(BACKEND.value(options, "device"))
        dtype_name = str(BACKEND.value(options, "dtype"))
        if dtype_name not in _DTYPES:
            raise ValueError(f"config key 'engine.options.dtype': '{dtype_name}' is not one of {sorted(_DTYPES)}")
        self.batch_size = int(BACKEND.value(options, "batch_size"))
        if BACKEND.value(options, "threads") is not None:
            torch.set_num_threads(int(options["threads"]))
        self.stop_token_ids = set(stop_token_ids)
        self.model = load_model(model_path, self.device, _DTYPES[dtype_name], revision)
        # transformers 5 renamed `past_key_values` to `cache` (the old name goes in 5.40)
        self.cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        config = self.model.config
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else stop_token_ids[0]
        self.stopping = False
        self.steps = 0  # decoding steps so far: the job's heartbeat sees an engine that makes no progress

    def interrupt(self) -> None:
        self.stopping = True  # checked between decoding steps

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        groups: dict[Any, list[Request]] = {}
        for r in requests:  # one batch holds one set of sampling params (continuations have their own)
            groups.setdefault(r.params, []).append(r)
        for group in groups.values():
            ordered = sorted(group, key=lambda r: (-len(r.prompt_ids), r.prompt_id, r.sample_idx))
            for start in range(0, len(ordered), self.batch_size):
                if self.stopping:
                    return
                yield from self._batch(ordered[start : start + self.batch_size])

    def close(self) -> None:
        del self.model

    @torch.inference_mode()
    def _batch(self, batch: list[Request]) -> Iterator[Result]:
        params = batch[0].params
        if any(r.params != params for r in batch):
            raise ValueError("one batch holds one set of sampling params")
        width = max(len(r.prompt_ids) for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            input_ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        outputs: list[list[int]] = [[] for _ in batch]
        active = list(range(len(batch)))  # batch rows still generating, in cache order
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
        )
        cache = getattr(out, self.cache_arg)
        logits = out.logits[:, -1, :]
        while active and not self.stopping:
            self.steps += 1
            killpoints.hang_at_step(self.steps)
            # the draw for each row depends only on its seed and the position being sampled
            seeds = [position_seed(batch[i].seed, len(batch[i].prompt_ids) + len(outputs[i])) for i in active]
            tokens = self._sample(logits, params, seeds)
            still: list[int] = []
            for pos, row in enumerate(active):
                done = self._step(batch[row], outputs[row], int(tokens[pos]))
                if done is not None:
                    yield done
                else:
                    still.append(pos)
            if not still:
                return
            if len(still) < len(active):
                keep = torch.tensor(still, device=self.device)
                cache.batch_select_indices(keep)
                attention, tokens = attention[keep], tokens[keep]
                active = [active[p] for p in still]
            attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=-1)
            out = self.model(
                input_ids=tokens.unsqueeze(-1).to(self.device),
                attention_mask=attention,
                position_ids=attention.sum(-1, keepdim=True) - 1,
                use_cache=True,
                **{self.cache_arg: cache},
            )
            cache = getattr(out, self.cache_arg)
            logits = out.logits[:, -1, :]

    def _step(self, request: Request, output: list[int], token: int) -> Result | None:
        """Add one sampled token to a row's answer; the row's result when it ends there."""
        if token in self.stop_token_ids:
            return Result(request.prompt_id, request.sample_idx, output, "stop", stop_token_id=token)
        output.append(token)
        rule = request.stop_loops
        if rule is not None and len(output) % loops.CHECK_EVERY == 0:
            end = loops.loop_end(output, rule, clear=len(output) - loops.CHECK_EVERY)
            if end is not None:  # cut where the rule first fired: the same row whatever the check's step
                return Result(request.prompt_id, request.sample_idx, output[:end], "loop")
        if len(output) >= request.params.max_new_tokens:
            return Result(request.prompt_id, request.sample_idx, output, "length")
        return None

    @staticmethod
    def _sample(logits: torch.Tensor, params: Any, seeds: list[int]) -> torch.Tensor:
        if params.temperature == 0:
            return logits.argmax(dim=-1).cpu()
        probs = torch.softmax(
            filter_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p), dim=-1
        ).cpu()
        return torch.cat(
            [torch.multinomial(probs[i], 1, generator=torch.Generator().manual_seed(s)) for i, s in enumerate(seeds)]
        )
