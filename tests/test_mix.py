from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import hashing
from dflash_build import plan as plan_mod
from dflash_build.publish import report
from dflash_build.spec import Checks
from dflash_build.stages import mix
from dflash_build.stages.common.targets import category_targets
from dflash_build.stages.mix import variants


def _one_at_a_time(lengths: list[int], target: float) -> list[int]:
    """The selection rule as documented, one sample at a time in rank order."""
    chosen, used = [], 0
    for i, n in enumerate(lengths):
        if used + n / 2 <= target * (1 + 1e-9):
            chosen.append(i)
            used += n
    if not chosen and target > 0 and lengths:  # never empty: the shortest sample, first in rank order
        chosen = [lengths.index(min(lengths))]
    return chosen


def test_without_budget_the_scarcest_category_sets_the_size() -> None:
    targets = category_targets({"a": 0.5, "b": 0.25, "c": 0.25}, {"a": 1000, "b": 100, "c": 900}, None)
    assert targets == pytest.approx({"a": 200, "b": 100, "c": 100})


def test_a_category_without_samples_does_not_zero_the_others() -> None:
    targets = category_targets({"a": 0.5, "b": 0.5}, {"a": 1000}, None)
    assert targets == pytest.approx({"a": 1000, "b": 1000})


def test_budget_targets() -> None:
    assert category_targets({"a": 0.75, "b": 0.25}, {"a": 10, "b": 10}, 400) == {"a": 300, "b": 100}


def test_select_stays_within_half_a_sample_and_takes_everything_when_asked() -> None:
    lengths = [40, 10, 30, 20, 50]
    chosen = np.flatnonzero(mix.take_to_target(np.array(lengths), 60)).tolist()
    assert abs(sum(lengths[i] for i in chosen) - 60) <= max(lengths) / 2
    assert chosen == [0, 1, 3]  # 30 would overshoot by more than it closes; 20 does not
    assert mix.take_to_target(np.array(lengths), 150).all()
    assert not mix.take_to_target(np.array(lengths), 0).any()


@pytest.mark.parametrize("seed", range(40))
def test_vectorised_select_equals_the_one_at_a_time_rule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(0, 3000))
    lengths = rng.integers(1, int(rng.choice([5, 50, 4000])), size=size)
    target = float(rng.uniform(0, 1.2) * lengths.sum())
    if seed % 5 == 0:  # lengths that cluster around the gap left near the target: many skips
        lengths = rng.choice([99, 100, 101, 199, 200], size=size)
    assert np.flatnonzero(mix.take_to_target(lengths, target)).tolist() == _one_at_a_time(lengths.tolist(), target)


def test_a_category_whose_target_is_under_half_its_shortest_sample_gets_that_one_sample() -> None:
    """The demo at max_new_tokens 12: a target of 104 tokens, samples of 324 and more."""
    assert np.flatnonzero(mix.take_to_target(np.array([400, 324, 500, 324]), 104)).tolist() == [1]
    assert not mix.take_to_target(np.array([400, 324]), 0).any(), "no target, no sample"


def _mixed(lengths: dict[str, list[int]], shares: dict[str, float], tolerance: float) -> tuple[Counter[str], str]:
    """The real selection and check on categories of samples: tokens chosen, and the check's message."""
    available = Counter({c: sum(v) for c, v in lengths.items()})
    targets = category_targets(shares, dict(available), None)
    chosen = Counter(
        {c: int(np.array(v)[mix.take_to_target(np.array(v), targets[c])].sum()) for c, v in lengths.items()}
    )
    checks = Checks(share_tolerance=tolerance)
    plan = SimpleNamespace(sources={}, config=SimpleNamespace(checks=checks, logs=Path("logs")))
    try:
        mix.checks.check(plan, {}, shares, targets, chosen, available, Counter())  # type: ignore[arg-type]
    except mix.checks.MixError as e:
        return chosen, str(e)
    return chosen, ""


