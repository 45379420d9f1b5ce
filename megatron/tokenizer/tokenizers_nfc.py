"""NFC exactly as a ``tokenizers`` NFC normalizer gives it, without paying its cost on text it leaves unchanged.

Python's ``unicodedata`` and the Rust crate behind ``tokenizers``' NFC have different Unicode versions, and
their NFC differs on text with characters assigned in between (e.g. ``"a\\u0898\\u0323"``: Python reorders the two
marks, ``tokenizers`` does not know U+0898). So the normalization itself is always ``tokenizers``' own normalizer
object. Calling it costs about as much per character as encoding, so text made only of *inert* characters skips
it: characters that by Python's tables are assigned, of combining class 0, their own NFC, not a possible second
part of a composition (NFC_QC=Maybe) and not decomposing to one that is or to a mark. Every character of such a
text starts a normalization boundary (UAX #15), so the text is NFC; and it is NFC in every Unicode version,
older or newer (the Unicode normalization stability policy: an assigned character's decomposition and combining
class never change and no two existing characters get a new composition; a character Python does not know, which
a newer version may give any properties, is not inert).
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache
from typing import Any

# Hangul medial vowels and final consonants compose with a preceding syllable algorithmically (no decomposition
# entry names them).
_HANGUL_V = range(0x1161, 0x1176)
_HANGUL_T = range(0x11A8, 0x11C3)
# No character at or above this has a canonical decomposition of two characters (the last are CJK compatibility
# ideographs, which are singletons).
_LAST_DECOMPOSED = 0x2FA20


@lru_cache(maxsize=1)
def composition_seconds() -> frozenset[str]:
    """Characters that compose with a preceding one (NFC_QC=Maybe) by Python's tables."""
    seconds = {chr(c) for c in (*_HANGUL_V, *_HANGUL_T)}
    for code in range(0x80, _LAST_DECOMPOSED):
        decomposition = unicodedata.decomposition(chr(code))
        if not decomposition or decomposition.startswith("<"):
            continue
        parts = decomposition.split()
        if len(parts) == 2:
            pair = chr(int(parts[0], 16)) + chr(int(parts[1], 16))
            if unicodedata.normalize("NFC", pair) == chr(code):  # a primary composite (not excluded)
                seconds.add(pair[1])
    return frozenset(seconds)


def is_inert(ch: str) -> bool:
    """Whether a text made of characters like ``ch`` is NFC in every Unicode version (see the module's doc)."""
    if ch.isascii():
        return True
    if unicodedata.category(ch) in ("Cn", "Cs") or unicodedata.combining(ch):
        return False
    seconds = composition_seconds()
    if ch in seconds or unicodedata.normalize("NFC", ch) != ch:
        return False
    first = unicodedata.normalize("NFD", ch)[0]
    return not unicodedata.combining(first) and first not in seconds


class TokenizersNFC:
    """``tokenizers.normalizers.NFC().normalize_str``, skipped on text of inert characters (checked per distinct
    character, remembered per instance)."""

    def __init__(self) -> None:
        from tokenizers import normalizers

        self._normalizer: Any = normalizers.NFC()
        self._inert: dict[str, bool] = {}

    def __call__(self, text: str) -> str:
        if text.isascii():
            return text
        inert = self._inert
        for ch in set(text):
            known = inert.get(ch)
            if known is None:
                known = inert[ch] = is_inert(ch)
            if not known:
                return str(self._normalizer.normalize_str(text))
        return text
