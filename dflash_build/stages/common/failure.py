"""The one way a stage refuses its output: a message that states the whole story."""

from __future__ import annotations


class StageFailure(RuntimeError):
    """A stage refusing its output for a reason its message states whole (a source that lost too much,
    a shard whose rows mostly failed, a missed share, an empty export): the job ends with that message and
    exit status 1, without a traceback."""
