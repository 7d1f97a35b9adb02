"""The recipes of NeMo Automodel 0.7.0 the automodel runner (``automodel_run.py``, beside it) trains, one
:class:`Recipe` each: ``dflash`` (``TrainDFlashRecipe``) and ``eagle3`` (``TrainEagle3Recipe``).

Each holds the settings a run may give (by Automodel's YAML sections, each key's kind), the keys the runner
owns, what its CPU patches replace in the release's code (checked before anything is patched: a check that
fails names itself), the CPU subclass of the recipe, and the config vLLM 0.32 serves its checkpoint with.

A standalone module like the runner: the standard library at import, the trainer environment's packages
inside the functions that use them, nothing of ``dflash_build`` (which that environment does not have).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Recipe:
    cls: str  # Automodel's recipe class, in nemo_automodel.recipes.llm.MODULE
    module: str
    name: str  # what Automodel calls the method, in messages
    settings: dict[str, dict[str, str]]  # section -> key -> kind (automodel_run's _KINDS)
    defaults: dict[str, dict[str, Any]]  # the runner's values where Automodel has no default or a GPU run's
    required: dict[str, str]  # "section.key" the config must give -> what it is
    owned: dict[str, str]  # YAML keys the run file or the CPU decides -> which
    fixed: dict[str, Any]  # the recipe_args the runner writes for the CPU
    registry: tuple[str, str, str]  # (module, dict, the draft class vLLM serves) of Automodel's draft registry
    steps: dict[str, tuple[int, int, int, int, int]]  # the loop's per-step log formats -> positions of
    # (epoch, step, loss, acc, lr) in its arguments
    checks: Callable[[Any], dict[str, bool]]  # the CPU patches' names -> the release's code is theirs
    cpu: Callable[[Any, Any], type]  # (recipe module, transformers' AutoModelForCausalLM) -> CPU subclass
    served: Callable[[dict[str, Any], Any], dict[str, Any]]  # (draft config, trained recipe) -> vLLM's
    strip: str = ""  # the prefix of the weights' names that vLLM's loader does not take


def source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


_OWNED = {
    "recipe_args.target_model_name_or_path": "RUN.json's target",
    "recipe_args.train_data_path": "RUN.json's rows",
    "recipe_args.output_dir": "RUN.json's work",
    "recipe_args.target_attn_implementation": "sdpa on CPU",
    "checkpoint": "RUN.json's work",
    "dist_env": "one gloo process",
}
_SPECULATIVE = "nemo_automodel.components.speculative"
_OPTIMIZER = {"lr": "num", "betas": "pair", "weight_decay": "num", "warmup_ratio": "num", "min_lr_ratio": "num"}
# one step a line on a small CPU run (Automodel's own: 10 for EAGLE-3)
_DEFAULTS = {"recipe_args": {"micro_batch_size": 1, "num_epochs": 1, "log_every_steps": 1}}


# --- dflash: TrainDFlashRecipe (recipes/llm/train_dflash.py) ---------------------------------------------------

DFLASH_SETTINGS: dict[str, dict[str, str]] = {
    "recipe_args": {
        "seq_length": "pos?",  # rows are cut here (null, the default: the longest row)
        "micro_batch_size": "pos",
        "grad_accumulation_steps": "pos",
        "num_epochs": "pos",
        "shuffle_seed": "int",  # the rows' order and the anchors drawn
        "draft_num_hidden_layers": "pos",
        "target_layer_ids": "ints?",  # null: Automodel spreads them over the target's depth
        "block_size": "pos",
        "mask_token_id": "int",
        "num_anchors": "pos",
        "loss_decay_gamma": "num?",  # null: every block position weighs the same
        "loss_type": "str",
        "prefix_weight_base": "num",
        "max_grad_norm": "num",
        "log_every_steps": "pos",
        "output_multiplier": "num",
        "final_logit_softcapping": "num?",
        "input_embedding_scale": "num",
        "packed_sequence_size": "int",  # > 0: rows packed into rows of this many tokens (Automodel's packer)
    },
    "optimizer": _OPTIMIZER,
}
DFLASH_STEP = "epoch=%d step=%d loss=%.4f acc=%.4f lr=%.6g"


def dflash_checks(td: Any) -> dict[str, bool]:
    """- ``tokens_loader``: ``setup`` builds its loaders with the module's ``build_eagle3_dataloader``, which
    renders chats with the chat template itself; the project's rows are tokens already.
    - ``cpu_target``: ``_build_target_model`` loads the target with ``NeMoAutoModelForCausalLM``, whose
    ``from_pretrained`` calls ``torch.cuda.current_device()`` whatever its arguments.
    - ``progress``: the loop's tqdm bar (carriage returns, not lines) and its per-step log record."""
    recipe = getattr(td, "TrainDFlashRecipe", None)
    setup, target, loop = (source(getattr(recipe, n, None)) for n in ("setup", "_build_target_model",
                                                                    "run_train_validation_loop"))  # fmt: skip
    auto = getattr(td, "NeMoAutoModelForCausalLM", None)
    return {
        "tokens_loader": callable(getattr(td, "build_eagle3_dataloader", None))
        and setup.count("build_eagle3_dataloader(") == 2
        and "dp_mesh=self.dp_mesh" in setup,
        "cpu_target": "NeMoAutoModelForCausalLM.from_pretrained(" in target
        and "torch.cuda.current_device()" in source(getattr(auto, "from_pretrained", None))
        and all(f"self.{a} = None" in target for a in ("dist_setup", "device_mesh", "dp_mesh", "cp_mesh")),
        "progress": callable(getattr(recipe, "_make_progress_bar", None)) and f'"{DFLASH_STEP}"' in loop,
    }


