from dflash_build import warm

# the report's next round is plan's own estimate (ops), which the stage is given: a stage imports no ops
warm.run(snakemake, "dflash_build.ops.nextround:accept_job")  # noqa: F821 (Snakemake injects `snakemake`)
