rule export:
    input:
        dataset=rules.mix.output,
        # a format that reads the store (conversations: messages and answer texts) declares it
        store=planned_input("export", "store"),
    output:
        # each format's record; dist/NAME-FORMAT links to its version
        record=directory(
            str(dflash_build.publish.release.record_dir(CONFIG.export_dir("{fmt}")))
        ),
    log:
        layout.dist_log(LOGS, f"{CONFIG.dataset_name}-{{fmt}}"),
    conda:
        "../envs/cpu.yaml"
    params:
        export=get_params("export"),
    script:
        "scripts/stage.py"
