"""What the stages share, apart from the stages themselves: the stage contract (``job``: the Job every
stage's ``run`` takes, ``StageFailure``), the target's tokenizer and chat template (``chat``), prompts
several sources hold (``crosssource``), each category's token target (``targets``: the mix's rule, which the
sizing follows), and prepare's text filters (``filters`` over ``words``:
``decontaminate``, ``neardup``)."""
