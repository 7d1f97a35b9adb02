rule export:
    input:
        dataset=rules.mix.output,
        store=get_export_store,
    output:
        record=directory(EXPORT_RECORD),
    log:
        layout.dist_log(LOGS, f"{CONFIG.dataset_name}-{{fmt}}"),
    conda:
        "../envs/cpu.yaml"
    params:
        export=get_export_params,
    script:
        "scripts/export.py"
