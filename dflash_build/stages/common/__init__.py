"""What the stages share, apart from the stages themselves: the stage contract (``job``: the Job every
stage's ``run`` takes, ``StageFailure``), the target's tokenizer and chat template (``chat``), prompts
several sources hold (``crosssource``), and prepare's text filters (``filters`` over ``words``:
``decontaminate``, ``neardup``)."""
