# dflash-build: the target model's own answers to a prompt mix, as a content-addressed build.
# Every store path carries the hash of what determines its content (docs/architecture.md);
# `snakemake -n` lists every shard job that would run.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "rules/common.smk"


# Each stage the config enables, in the order the data flows: its package declares it
# (dflash_build/stages/NAME/stage.py) and rules/NAME.smk wires it.
for enabled_stage in STAGES:

    include: enabled_stage.rule_file


rule all:
    default_target: True
    input:
        get_final_targets(),


onstart:
    register_config()


onsuccess:
    stop_engines()
    print_summary()


onerror:
    stop_engines()
    explain_failure()
