from dflash_build import warm

# the stage its rule runs (its name, or the one that leads it: prepare_SOURCE, size_pilot), done by a fork
# of the run's warm job runner where one serves the job (dflash_build.warm), else in this process
warm.run(snakemake, "dflash_build.workflow:run_job")  # noqa: F821 (Snakemake injects `snakemake`)