def dflash_cpu(td: Any, auto: Any) -> type:
    class CpuDFlashRecipe(td.TrainDFlashRecipe):  # type: ignore[misc, name-defined]
        """TrainDFlashRecipe with its target loaded by transformers on the CPU, and no progress bar."""

        def _build_target_model(self, recipe_cfg: Any, target_path: str, draft_spec: Any) -> Any:
            self.dist_setup = self.device_mesh = self.dp_mesh = self.cp_mesh = None
            model = auto.from_pretrained(
                target_path,
                dtype=self.compute_dtype,
                attn_implementation="sdpa",
                trust_remote_code=bool(recipe_cfg.get("trust_remote_code", False)),
            )
            model.to(self.device)
            model.requires_grad_(False)
            return model

        def _make_progress_bar(self, total: int | None = None, initial: int = 0) -> None:
            return None

    return CpuDFlashRecipe


def dflash_served(config: dict[str, Any], trained: Any) -> dict[str, Any]:
    """vLLM's one DFlash architecture (``DFlashDraftModel``; another name is prefixed with ``DFlash`` and then
    not found), non-causal said outright, and no tied embeddings (the draft shares the target's)."""
    return {**config, "architectures": ["DFlashDraftModel"], "is_causal": False, "tie_word_embeddings": False}


DFLASH = Recipe(
    cls="TrainDFlashRecipe",
    module="train_dflash",
    name="DFlash",
    settings=DFLASH_SETTINGS,
    defaults={**_DEFAULTS, "optimizer": {"lr": 6e-4}},
    required={"recipe_args.mask_token_id": "a token id the target's data never holds"},
    owned={
        **_OWNED,
        "recipe_args.attention_backend": "sdpa on CPU",  # flex attention's default compiles its mask
    },
    fixed={"attention_backend": "sdpa", "target_attn_implementation": "sdpa"},
    # Kimi K3's MLA draft is no DFlashDraftModel of vLLM's
    registry=(f"{_SPECULATIVE}.dflash.registry", "DFLASH_DRAFT_REGISTRY", "Qwen3DFlashDraftModel"),
    steps={DFLASH_STEP: (0, 1, 2, 3, 4)},
    checks=dflash_checks,
    cpu=dflash_cpu,
    served=dflash_served,
)


# --- eagle3: TrainEagle3Recipe (recipes/llm/train_eagle3.py) ---------------------------------------------------

EAGLE3_SETTINGS: dict[str, dict[str, str]] = {
    "recipe_args": {
        "seq_length": "pos?",  # null: the longest row
        "micro_batch_size": "pos",
        "grad_accumulation_steps": "pos",
        "num_epochs": "pos",
        "shuffle_seed": "int",  # the rows' order and the vocabulary's ties
        "train_shuffle": "bool",
        "ttt_steps": "pos",  # the draft's steps unrolled in training (tokens it learns to draft ahead)
        "aux_layer_ids": "ints?",  # 3 target layers; null: Automodel's [1, L/2-1, L-4]
        "draft_vocab_size": "pos?",  # null: the target's whole vocabulary (no d2t map)
        "freeze_embeddings": "bool",
        "fc_norm": "bool",  # EAGLE-3.1's per-layer norms before fc (vLLM reads it from the config)
        "norm_output": "bool",
        "lk_loss_type": "str?",  # null, alpha or lambda
        "lk_kl_scale": "num",
        "lk_kl_decay": "num",
        "max_grad_norm": "num",
        "log_every_steps": "pos",
        "packed_sequence_size": "int",
    },
    "optimizer": _OPTIMIZER,
}
EAGLE3_STEP = "epoch=%s step=%s train_loss=%.6f train_acc=%.6f%s lr=%.3e"
EAGLE3_FLUSH = EAGLE3_STEP + " (trailing flush)"


