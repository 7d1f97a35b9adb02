# config key `accept`: acceptance per slice of the eval split, for each drafter, read from the engine
# (dflash_build.stages.accept). Not part of `all`: `snakemake accept` or `dflash-build accept`. A drafter
# measured before is read from the store, so a new one costs only its own run.
rule accept:
    input:
        split=planned_paths("accept", "split"),
        dataset=planned_paths("accept", "dataset"),
        drafter=planned_paths("accept", "drafter"),
    output:
        record=directory(planned_paths("accept", "record", True)[0]),
    log:
        layout.dist_log(LOGS, f"{CONFIG.dataset_name}-acceptance"),
    conda:
        f"../envs/{dflash_build.engines.registry.get(CONFIG.backend).conda_env}.yaml"
    resources:
        gpu=1 if dflash_build.engines.uses_gpu(CONFIG.engine) else 0,
    params:
        accept=get_params("accept"),
    script:
        "scripts/accept.py"
