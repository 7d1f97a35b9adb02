rule export:
    input:
        dataset=rules.mix.output,
        store=get_export_store,
    output:
        directory(EXPORT_RECORD),
    log:
        f"{LOGS}/dist/{CONFIG.dataset_name}-{{fmt}}.log",
    conda:
        "../envs/cpu.yaml"
    params:
        export=get_export_params,
    script:
        "scripts/export.py"
