"""Deterministic generator of plain English paragraphs for the bundled corpus.

The sentences are built from small hand-written phrase lists, so the text is free to ship and
reproducible from a seed. It is not meant to be interesting, only grammatical, varied and
English-like, which is enough for a tiny model to learn spelling, spacing and punctuation.
"""

from __future__ import annotations

import random
from typing import Iterator

SUBJECTS = (
    "the old farmer", "a young teacher", "my neighbour", "the engineer", "a tired traveller",
    "the baker", "our team", "the little girl", "a quiet student", "the captain", "the doctor",
    "my brother", "the gardener", "a curious child", "the musician", "the shop owner",
    "the river", "the wind", "the morning train", "a small dog", "the city council",
    "the scientist", "her grandmother", "the painter", "a group of friends", "the pilot",
)
VERB_PHRASES = (
    "carried a basket of apples", "opened the window", "wrote a long letter", "fixed the broken gate",
    "walked along the river", "counted the coins", "planted a row of beans", "read the news aloud",
    "cleaned the kitchen", "built a wooden boat", "climbed the hill", "watched the clouds",
    "painted the fence", "sang an old song", "cooked a pot of soup", "measured the room",
    "answered every question", "found a lost key", "repaired the old clock", "folded the maps",
    "checked the numbers twice", "sorted the letters", "waited for the bus", "fed the chickens",
    "carried the boxes upstairs", "drew a map of the town", "tested the new engine",
)
PLACES = (
    "at the market", "near the bridge", "in the garden", "by the lake", "in the small kitchen",
    "behind the school", "on the top floor", "in the village", "along the coast", "at the station",
    "in the workshop", "under the old tree", "in the library", "on the farm", "across the street",
)
TIMES = (
    "before noon", "early in the morning", "after dinner", "late at night", "on a cold Monday",
    "during the storm", "in the spring", "every Sunday", "at sunrise", "last summer",
    "after the long winter", "on the first day of the month", "while it was raining",
)
REASONS = (
    "because the work had to be finished", "so that nobody would worry", "because it was a fine day",
    "since the others were busy", "because the plan had changed", "so that the children could rest",
    "because the weather was turning", "since there was time to spare",
)
FOLLOW_UPS = (
    "Everyone agreed that it was a good idea.", "Nobody noticed at first.", "It took longer than expected.",
    "The result was better than anyone had hoped.", "Afterwards, there was tea for everybody.",
    "It was quiet for a while.", "Then the bell rang and the day went on.", "Nothing else happened that day.",
    "Later, they laughed about it.", "The next day began in the same way.", "It was not easy, but it worked.",
)
ADJECTIVES = ("bright", "quiet", "busy", "cold", "warm", "long", "short", "strange", "calm", "windy")
NOUNS = ("day", "week", "evening", "morning", "season", "year", "afternoon", "journey")


def _sentence(rng: random.Random) -> str:
    form = rng.randrange(6)
    subject, verb = rng.choice(SUBJECTS), rng.choice(VERB_PHRASES)
    if form == 0:
        text = f"{subject} {verb} {rng.choice(PLACES)} {rng.choice(TIMES)}."
    elif form == 1:
        text = f"{rng.choice(TIMES)}, {subject} {verb} {rng.choice(REASONS)}."
    elif form == 2:
        other = rng.choice(SUBJECTS)
        text = f"{subject} {verb}, and {other} {rng.choice(VERB_PHRASES)} {rng.choice(PLACES)}."
    elif form == 3:
        return rng.choice(FOLLOW_UPS)
    elif form == 4:
        text = f"it was a {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}, so {subject} {verb}."
    else:
        text = f"when {subject} {verb}, {rng.choice(SUBJECTS)} smiled and said nothing."
    return text[0].upper() + text[1:]


def iter_paragraphs(seed: int) -> Iterator[str]:
    """Endless stream of 3-6 sentence paragraphs, deterministic by ``seed``."""
    rng = random.Random(f"prose:{seed}")
    while True:
        yield " ".join(_sentence(rng) for _ in range(rng.randint(3, 6)))
