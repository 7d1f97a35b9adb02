"""Scheme versions of what each stage writes.

Bump one by hand when a code change changes the bytes a stage writes for the same inputs: every key
downstream changes and the affected shards rebuild. Code edits that do not change output leave these
alone and rerun nothing.
"""

# 2: empty system turns no longer drop a row; Hermes tools found past a prose mention of <tools> and in
# Python-literal blocks; a UTF-8 BOM no longer costs the first row; invalid UTF-8 costs only its row.
# 3: tool schemas lose null-valued keys (a dataset stored as Arrow structs writes other tools' property
# names as null).
PREP_VERSION = 3
# The words near-duplicate removal and decontamination compare (stages/words.py), in the prompt key of a
# source only when one of those filters is on. 2: a character of a script written without spaces (Han,
# Kana, Thai, ...) is a word of its own. English text splits as before; its keys change once, and the row
# index serves every row again, so nothing is generated twice.
WORDS_VERSION = 2
# The language detector and its script rule (dflash_build/language.py): in the tokenize key (every
# sample's `language`) and, for a source with a language list, in its prompt key.
LANGUAGE_VERSION = 2
# 2: the transformers backend seeds every position from (row seed, position), so a continued answer
# equals a fresh one; reused rows pass the context check; keyed engine options in gen_key.
# 3: row seeds are 31-bit (every engine takes them as they are); the sglang backend sends every penalty
# explicitly and reads SGLang 0.5.23's results (stop token, NaN faults, refusals).
GEN_VERSION = 3
# 2: samples carry `turn` (per-turn samples of a turns: all conversation; null for a whole row).
# 3: samples carry `language`, their prompt's (tokenize reads the prompt shard; nothing is generated again).
# 4: samples carry `variant`, the sampling variant they were generated under (null without variants).
TOK_VERSION = 4
# 2: data file names carry a digest of their content.
# 3: the folder also holds the report (card recipe and tables, plots/, tables/); in the mix's params, so
# a dataset built before gets it on the next run.
# 4: ranks are SplitMix64 of (seed, prompt id, sample) over numpy arrays (streaming mix), not SHA-256.
# 5: a category with a target is never left empty (its shortest sample, when every one is over twice the
# target).
MIX_VERSION = 5
PACK_VERSION = 1
# 2: the conversations export writes only answers the dataset trains on (a per-turn sample the dataset
# lacks is left out, a conversation on the regenerated history ends before it).
EXPORT_VERSION = 2
# The eval split (stages/evalset/): in its eval_key (Plan.eval_key, the rule's params) and in its
# split_key (the digest of its rows, which each acceptance measurement is keyed by).
EVAL_VERSION = 1
# Each drafter's acceptance measurement (keys.accept_key). 2: the engine's calibration, the engine and its
# version, τ per request, a context slice; the split no longer carries max_new_tokens. 3: degenerate
# answers by the build's rule and thresholds.
ACCEPT_VERSION = 3
# The engine's calibration before the drafters (stages/accept/calibration.py, keys.calibration_key).
CALIBRATION_VERSION = 1
# The train stage's key (keys.train_key): what a trained drafter is made of.
TRAIN_VERSION = 1
