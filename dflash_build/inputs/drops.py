"""Why a row does not become a prompt, as its conversion finds it: :class:`Drop` and its reasons.
(Selection adds its own reasons: ``dflash_build.stages.prepare.drops``.)"""

from __future__ import annotations

DROP_MALFORMED = "malformed_row"
DROP_INVALID_UTF8 = "invalid_utf8"
DROP_NO_USER_TURN = "no_user_turn"
DROP_EMPTY_CONTENT = "empty_content"
DROP_NON_STRING_CONTENT = "non_string_content"
DROP_UNKNOWN_ROLE = "unknown_role"
DROP_MISSING_FIELD = "missing_field"
DROP_INVALID_TOOLS = "invalid_tools"
DROP_TOO_SHORT = "too_short"
DROP_TOO_LONG = "too_long"
DROP_TEMPLATE_KWARG = "template_kwarg"  # a value chat_template_kwargs_from has no mapping for


class Drop(Exception):
    """A row that cannot become a prompt; ``reason`` is one of the DROP_* constants."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
