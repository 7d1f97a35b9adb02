from dflash_build.stages import registry
from dflash_build.workflow import run_rule

# the stage its rule runs (its name, or the one that leads it: prepare_SOURCE, size_pilot)
run_rule(snakemake, registry.of_rule(snakemake.rule))  # noqa: F821 (Snakemake injects `snakemake`)
