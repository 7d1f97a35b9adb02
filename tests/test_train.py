"""The train stage's config, key and bad input (issue 78), without training: the settings checked against
the pinned trainer's keys, the key's parts, the target and the trainer's interpreter checked in one line
before any training. The training itself, on Automodel's own recipe, is tests/test_trainer_automodel.py's;
the loop (two datasets, two drafters, accept) is tests/test_loop.py's."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from dflash_build import config as cfg
from dflash_build import configfile, trained
from dflash_build import plan as plan_mod
from dflash_build.spec import ConfigError
from dflash_build.stages import train
from dflash_build.trainers import automodel
from tests.conftest import write_jsonl


def _model(folder: Path, architecture: str = "Qwen3ForCausalLM") -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture], "vocab_size": 16}))
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


@pytest.fixture
def raw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.chdir(tmp_path)
    model = _model(tmp_path / "model")
    write_jsonl(tmp_path / "a.jsonl", [{"instruction": "hi"}, {"instruction": "yo"}])
    return {
        "model": {"path": str(model)},
        "sources": {"a": {"category": "coding", "format": "alpaca", "files": ["a.jsonl"]}},
        "mix": {"categories": {"coding": 1}},
        "train": {"trainer": "automodel", "gpus": 0, "settings": {"recipe_args": {"mask_token_id": 3}}},
    }


def _load(raw: dict[str, Any]) -> Any:
    raw = copy.deepcopy(raw)
    configfile.validate(raw)  # the schema's defaults filled in, as a config file is
    return cfg.from_dict(raw)


@pytest.mark.parametrize(
    ("settings", "key", "says"),
    [
        ({"recipe_args": {"mask_token_id": 3, "lerning_rate": 1}}, "train.settings.recipe_args.lerning_rate", "no key"),
        (
            {"recipe_args": {"mask_token_id": 3, "block_sise": 4}},
            "train.settings.recipe_args.block_sise",
            "'block_size'",
        ),
        ({"recipe_args": {"mask_token_id": 3, "lr": 1e-3}}, "train.settings.recipe_args.lr", "'optimizer.lr'"),
        ({"recipe_args": {"mask_token_id": 3}, "optimiser": {}}, "train.settings.optimiser", "'optimizer'"),
        ({"recipe_args": {}}, "train.settings.recipe_args.mask_token_id", "needs it"),
    ],
)
def test_a_setting_the_pinned_trainer_does_not_know_is_refused_naming_the_closest(
    raw: dict[str, Any], settings: dict[str, Any], key: str, says: str
) -> None:
    raw["train"]["settings"] = settings
    with pytest.raises(ConfigError) as e:
        _load(raw)
    assert e.value.key == key and says in str(e.value)
    assert "\n" not in str(e.value)


def test_an_unknown_trainer_and_a_trained_drafter_without_train_are_refused(raw: dict[str, Any]) -> None:
    raw["train"]["gpus"] = 1  # Automodel's runner trains on the CPU only
    with pytest.raises(ConfigError) as e:
        _load(raw)
    assert e.value.key == "train.gpus"
    raw["train"]["gpus"] = 0
    raw["train"]["trainer"] = "automodl"
    with pytest.raises(ConfigError, match="did you mean 'automodel'"):
        _load(raw)
    del raw["train"]
    raw["eval"] = {"share": 0.5}
    raw["engine"] = {"backend": "vllm"}
    raw["accept"] = {"drafters": {"mine": {"method": "dflash", "trained": True}}}
    with pytest.raises(ConfigError) as e:
        _load(raw)
    assert e.value.key == "accept.drafters.mine.trained"


def test_defaults_are_filled_and_a_trained_drafter_is_the_train_stages_folder(raw: dict[str, Any]) -> None:
    raw["eval"] = {"share": 0.5}
    raw["engine"] = {"backend": "vllm"}
    raw["accept"] = {"drafters": {"mine": {"method": "dflash", "trained": True}}}
    config = _load(raw)
    assert config.train.settings["optimizer"]["lr"] == automodel.DFLASH["optimizer"]["lr"].default
    assert config.train.settings["recipe_args"]["mask_token_id"] == 3
    assert config.train.target == raw["model"]["path"]
    drafter = config.accept.drafters["mine"]
    assert drafter.trained and Path(drafter.path) == config.drafter_dir == Path("dist/dflash-mix-drafter")


def test_the_key_holds_what_changes_the_weights_and_nothing_else(raw: dict[str, Any]) -> None:
    plan = plan_mod.build(_load(raw))
    base = trained.key(plan, "v1")
    assert trained.key(plan, "v2") != base  # another dataset version
    for section, name, value, changes in [
        ("optimizer", "lr", 1e-3, True),
        ("recipe_args", "block_size", 8, True),
        ("recipe_args", "seq_length", 64, True),
        ("recipe_args", "log_every_steps", 50, False),
    ]:
        edited = json.loads(json.dumps(raw))
        edited["train"]["settings"].setdefault(section, {})[name] = value
        assert (trained.key(plan_mod.build(_load(edited)), "v1") != base) is changes, name
    # the default given explicitly is the same training
    edited = json.loads(json.dumps(raw))
    edited["train"]["settings"]["optimizer"] = {"lr": automodel.DFLASH["optimizer"]["lr"].default}
    assert trained.key(plan_mod.build(_load(edited)), "v1") == base


def test_a_target_the_recipe_cannot_train_for_is_refused_in_one_line(raw: dict[str, Any], tmp_path: Path) -> None:
    raw["train"]["target"] = str(_model(tmp_path / "llama", "LlamaForCausalLM"))
    plan = plan_mod.build(_load(raw))
    with pytest.raises(ConfigError) as e:
        train.check_target(plan, plan.config.train)
    assert e.value.key == "train.target" and "LlamaForCausalLM" in str(e.value) and "Qwen3ForCausalLM" in str(e.value)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    raw["train"]["target"] = str(gguf)
    plan = plan_mod.build(_load(raw))
    with pytest.raises(ConfigError, match="no model folder the trainer can load"):
        train.check_target(plan, plan.config.train)


def test_an_interpreter_without_the_pinned_trainer_is_named_with_what_to_run(raw: dict[str, Any]) -> None:
    raw["train"]["python"] = sys.executable  # the project's own: no nemo_automodel
    config = _load(raw)
    with pytest.raises(ConfigError) as e:
        train.check_environment(automodel.TRAINER, config.train)
    assert e.value.key == "train.python"
    assert "has no nemo_automodel" in str(e.value) and ".venv-automodel/bin/python" in str(e.value)
    raw["train"]["python"] = "/nonexistent/python"
    with pytest.raises(ConfigError, match="has no nemo_automodel"):
        train.check_environment(automodel.TRAINER, _load(raw).train)


def test_the_automodel_descriptor_and_its_runner_know_the_same_settings() -> None:
    """The stage checks and keys the settings by the descriptor, the runner (in the trainer's interpreter,
    without this package) by its own table of each recipe: one list of names, the same required ones, and
    where the runner has a default, the same."""
    import importlib.util

    table = automodel.RUNNER.with_name("automodel_recipes_run.py")
    spec = importlib.util.spec_from_file_location(table.stem, table)
    assert spec is not None and spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    sys.modules[table.stem] = runner  # its dataclass looks its module up
    try:
        spec.loader.exec_module(runner)
    finally:
        del sys.modules[table.stem]
    assert set(runner.RECIPES) == set(automodel.TRAINER.recipes)
    for name, recipe in runner.RECIPES.items():
        described = automodel.TRAINER.recipe(name).settings
        assert {s: set(v) for s, v in described.items()} == {s: set(v) for s, v in recipe.settings.items()}, name
        assert set(recipe.required) == {f"{s}.{k}" for s, v in described.items() for k, x in v.items() if x.required}
        for section, defaults in recipe.defaults.items():
            for key, value in defaults.items():
                assert described[section][key].default == value, f"{name}: {section}.{key}"


def test_the_eagle3_recipe_refuses_a_setting_it_does_not_know_and_keys_its_own_training(raw: dict[str, Any]) -> None:
    """EAGLE-3's settings are its recipe's: DFlash's block_size is none of them, ttt_steps and lr it needs; and
    the same dataset trained by the other recipe is another training, and accept serves its drafter as eagle3."""
    dflash = trained.key(plan_mod.build(_load(raw)), "v1")
    raw["train"]["recipe"] = "eagle3"
    for settings, key, says in [
        ({"recipe_args": {"ttt_step": 7}, "optimizer": {"lr": 1e-4}}, "train.settings.recipe_args.ttt_step",
         "did you mean 'ttt_steps'?"),
        ({"recipe_args": {"ttt_steps": 7, "block_size": 4}, "optimizer": {"lr": 1e-4}},
         "train.settings.recipe_args.block_size", "eagle3 recipe has no key 'block_size'"),
        ({"recipe_args": {"ttt_steps": 7}}, "train.settings.optimizer.lr", "eagle3 recipe needs it"),
    ]:  # fmt: skip
        raw["train"]["settings"] = settings
        with pytest.raises(ConfigError) as e:
            _load(raw)
        assert e.value.key == key and says in str(e.value) and "\n" not in str(e.value), str(e.value)
    raw["train"]["settings"] = {"recipe_args": {"ttt_steps": 7, "aux_layer_ids": [0, 1, 2]}, "optimizer": {"lr": 1e-4}}
    config = _load(raw)
    assert config.train.settings["recipe_args"]["seq_length"] is None
    assert config.train.settings["optimizer"]["warmup_ratio"] == automodel.EAGLE3["optimizer"]["warmup_ratio"].default
    base = trained.key(plan_mod.build(config), "v1")
    assert base != dflash
    louder = copy.deepcopy(raw)
    louder["train"]["settings"]["recipe_args"]["log_every_steps"] = 10
    assert trained.key(plan_mod.build(_load(louder)), "v1") == base
    longer = copy.deepcopy(raw)
    longer["train"]["settings"]["recipe_args"]["ttt_steps"] = 3
    assert trained.key(plan_mod.build(_load(longer)), "v1") != base
    # its drafter is measured as what it is
    raw["eval"] = {"share": 0.5}
    raw["engine"] = {"backend": "vllm"}
    raw["accept"] = {"drafters": {"mine": {"method": "dflash", "trained": True}}}
    with pytest.raises(ConfigError) as e:
        _load(raw)
    assert e.value.key == "accept.drafters.mine.method" and "set method: eagle3" in str(e.value)
    raw["accept"]["drafters"]["mine"]["method"] = "eagle3"
    assert _load(raw).accept.drafters["mine"].trained


def test_the_trainers_progress_is_read_from_its_runners_own_line() -> None:
    """What `status` shows of a training: the step and loss of the runner's line (automodel_run's format);
    Automodel's own lines and the rest say nothing."""
    assert automodel.progress("automodel: step 12/130 loss 2.4871 acc 0.4649 lr 0.000302") == {
        "step": "12/130",
        "loss": 2.4871,
    }
    assert automodel.progress("2026-12-07 | INFO | train_dflash | epoch=1 step=128 loss=2.4871") is None
    assert automodel.progress("automodel: training 258 rows, 130 steps") is None


def test_a_target_that_tokenizes_otherwise_than_the_dataset_is_refused(
    raw: dict[str, Any], tmp_path: Path, tokenizer_dir: Path
) -> None:
    """The dataset is the toy's tokens: a target folder with SmolLM2's tokenizer would train the drafter on
    ids that mean other words there; a copy of the toy's own folder is the same target."""
    import shutil

    from tests import toy_target

    raw["model"]["path"] = str(toy_target.COMMITTED)
    other = tmp_path / "other"
    shutil.copytree(tokenizer_dir, other)
    shutil.copy2(toy_target.COMMITTED / "config.json", other / "config.json")
    (other / "model.safetensors").write_bytes(b"weights")
    raw["train"]["target"] = str(other)
    plan = plan_mod.build(_load(raw))
    with pytest.raises(ConfigError) as e:
        train.check_target(plan, plan.config.train)
    assert e.value.key == "train.target" and "tokenizes otherwise" in str(e.value) and "\n" not in str(e.value)
    same = tmp_path / "same"
    shutil.copytree(toy_target.COMMITTED, same)
    raw["train"]["target"] = str(same)
    plan = plan_mod.build(_load(raw))
    train.check_target(plan, plan.config.train)  # no error: the same tokens
