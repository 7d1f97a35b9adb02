rule tokenize:
    input:
        completions=get_completion_shard,
        # each sample's language is its prompt's (the shard's prompts lie beside the manifest)
        prompts=get_prompt_manifest,
    output:
        data=update(shard_pattern(STORE, layout.TOKENS, layout.DATA)),
        stats=update(shard_pattern(STORE, layout.TOKENS, layout.SIDECAR)),
    log:
        shard_pattern(LOGS, layout.TOKENS, layout.LOG),
    conda:
        "../envs/cpu.yaml"
    script:
        "scripts/tokenize.py"
