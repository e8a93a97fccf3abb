"""Stop strings: an answer ends at the first token after which its text contains one of them, and the text
returned (and shown while streaming) ends just before it, as OpenAI's `stop` does.

The check runs token by token in order inside the decoding loop, so a speculative step that accepts
tokens past a stop string ends the answer exactly where one-token decoding ends it.
"""
from __future__ import annotations

from collections.abc import Callable

from offload import Tokenizer

BYTES_PER_CHARACTER = 4     # a byte-level token may carry a single byte of a character


def check_stop_strings(strings: list[str]) -> list[str]:
    if any(not isinstance(s, str) or not s for s in strings):
        raise ValueError("a stop string must be non-empty text")
    return list(dict.fromkeys(strings))


def first_stop(text: str, strings: list[str]) -> int | None:
    """Where the earliest stop string in `text` begins, or None."""
    found = [index for index in (text.find(s) for s in strings) if index >= 0]
    return min(found) if found else None


class StopStrings:
    """A decoding StopCondition over text: looks at the answer's last few tokens only (enough to hold the
    longest stop string and the token before it), so each check costs a short decode."""

    def __init__(self, tokenizer: Tokenizer, strings: list[str]) -> None:
        self.tokenizer, self.strings = tokenizer, check_stop_strings(strings)
        self.window = BYTES_PER_CHARACTER * max(len(s) for s in self.strings) + 2

    def reached(self, answer_ids: list[int]) -> bool:
        return first_stop(self.tokenizer.decode(answer_ids[-self.window:]), self.strings) is not None

    def trim(self, text: str) -> str:
        cut = first_stop(text, self.strings)
        return text if cut is None else text[:cut]


class HeldBackText:
    """Streams text increments to `on_text`, holding back any tail that may be the start of a stop string
    and never showing a stop string or what follows it."""

    def __init__(self, strings: list[str], on_text: Callable[[str], None]) -> None:
        self.strings, self.on_text = strings, on_text
        self.text, self.shown = "", 0

    def push(self, delta: str) -> None:
        self.text += delta
        self._show_until(self._safe_end())

    def finish(self, final_text: str) -> None:
        """Shows the rest of the answer as returned (trimmed at its stop string)."""
        self.text = final_text
        self._show_until(len(final_text))

    def _safe_end(self) -> int:
        cut = first_stop(self.text, self.strings)
        if cut is not None:
            return cut
        held = max((k for s in self.strings for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return len(self.text) - held

    def _show_until(self, end: int) -> None:
        if end > self.shown:
            self.on_text(self.text[self.shown:end])
            self.shown = end
