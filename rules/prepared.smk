# The gate: every generate job waits for every source to be prepared (dflash_build.stages.prepared). Its
# record is an order-only input of the generate rule (dflash_build.snakemake_fixes.order_only): when a
# prepare reruns this job reruns, and no generate job reruns for it.
rule prepared:
    input:
        manifests=planned_paths("prepared", "manifests"),
    output:
        record=planned_paths("prepared", "record", True)[0],
    log:
        layout.dist_log(LOGS, f"{CONFIG.dataset_name}-prepared"),
    localrule: True
    conda:
        "../envs/cpu.yaml"
    script:
        "scripts/stage.py"
