"""Wordle answer and guess lists, built from maintained word-list packages.

Nothing is pasted into the repository: the dictionary comes from
``english-words`` (Webster's 2nd and GCIDE word lists) and commonness from
``wordfreq``. Keeping the lists derived makes them reproducible for a given
pair of package versions and keeps licensing with the packages.

* **Answers** are five-letter words that both dictionaries list, that Webster's
  lists in lower case (so not a proper noun), and that are common enough
  (``wordfreq`` Zipf frequency >= ``ANSWER_MIN_ZIPF``) for a person or a small
  model to know. Obscure dictionary words ("jantu", "hepar") make a game
  unwinnable rather than hard.
* **Guesses** accept anything either dictionary lists plus frequent words that
  the dictionaries omit because they are inflections ("cares", "years").
  Being generous with guesses costs nothing; only answers need curation.

Both lists are sorted tuples so that a seed maps to the same target on every
machine with the same package versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

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
    from english_words import get_english_words_set
    from wordfreq import get_frequency_dict

    webster_raw = _five_letter(get_english_words_set(["web2"]))
    webster = {w.lower() for w in webster_raw}
    gcide = _five_letter(get_english_words_set(["gcide"], lower=True, alpha=True))

    frequency = get_frequency_dict("en")

    def zipf(word: str) -> float:
        """Zipf scale: log10 of occurrences per billion words (0 when unseen)."""
        f = frequency.get(word, 0.0)
        return math.log10(f) + 9.0 if f > 0 else 0.0

    common_nouns = {w for w in webster_raw if w.islower()}
    answers = sorted(w for w in common_nouns & gcide if zipf(w) >= ANSWER_MIN_ZIPF)
    frequent = {w for w in _five_letter(set(frequency)) if zipf(w) >= GUESS_MIN_ZIPF}
    guesses = frozenset(webster | gcide | frequent | set(answers))
    if not answers:
        raise RuntimeError("word-list packages produced no Wordle answers")
    return WordLists(answers=tuple(answers), guesses=guesses)
