from dflash_build.workflow import run_rule

run_rule(snakemake, "preflight")  # noqa: F821 (Snakemake injects `snakemake`)
