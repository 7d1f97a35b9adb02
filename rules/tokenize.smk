rule tokenize:
    input:
        # Not ancient(), unlike the prompt manifest of a GPU job: Snakemake (9.27) skips every job downstream
        # of a forced one whose inputs are all ancient and present, so after a killed Snakemake
        # `--rerun-incomplete` would rerun the generate jobs and leave tokenize and mix undone. A
        # completion is rewritten only with its token shard gone (restores keep its mtime); tokenizing is cheap.
        completions=planned_input("tokenize", "completions"),
        # each sample's language is its prompt's (the shard's prompts lie beside the manifest)
        prompts=planned_input("tokenize", "prompts", ancient),
    output:
        data=update(shard_pattern(STORE, layout.TOKENS, layout.DATA)),
        stats=update(shard_pattern(STORE, layout.TOKENS, layout.SIDECAR)),
    log:
        shard_pattern(LOGS, layout.TOKENS, layout.LOG),
    conda:
        "../envs/cpu.yaml"
    script:
        "scripts/stage.py"