@pytest.mark.parametrize("seed", range(60))
def test_the_selection_and_its_check_agree_on_small_and_large_datasets(seed: int) -> None:
    """Every category with samples gets some; a failed check says what is true, and its way out works."""
    rng = np.random.default_rng(seed)
    size = int(rng.choice([1, 3, 8, 2000]))  # a handful of samples per category, or thousands
    shares = dict(zip("abcde", np.array([46, 26, 11, 9, 7]) / 99, strict=True))
    lengths = {c: rng.integers(20, int(rng.choice([60, 400])), size=max(1, int(size * rng.uniform(0.2, 1)))).tolist()
               for c in shares}  # fmt: skip
    tolerance = float(rng.choice([0.02, 0.05]))
    chosen, message = _mixed(lengths, shares, tolerance)
    assert all(chosen[c] > 0 for c in shares), "no category with samples is left empty"
    total = sum(chosen.values())
    for line in message.splitlines()[1:]:
        c = line.split("'")[1]
        assert shares[c] - chosen[c] / total > tolerance
        if "all " in line and "of its tokens are used" in line:
            assert chosen[c] == sum(lengths[c]) and f"all {sum(lengths[c])} of its tokens" in line
            needed = int(line.split("it needs ")[1].split()[0])
            floor = shares[c] - tolerance
            assert needed > 0 and (chosen[c] + needed) / (total + needed) >= floor - 1e-9
            assert (chosen[c] + needed - 1) / (total + needed - 1) < floor
        else:
            assert f"{chosen[c]} of its {sum(lengths[c])} tokens are taken" in line and chosen[c] < sum(lengths[c])
        suggested = float(line.split("checks.share_tolerance: ")[1].split()[0])
        assert f"'{c}'" not in _mixed(lengths, shares, suggested)[1], "the suggested tolerance lets it pass"
    if size == 2000:
        assert not message, "thousands of samples meet the mix within the tolerance"


def test_ranks_follow_seed_prompt_and_sample_not_position() -> None:
    ids = pa.array([f"{i * 7919:016x}" for i in range(500)])
    sample = np.arange(500) % 3
    ranks = mix.sample_ranks(1, ids, sample)
    assert len(set(ranks.tolist())) == 500
    order = np.random.default_rng(0).permutation(500)
    assert (mix.sample_ranks(1, ids.take(pa.array(order)), sample[order]) == ranks[order]).all()
    assert (mix.sample_ranks(2, ids, sample) != ranks).mean() > 0.99
    assert hashing.hex_to_u64(ids).tolist() == [i * 7919 for i in range(500)]
    assert hashing.hex_to_u64(ids.slice(100, 5)).tolist() == [i * 7919 for i in range(100, 105)]
    assert hashing.hex_to_u64(pa.array(["FFFFFFFFFFFFFFFF", "00000000000000aB"])).tolist() == [2**64 - 1, 0xAB]
    for bad in ["00000000000000ag", "0000000 0000000a", "000000000000000\u00e9", "0000000000000001a", None]:
        with pytest.raises(ValueError, match="16 hex digits"):
            hashing.hex_to_u64(pa.array(["0000000000000001", bad]))


def test_shortfalls_and_overshoots_are_stated_apart() -> None:
    shares = {"a": 0.5, "b": 0.3, "c": 0.2}
    below, above = mix.checks.deviations(
        shares, {"a": 500, "b": 300, "c": 200}, Counter(a=500, b=50), Counter(a=900, b=50), 1000
    )
    assert [n.split("'")[1] for n in below] == ["b", "c"]
    assert "'b' falls short" in below[0] and "'c' has no samples" in below[1]
    # with b and c short, a's share of what was built is far above its target: said, and not as a shortfall
    assert above == [
        "category 'a' reaches 90.9% instead of 50.0%: it meets its target of 500 tokens; the other categories' "
        "misses move its share"
    ]
    targets = {"a": 500, "b": 300, "c": 200}
    assert mix.checks.shortfalls(shares, targets, Counter(a=500, b=50), Counter(a=900, b=50), 1000) == below
    exact = Counter(a=500, b=300, c=200)
    assert mix.checks.deviations(shares, {}, exact, exact, None) == ([], [])


def test_a_language_floor_missed_within_the_tolerance_is_stated_and_one_with_nothing_of_it_fails(
    tmp_path: Path,
) -> None:
    plan = _plan(tmp_path)  # checks.share_tolerance: the schema's default

    def got(share: float, floor: float, available: int) -> dict[str, Any]:
        return {"floor": floor, "achieved_share": share, "tokens": round(share * 100), "available_tokens": available}

    tolerance = plan.config.checks.share_tolerance
    close = {"a": {"zh": got(0.30 - tolerance / 2, 0.30, 500), "en": got(0.7, 0.5, 900)}}
    assert mix.checks.missed_floors(plan, close, {"a": 100}) == []
    [note] = mix.checks.floor_shortfalls(close)
    assert note == (
        f"category 'a': language 'zh' reaches {0.30 - tolerance / 2:.1%} of its tokens, floor 30.0% "
        f"({round((0.30 - tolerance / 2) * 100)} tokens of it, 500 available)"
    )
    nothing = {"a": {"ja": got(0.0, tolerance / 2, 0)}}
    [problem] = mix.checks.missed_floors(plan, nothing, {"a": 100})
    assert problem.startswith("category 'a': language 'ja' reaches 0.0% of its tokens") and "hold 0 tokens" in problem
    far = {"a": {"zh": got(0.30 - 2 * tolerance, 0.30, 500)}}
    assert len(mix.checks.missed_floors(plan, far, {"a": 100})) == 1


