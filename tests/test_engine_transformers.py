"""The transformers backend on a real (tiny, random-weight) model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_build.engines import Request, SamplingParams
from dflash_build.engines.transformers_backend import TransformersEngine, filter_logits

PARAMS = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_new_tokens=8)


def requests(params: SamplingParams = PARAMS) -> list[Request]:
    prompts = [[1, 520, 9531, 198], [1, 4093, 198, 6004, 2, 198, 1, 520], [1, 42], [1, 42]]
    return [Request(f"p{i}", i % 2, ids, params, seed=1000 + i) for i, ids in enumerate(prompts)]


def run(engine: TransformersEngine, reqs: list[Request]) -> dict[str, tuple[list[int], str]]:
    return {r.prompt_id: (r.output_ids, r.finish_reason) for r in engine.generate(reqs)}


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> TransformersEngine:
    return TransformersEngine(str(tiny_model), {"device": "cpu", "batch_size": 4}, stop_token_ids=[2])


def test_each_row_samples_with_its_own_seed_whatever_its_batch(tiny_model: Path, engine: TransformersEngine) -> None:
    batched = run(engine, requests())
    alone = run(TransformersEngine(str(tiny_model), {"batch_size": 1}, stop_token_ids=[2]), requests())
    assert batched == alone
    assert batched["p2"] != batched["p3"], "same prompt, other seed: another sample"
    reseeded = [Request(r.prompt_id, r.sample_idx, r.prompt_ids, r.params, r.seed + 1) for r in requests()]
    assert run(engine, reseeded) != batched


def test_rows_finish_on_length_or_on_a_stop_token(tiny_model: Path) -> None:
    greedy = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, max_new_tokens=5)
    plain = TransformersEngine(str(tiny_model), {}, stop_token_ids=[2])
    [result] = plain.generate([Request("p", 0, [1, 42, 43], greedy, seed=0)])
    assert result.finish_reason == "length" and len(result.output_ids) == 5 and result.stop_token_id is None
    # make the third greedy token a stop token: the row stops there, without it in output_ids
    stop_at = result.output_ids[2]
    first = result.output_ids.index(stop_at)
    stopping = TransformersEngine(str(tiny_model), {}, stop_token_ids=[2, stop_at])
    [stopped] = stopping.generate([Request("p", 0, [1, 42, 43], greedy, seed=0)])
    assert stopped.finish_reason == "stop" and stopped.stop_token_id == stop_at
    assert stopped.output_ids == result.output_ids[:first]


def test_unknown_options_are_refused(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match=r"engine\.options"):
        TransformersEngine(str(tiny_model), {"batchsize": 4}, stop_token_ids=[2])


def test_filter_logits_cuts() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda out: (out > float("-inf")).squeeze(0).tolist()  # noqa: E731
    assert keep(filter_logits(logits, 1.0, 2, 1.0, 0.0)) == [True, True, False, False]
    assert keep(filter_logits(logits, 1.0, 0, 0.8, 0.0)) == [True, True, False, False]
    assert keep(filter_logits(logits, 1.0, 0, 0.81, 0.0)) == [True, True, True, False]
    assert keep(filter_logits(logits, 1.0, 0, 1.0, 0.2)) == [True, True, True, False]
    assert keep(filter_logits(logits, 1.0, -1, 1.0, 0.0)) == [True] * 4


def test_a_hub_model_loads_at_its_pinned_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hub here: the loader's call is what is checked (the revision gen_key names must be the one loaded)."""
    import transformers

    from dflash_build.engines import transformers_backend

    seen: dict[str, object] = {}

    class Loaded:
        def to(self, device: str) -> Loaded:
            return self

        def eval(self) -> Loaded:
            return self

    def from_pretrained(path: str, **kwargs: object) -> Loaded:
        seen.update(path=path, **kwargs)
        return Loaded()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    transformers_backend.load_model("org/model", "cpu", torch.float32, "a" * 40)
    assert seen == {"path": "org/model", "dtype": torch.float32, "revision": "a" * 40}


@pytest.mark.parametrize("cut", [1, 3, 6])
def test_an_answer_continued_from_its_prefix_is_the_fresh_answer(engine: TransformersEngine, cut: int) -> None:
    fresh = run(engine, requests())
    limit = PARAMS.max_new_tokens
    continued = [
        Request(r.prompt_id, r.sample_idx, r.prompt_ids + fresh[r.prompt_id][0][:cut], r.params, r.seed)
        for r in requests(SamplingParams(1.0, 1.0, 0, 0.0, limit - cut))
        if len(fresh[r.prompt_id][0]) > cut
    ]
    assert continued, "rows long enough to cut"
    for prompt_id, (rest, reason) in run(engine, continued).items():
        assert fresh[prompt_id][0][:cut] + rest == fresh[prompt_id][0] and reason == fresh[prompt_id][1]
