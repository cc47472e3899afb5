"""Incremental detokenization for streaming: the text of a request's tokens released piece by piece, never
splitting a multi-byte character, and cut before the first stop string as OpenAI does.

The tokens are decoded after a few prompt tokens of context (a tokenizer's leading-space rules depend on the
token before), and a piece is released only once the decoded text no longer ends in an incomplete character
(U+FFFD). With stop strings, any tail that could begin one is held back until it is resolved, so the pieces
concatenate to the same text however the tokens arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CONTEXT_TOKENS = 5  # prompt tokens decoded with the output
INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """``push(token_ids)`` returns the newly released text; ``finish()`` the rest once the request ends.
    ``stopped`` turns True when a stop string appears: the text then ends before it and nothing more is
    released."""

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int],
                 stop: Sequence[str] = ()):
        self._decode = decode
        self._ids = [int(t) for t in prompt_ids[-CONTEXT_TOKENS:]]
        self._prefix = 0                  # decoding starts here (context for the next piece)
        self._read = len(self._ids)       # tokens before this are released
        self._stop = tuple(s for s in stop if s)
        self._held = ""                   # decoded text not released yet
        self.text = ""                    # all released text
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        self._held += self._decode_new(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._held += self._decode_new(final=True)
        return self._release(final=True)

    def _decode_new(self, final: bool) -> str:
        if len(self._ids) == self._read:
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith(INCOMPLETE) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def _release(self, final: bool) -> str:
        found = [i for i in (self._held.find(s) for s in self._stop) if i >= 0]
        if found:
            out, self._held, self.stopped = self._held[:min(found)], "", True
        else:
            keep = 0 if final else _stop_prefix_len(self._held, self._stop)
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        self.text += out
        return out


def _stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    for n in range(min(len(text), max((len(s) for s in stop), default=1) - 1), 0, -1):
        if any(s.startswith(text[-n:]) for s in stop):
            return n
    return 0