def test_a_share_note_never_contradicts_the_token_counts() -> None:
    """The demo's note said a category's samples were "too long to hit a target of 1201 tokens" when it
    had exactly 1201: its share moved because another category missed its own target."""
    shares = {"coding": 0.465, "general": 0.263, "other": 0.272}
    targets = {"coding": 1201.0, "general": 679.0, "other": 703.0}
    got, available = Counter(coding=1201, general=695, other=600), Counter(coding=1201, general=900, other=900)
    below, above = mix.checks.deviations(shares, targets, got, available, None)
    notes = {n.split("'")[1]: n for n in below + above}
    assert "it meets its target of 1201 tokens; the other categories' misses move its share" in notes["coding"]
    assert "too long to hit a target of 703 tokens closely (it has 600)" in notes["other"]
    assert [n.split("'")[1] for n in below] == ["other"]


def test_length_stats() -> None:
    assert report.length_stats([5, 1, 3, 2, 4]) == {"mean": 3.0, "p50": 3, "p90": 5, "max": 5}
    assert report.length_stats([]) == {"mean": 0, "p50": 0, "p90": 0, "max": 0}


# -- loud failure: the checks run on the real plan of a small config -----------------------------------
def _plan(tmp_path: Path, **extra: Any) -> plan_mod.Plan:
    tmp_path.mkdir(parents=True, exist_ok=True)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"gguf")
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"t{i}"}) + "\n" for i in range(3)))
    raw = {
        "store": str(tmp_path / "store"),
        "model": {"path": str(model)},
        "sources": {
            "a1": {"category": "a", "format": "alpaca", "files": [str(data)]},
            "a2": {"category": "a", "format": "alpaca", "files": [str(data)], "seed": 1},
            "b1": {"category": "b", "format": "alpaca", "files": [str(data)]},
        },
        "mix": {"categories": {"a": 0.5, "b": 0.5}},
        **extra,
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    return plan_mod.build(cfg.load(tmp_path / "c.yaml"))


def _check(plan: plan_mod.Plan, chosen: dict[str, int], by_source: dict[str, int]) -> None:
    shares = dict(plan.config.mix_categories)
    available = Counter(chosen)
    targets = {c: shares[c] * 100 for c in shares}
    mix.checks.check(
        plan, {s: [] for s in plan.sources}, shares, targets, Counter(chosen), available, Counter(by_source)
    )


def test_checks_pass_a_dataset_that_meets_its_mix_within_the_tolerance_and_no_further(tmp_path: Path) -> None:
    """checks.share_tolerance 0.02 (the default): b at 48.5% of the tokens passes, at 47.6% it fails."""
    plan = _plan(tmp_path)
    assert plan.config.checks.share_tolerance == 0.02
    _check(plan, {"a": 50, "b": 49}, {"a1": 30, "a2": 20, "b1": 49})  # b 49.5%: no MixError
    _check(plan, {"a": 53, "b": 50}, {"a1": 30, "a2": 23, "b1": 50})  # b 48.5%: within the tolerance
    with pytest.raises(mix.checks.MixError, match=r"category 'b' reaches 47\.6% of tokens, target 50\.0%"):
        _check(plan, {"a": 55, "b": 50}, {"a1": 30, "a2": 25, "b1": 50})


@pytest.mark.parametrize(
    ("chosen", "by_source", "message"),
    [
        ({}, {}, "the dataset would be empty"),
        ({"a": 50, "b": 50}, {"a1": 50, "b1": 50}, "source 'a2' reaches the mix with no samples"),
        ({"a": 70, "b": 30}, {"a1": 30, "a2": 40, "b1": 30}, "category 'b' reaches 30.0% of tokens, target 50.0%"),
    ],
)
def test_checks_fail_naming_the_cause_and_the_key(
    tmp_path: Path, chosen: dict[str, int], by_source: dict[str, int], message: str
) -> None:
    plan = _plan(tmp_path)
    with pytest.raises(mix.checks.MixError) as err:
        _check(plan, chosen, by_source)
    assert message in str(err.value)
    assert "checks.allow_shortfall" in str(err.value) or "empty" in str(err.value)


def test_an_allowed_shortfall_passes_and_is_stated(tmp_path: Path) -> None:
    """An allowed shortfall fails no check, and the manifest's statements (what the card lists under
    "Shortfalls") still name it with its numbers; a source with no samples fails whatever is allowed."""
    plan = _plan(tmp_path, checks={"allow_shortfall": ["b"]})
    chosen = {"a": 70, "b": 30}
    _check(plan, chosen, {"a1": 30, "a2": 40, "b1": 30})
    shares = dict(plan.config.mix_categories)
    stated = mix.checks.shortfalls(shares, {c: shares[c] * 100 for c in shares}, Counter(chosen), Counter(chosen), None)
    assert stated == [
        "category 'b' reaches 30.0% instead of 50.0%: every one of its samples is used; others overshoot their "
        "targets by part of a sample"
    ], stated
    with pytest.raises(mix.checks.MixError, match="source 'a2'"):
        _check(plan, {"a": 70, "b": 30}, {"a1": 70, "b1": 30})


def test_a_source_the_trainers_window_emptied_is_named_with_the_window(tmp_path: Path) -> None:
    """Its token shards' sidecars count the rows outside trainer.max_length: the message says to raise it."""
    from dflash_build.store import layout

    plan = _plan(tmp_path, trainer={"max_length": 160})
    shard = tmp_path / "tokens" / "00000.parquet"
    shard.parent.mkdir()
    layout.sidecar(shard).write_text(json.dumps({"input_rows": 6, "dropped": {"outside_window": 6}}))
    shares = dict(plan.config.mix_categories)
    shards = {"a1": [], "a2": [shard], "b1": []}
    with pytest.raises(mix.checks.MixError) as err:
        mix.checks.check(
            plan, shards, shares, {"a": 50, "b": 50}, Counter(a=50, b=50), Counter(a=50, b=50), Counter(a1=50, b1=50)
        )
    message = str(err.value)
    assert "source 'a2' reaches the mix with no samples (6 completions, tokenize dropped outside_window: 6)" in message
    assert "its prompts leave too little of trainer.max_length 160: raise it or drop the source" in message


def test_a_variant_that_loses_its_drawn_share_fails_naming_its_sources_and_tolerance(tmp_path: Path) -> None:
    """A variant's share of the dataset's prompts is checked against the share drawn to it: losing a
    quarter of the fast variant's prompts (its answers ran out, say) fails the mix, naming the variant,
    what each of its sources lost and the key that would allow it."""
    plan = _plan(tmp_path, variants={"think": {"share": 3}, "fast": {"share": 1}})
    drawn = Counter({"a1@think": 30, "a1@fast": 10, "a2@think": 29, "a2@fast": 11, "b1@think": 33, "b1@fast": 7})
    assert variants.missed(plan, drawn, drawn) == []
    lost = drawn.copy()
    lost.update({"a1@fast": -6, "a2@fast": -5})  # Counter.update adds
    (problem,) = variants.missed(plan, drawn, lost)
    assert problem.startswith("variant 'fast' holds 15.6% of the dataset's prompts, 23.3% were drawn to it")
    assert "a1@fast 6 of 10, a2@fast 5 of 11, b1@fast 0 of 7" in problem and "variants.fast.tolerance" in problem
    loose = _plan(tmp_path / "loose", variants={"think": {"share": 3}, "fast": {"share": 1, "tolerance": 0.15}})
    assert variants.missed(loose, drawn, lost) == []
    tally = variants.VariantTally()
    table = pa.table({"n_tokens": [10, 20], "n_loss_tokens": [4, 8], "finish_reason": ["stop", "length"]})
    tally.add(table, "fast", "a")
    entry = variants.report(plan, drawn, lost, tally)["fast"]
    assert entry["configured_share"] == 0.25 and entry["drawn_share"] == round(28 / 120, 6)
    assert entry["prompts"] == 17 and entry["rows"] == 2 and entry["mean_answer_tokens"] == 6.0
    assert entry["ran_out_rows"] == 1 and entry["tokens_by_category"] == {"a": 30}


def test_a_source_whose_answers_were_all_degenerate_is_named_with_the_policy(tmp_path: Path) -> None:
    """Its token shards' sidecars count the loops tokenize dropped: the message names the policy to change,
    not `truncated: keep`."""
    from dflash_build.store import layout

    plan = _plan(tmp_path)
    shard = tmp_path / "tokens" / "00000.parquet"
    shard.parent.mkdir()
    layout.sidecar(shard).write_text(json.dumps({"input_rows": 6, "dropped": {"loop": 4, "empty": 2}}))
    shares = dict(plan.config.mix_categories)
    with pytest.raises(mix.checks.MixError) as err:
        mix.checks.check(
            plan,
            {"a1": [], "a2": [shard], "b1": []},
            shares,
            {"a": 50, "b": 50},
            Counter(a=50, b=50),
            Counter(a=50, b=50),
            Counter(a1=50, b1=50),
        )
    message = str(err.value)
    assert "(6 completions, tokenize dropped loop: 4, empty: 2)" in message, message
    assert "its answers are degenerate (loop, empty)" in message and "degenerate.loop.policy: keep" in message
    assert "truncated: keep" not in message
