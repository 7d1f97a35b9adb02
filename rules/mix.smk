rule mix:
    input:
        # not ancient() either (see rules/tokenize.smk); as_needed: the shards the top-up's sizing names
        tokens=(
            planned_input("mix", "tokens", sizing="size_topup")
            if AS_NEEDED
            else planned_paths("mix", "tokens")
        ),
        # with dedup.near across sources: each source's band keys
        bands=[ancient(p) for p in planned_paths("mix", "bands")],
        # the card's removed-rows table reads each source's prepare accounting
        manifests=[ancient(p) for p in planned_paths("mix", "manifests")],
    output:
        # the card's plots and tables go into `snakemake --report report.html` too
        record=report(
            # the build record beside the dataset's versions; dist/NAME is a link the stage swaps only
            # when a build passed (dflash_build.publish.release)
            directory(planned_paths("mix", "record", True)[0]),
            patterns=["plots/{name}.png", "tables/{name}.csv"],
            caption="report/dataset.rst",
            category="Dataset",
        ),
    log:
        layout.dist_log(LOGS, CONFIG.dataset_name),
    conda:
        "../envs/cpu.yaml"
    params:
        mix=get_params("mix"),
    script:
        "scripts/stage.py"
