"""Wordle answer and guess lists, built from maintained word-list packages.

Nothing is pasted into the repository: the dictionary is Debian's ``wamerican``
package (SCOWL's American English list, a plain text file, ``/usr/share/dict``;
``WORDLE_DICT`` overrides the path) and commonness comes from ``wordfreq``.
Keeping the lists derived makes them reproducible for given package versions
and keeps licensing with the packages. (The ``english-words`` package was
dropped: it loads its lists with pickle.)

* **Answers** are five-letter words the dictionary lists in lower case (so not
  a proper noun), not plurals of a listed word, that are common enough
  (``wordfreq`` Zipf frequency >= ``ANSWER_MIN_ZIPF``) for a person or a small
  model to know. Obscure dictionary words make a game unwinnable rather than hard.
* **Guesses** accept any five-letter word the dictionary lists plus frequent
  words it omits. Being generous with guesses costs nothing; only answers need
  curation.

Both lists are sorted tuples so that a seed maps to the same target on every
machine with the same package versions.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DICTIONARY = "/usr/share/dict/american-english"
WORD_LENGTH = 5
ANSWER_MIN_ZIPF = 3.0
GUESS_MIN_ZIPF = 3.0


@dataclass(frozen=True)
class WordLists:
    """The two lists a game needs; ``guesses`` always contains every answer."""

    answers: tuple[str, ...]
    guesses: frozenset[str]


def _five_letter(words: set[str]) -> set[str]:
    return {w for w in words if len(w) == WORD_LENGTH and w.isascii() and w.isalpha()}


@lru_cache(maxsize=1)
def load_word_lists() -> WordLists:
    """Build (once per process) the answer and guess lists from the packages."""
    from wordfreq import get_frequency_dict

    path = Path(os.environ.get("WORDLE_DICT", DICTIONARY))
    if not path.exists():
        raise RuntimeError(f"no word list at {path}: install Debian's wamerican package "
                           "(apt-get install wamerican) or set WORDLE_DICT")
    listed = _five_letter(set(path.read_text(encoding="utf-8", errors="ignore").split()))

    frequency = get_frequency_dict("en")

    def zipf(word: str) -> float:
        """Zipf scale: log10 of occurrences per billion words (0 when unseen)."""
        f = frequency.get(word, 0.0)
        return math.log10(f) + 9.0 if f > 0 else 0.0

    common = {w for w in listed if w.islower()}
    lower = {w.lower() for w in path.read_text(encoding="utf-8", errors="ignore").split()}

    def plural(word: str) -> bool:  # "aches", "boxes": Wordle answers are not inflections
        return word.endswith("s") and (word[:-1] in lower or (word.endswith("es") and word[:-2] in lower))

    answers = sorted(w for w in common if zipf(w) >= ANSWER_MIN_ZIPF and not plural(w))
    frequent = {w for w in _five_letter(set(frequency)) if zipf(w) >= GUESS_MIN_ZIPF}
    guesses = frozenset({w.lower() for w in listed} | frequent | set(answers))
    if not answers:
        raise RuntimeError("word-list packages produced no Wordle answers")
    return WordLists(answers=tuple(answers), guesses=guesses)
