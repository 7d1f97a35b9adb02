"""NeMo Automodel (``nemo_automodel``, pinned): its own recipes train the drafter, DFlash
(``TrainDFlashRecipe``) or EAGLE-3 (``TrainEagle3Recipe``); nothing here is a training loop.

Automodel reads chats and renders them with its own template; the build hands it the dataset's own token
rows instead (the target's exact tokenization and loss mask), through the runner
(:mod:`dflash_build.trainers.automodel_run`), which also holds what the CPU path needs of Automodel's
internals, checked against the release. The runner is a script of its own: the trainer's interpreter
(`make setup`: ``.venv-automodel``) has Automodel and its transformers pin, not this package.

The settings are the recipe's own YAML sections and keys (``recipe_args``, ``optimizer``), as the pinned
release reads them (``recipes/llm/train_dflash.py``, ``recipes/llm/train_eagle3.py``); the run's paths, its
data loader and its device set-up are the runner's (its table of each recipe: ``automodel_recipes_run.py``).
A setting that changes the weights enters the train key; one that changes only speed or logging does not.
"""

from __future__ import annotations

from pathlib import Path

from dflash_build.trainers.base import Recipe, Setting, Trainer, progress, runner_command

VERSION = "0.7.0"
VENV = ".venv-automodel"
RUNNER = Path(__file__).with_name("automodel_run.py")
# The runner trains in one process on the CPU (gloo, the target loaded without Automodel's CUDA-only
# loader): what this machine proves. A launch on GPUs (torchrun, Automodel's own target loader) is not
# built: on the node, SpecForge trains (dflash_build.trainers.specforge).
MAX_GPUS = 0


def _run_args() -> dict[str, Setting]:
    """Both recipes' ``recipe_args`` of the run itself, with the same defaults."""
    return {
        "seq_length": Setting(None),  # None: the longest row (nothing cut)
        "micro_batch_size": Setting(1),
        "grad_accumulation_steps": Setting(1),
        "num_epochs": Setting(1),
        "shuffle_seed": Setting(42),  # the rows' order, DFlash's anchors drawn and the draft's first weights
    }


def _optimizer(lr: Setting, warmup_ratio: float) -> dict[str, Setting]:
    """Both recipes' ``optimizer`` section: the same keys, their own lr and warmup defaults."""
    return {
        "lr": lr,
        "betas": Setting([0.9, 0.95]),
        "weight_decay": Setting(0.0),
        "warmup_ratio": Setting(warmup_ratio),
        "min_lr_ratio": Setting(0.1),
    }


# TrainDFlashRecipe's keys (recipes/llm/train_dflash.py of 0.7.0, the line each is read at in
# docs/training.md); tests/test_trainer_automodel.py checks each against the pinned source.
DFLASH = {
    "recipe_args": {
        **_run_args(),
        "draft_num_hidden_layers": Setting(1),
        "target_layer_ids": Setting(None),  # None: Automodel spreads them over the target's depth
        "block_size": Setting(16),
        "mask_token_id": Setting(None, required=True),  # the recipe has no fallback: a token the data never holds
        "num_anchors": Setting(512),
        "loss_decay_gamma": Setting(7.0),
        "loss_type": Setting("dflash"),
        "prefix_weight_base": Setting(0.9),
        "max_grad_norm": Setting(1.0),
        "output_multiplier": Setting(1.0),
        "final_logit_softcapping": Setting(None),
        "input_embedding_scale": Setting(1.0),
        "packed_sequence_size": Setting(0),  # > 0: rows packed to this many tokens (Automodel's packer)
        "log_every_steps": Setting(1, weights=False),  # how often its log says how far it is, not what
    },
    "optimizer": _optimizer(Setting(6.0e-4), warmup_ratio=0.04),
}

# the target architectures 0.7.0's DFlash registry takes (components/speculative/dflash/registry.py,
# DFLASH_DRAFT_REGISTRY; tests/test_trainer_automodel.py checks the list against it)
TARGETS = (
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "KimiK3ForCausalLM",
    "KimiK3ForConditionalGeneration",
)


# TrainEagle3Recipe's keys (recipes/llm/train_eagle3.py of 0.7.0); its target backends, P-EAGLE, LoRA, caches
# and parallelism are left out (the CPU runs the target in this process, and vLLM serves a plain EAGLE-3 head)
EAGLE3 = {
    "recipe_args": {
        **_run_args(),
        "train_shuffle": Setting(True),
        "ttt_steps": Setting(None, required=True),  # the recipe has no fallback: the steps unrolled in training
        "aux_layer_ids": Setting(None),  # None: Automodel's [1, L/2-1, L-4] (a target of 8 layers or more)
        "draft_vocab_size": Setting(None),  # None: the target's vocabulary
        "freeze_embeddings": Setting(True),
        "fc_norm": Setting(False),
        "norm_output": Setting(False),
        "lk_loss_type": Setting(None),
        "lk_kl_scale": Setting(1.0),
        "lk_kl_decay": Setting(3.0),
        "max_grad_norm": Setting(1.0),
        "packed_sequence_size": Setting(0),
        "log_every_steps": Setting(1, weights=False),
    },
    "optimizer": _optimizer(Setting(None, required=True), warmup_ratio=0.05),  # lr: the recipe has no fallback
}

# the target architectures 0.7.0's EAGLE-3 registry takes (components/speculative/eagle/registry.py,
# EAGLE3_DRAFT_REGISTRY; tests/test_trainer_automodel.py checks the list against it). The runner trains those
# whose draft vLLM serves as its Llama EAGLE-3 head (Llama, Phi-3, Qwen3, Qwen3-MoE).
EAGLE3_TARGETS = (
    "LlamaForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "KimiK3ForCausalLM",
    "KimiK3ForConditionalGeneration",
)


TRAINER = Trainer(
    name="automodel",
    package="nemo_automodel",
    version=VERSION,
    venv=VENV,
    recipes={"dflash": Recipe("dflash", DFLASH, TARGETS), "eagle3": Recipe("eagle3", EAGLE3, EAGLE3_TARGETS)},
    command=runner_command(RUNNER),
    progress=progress,
    max_gpus=MAX_GPUS,
)