def eagle3_checks(te: Any) -> dict[str, bool]:
    """- ``tokens_loader``: ``_build_train_dataloader`` renders chats with the module's
    ``build_eagle3_dataloader`` (as DFlash's); the draft vocabulary is counted over the same loader.
    - ``cpu_target``: ``_setup_colocated_target`` loads the target with ``NeMoAutoModelForCausalLM`` (CUDA
    only) and wraps it in ``HFEagle3TargetModel`` with ``aux_layer_ids``.
    - ``progress``: the tqdm bar and the loop's two per-step log records."""
    recipe = getattr(te, "TrainEagle3Recipe", None)
    loader, online, target, loop = (source(getattr(recipe, n, None)) for n in (
        "_build_train_dataloader", "_setup_online_target", "_setup_colocated_target", "_train_epochs"))  # fmt: skip
    auto = getattr(te, "NeMoAutoModelForCausalLM", None)
    return {
        "tokens_loader": callable(getattr(te, "build_eagle3_dataloader", None))
        and "return build_eagle3_dataloader(" in loader
        and "self._build_train_dataloader(" in online
        and "load_or_build_eagle3_token_mapping(" in online,
        "cpu_target": "NeMoAutoModelForCausalLM.from_pretrained(target_path" in target
        and "torch.cuda.current_device()" in source(getattr(auto, "from_pretrained", None))
        and callable(getattr(te, "HFEagle3TargetModel", None))
        and 'aux_layer_ids=recipe_cfg.get("aux_layer_ids", None)' in target,
        "progress": callable(getattr(recipe, "_make_progress_bar", None))
        and all(f'"{m}"' in loop for m in (EAGLE3_STEP, EAGLE3_FLUSH)),
    }


def eagle3_cpu(te: Any, auto: Any) -> type:
    class CpuEagle3Recipe(te.TrainEagle3Recipe):  # type: ignore[misc, name-defined]
        """TrainEagle3Recipe with its target loaded by transformers on the CPU, and no progress bar."""

        def _setup_colocated_target(self, recipe_cfg: Any, target_path: str, draft_base_config: Any) -> None:
            self.target_model = auto.from_pretrained(
                target_path,
                dtype=self.compute_dtype,
                attn_implementation="sdpa",
                trust_remote_code=bool(recipe_cfg.get("trust_remote_code", False)),
            )
            self.target_model.to(self.device)
            self.target_model.requires_grad_(False)
            aux = recipe_cfg.get("aux_layer_ids", None)
            self.target_wrapper = te.HFEagle3TargetModel(self.target_model, aux_layer_ids=aux, cp_mesh=None)

        def _make_progress_bar(self, total: int | None = None, initial: int = 0) -> None:
            return None

    return CpuEagle3Recipe


def eagle3_served(config: dict[str, Any], trained: Any) -> dict[str, Any]:
    """vLLM's Llama EAGLE-3 head (``LlamaForCausalLMEagle3``, as SGLang names the same weights): one layer
    (the config is the target's, its depth too), and the target layers it reads, in vLLM's count (the input
    of layer i+1 is Automodel's output of layer i); without them vLLM takes its own default layers."""
    served = {**config, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1}
    if isinstance(config.get("layer_types"), list):
        served["layer_types"] = config["layer_types"][:1]
    served["eagle_aux_hidden_state_layer_ids"] = [int(i) + 1 for i in trained.target_wrapper.aux_layer_ids]
    served["tie_word_embeddings"] = False
    return served


EAGLE3 = Recipe(
    cls="TrainEagle3Recipe",
    module="train_eagle3",
    name="EAGLE-3",
    settings=EAGLE3_SETTINGS,
    defaults=_DEFAULTS,
    required={
        "recipe_args.ttt_steps": "the draft's unrolled steps in training",
        "optimizer.lr": "the peak learning rate",
    },
    owned={
        **_OWNED,
        "recipe_args.draft_attn_implementation": "eager on CPU",
        "recipe_args.target_model_backend": "colocated: the target in this process",
    },
    fixed={"target_attn_implementation": "sdpa"},
    # the other drafts (gpt-oss's YaRN, DeepSeek's and Kimi K3's MLA, Gemma 4's) are no Llama head of vLLM's
    registry=(f"{_SPECULATIVE}.eagle.registry", "EAGLE3_DRAFT_REGISTRY", "LlamaEagle3DraftModel"),
    steps={EAGLE3_STEP: (0, 1, 2, 3, 5), EAGLE3_FLUSH: (0, 1, 2, 3, 5)},
    checks=eagle3_checks,
    cpu=eagle3_cpu,
    served=eagle3_served,
    # Automodel saves the head's backbone as model.*; vLLM's (and SGLang's) eagle3 loader adds that prefix
    strip="model.",
)

RECIPES = {"dflash": DFLASH, "eagle3": EAGLE3}
