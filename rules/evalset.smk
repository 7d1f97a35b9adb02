# config key `eval`: the prompts prepare held out of training, and the benchmark sets, rendered as the
# target is prompted into dist/NAME-eval (dflash_build.stages.evalset).
rule evalset:
    input:
        manifests=planned_paths("evalset", "manifests"),
    output:
        record=directory(planned_paths("evalset", "record", True)[0]),
    log:
        layout.dist_log(LOGS, f"{CONFIG.dataset_name}-eval"),
    conda:
        "../envs/cpu.yaml"
    params:
        # what the split asks the engine (keys.EVAL): an edit of it renders the split again
        key=PLAN.eval_key,
    script:
        "scripts/stage.py"
