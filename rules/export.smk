rule export:
    input:
        dataset=rules.mix.output,
        # a format that reads the store (conversations: messages and answer texts) declares it
        store=planned_input("export", "store"),
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
