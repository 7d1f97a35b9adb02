from dflash_build.ops import nextround
from dflash_build.workflow import run_rule

# the report's next round is plan's own estimate (ops), which the stage is given: a stage imports no ops
run_rule(snakemake, "accept", next_round=nextround.table)  # noqa: F821 (Snakemake injects `snakemake`)
