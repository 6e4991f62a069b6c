"""Generate examples/data/stories.txt: a small English corpus for the embedded default run.

Short children's stories built from templates and word lists, with a fixed
seed, so the file is reproducible and has structure a tiny model learns in
minutes (grammar, agreement between a character and their pronoun, a plot
that refers back to its objects). One story per paragraph, separated by a
blank line.

Run (from the repository root)::

    python examples/data/make_stories.py            # writes examples/data/stories.txt
    python examples/data/make_stories.py --stories 500 --out /tmp/small.txt
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

CHARACTERS = [
    ("Lily", "she", "her"), ("Tom", "he", "his"), ("Mia", "she", "her"), ("Ben", "he", "his"),
    ("Anna", "she", "her"), ("Max", "he", "his"), ("Sara", "she", "her"), ("Leo", "he", "his"),
    ("Emma", "she", "her"), ("Sam", "he", "his"), ("Zoe", "she", "her"), ("Jack", "he", "his"),
    ("Lucy", "she", "her"), ("Finn", "he", "his"), ("Ella", "she", "her"), ("Noah", "he", "his"),
]
ANIMALS = ["cat", "dog", "bird", "rabbit", "frog", "duck", "fox", "bear", "mouse", "horse", "owl", "turtle"]
PLACES = ["park", "forest", "garden", "beach", "farm", "river", "hill", "town", "lake", "field", "village", "zoo"]
OBJECTS = ["ball", "kite", "box", "hat", "book", "cake", "boat", "toy", "map", "key", "flower", "drum", "cup", "bell"]
COLOURS = ["red", "blue", "green", "yellow", "big", "small", "shiny", "old", "new", "soft", "pretty", "funny"]
FEELINGS = ["happy", "sad", "scared", "excited", "tired", "proud", "surprised", "curious", "angry", "calm"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "quiet", "bright", "cloudy"]
VERBS = [("play", "played"), ("run", "ran"), ("jump", "jumped"), ("sing", "sang"), ("dance", "danced"),
         ("swim", "swam"), ("read", "read"), ("draw", "drew"), ("climb", "climbed"), ("walk", "walked")]
FRIENDS = ["mom", "dad", "grandma", "grandpa", "sister", "brother", "teacher", "friend"]
ENDINGS = [
    "From that day on, {name} and the {animal} were best friends.",
    "{Pro} went home and told {pos} {friend} all about it.",
    "That night, {name} fell asleep with a smile.",
    "{name} learned that it is good to share.",
    "{name} learned that it is good to be brave.",
    "It was the best day ever.",
    "{name} said thank you, and everyone was {feeling}.",
]


def story(rng: random.Random) -> str:
    """One story: an opening, a find, a problem, its solution and an ending."""
    name, pro, pos = rng.choice(CHARACTERS)
    animal, place, obj = rng.choice(ANIMALS), rng.choice(PLACES), rng.choice(OBJECTS)
    colour, feeling, weather = rng.choice(COLOURS), rng.choice(FEELINGS), rng.choice(WEATHER)
    verb, past = rng.choice(VERBS)
    friend = rng.choice(FRIENDS)
    words = {"name": name, "Pro": pro.capitalize(), "pro": pro, "pos": pos, "animal": animal, "place": place,
             "obj": obj, "colour": colour, "feeling": rng.choice(FEELINGS), "friend": friend, "verb": verb,
             "past": past}
    lines = [
        rng.choice([
            "Once upon a time, there was a little {kid} named {name}.",
            "One {weather} day, {name} went to the {place}.",
            "{name} was a {kid} who loved to {verb}.",
            "There was once a {kid} called {name} who lived near a {place}.",
        ]).format(kid="girl" if pro == "she" else "boy", weather=weather, **words),
        rng.choice([
            "{Pro} liked to {verb} in the {place} every day.",
            "At the {place}, {pro} saw a {colour} {obj}.",
            "{Pro} had a {colour} {obj} that {pro} loved very much.",
            "{Pro} {past} with {pos} {friend} all morning.",
        ]).format(**words),
        rng.choice([
            "Then {pro} met a little {animal}. The {animal} looked {fl}.",
            "Suddenly, a {animal} ran past and took the {obj}.",
            "But the {obj} fell into the {place} and {name} felt {fl}.",
            "A {animal} came and asked, \"Can I {verb} with you?\"",
        ]).format(fl=feeling, **words),
        rng.choice([
            "{name} said, \"Do not be {fl}. I will help you.\"",
            "{name} looked everywhere for the {obj}, and at last {pro} found it under a tree.",
            "{Pro} shared the {obj} with the {animal}, and they {past} together.",
            "{pos_c} {friend} came to help, and soon the {obj} was safe again.",
        ]).format(fl=feeling, pos_c=pos.capitalize(), **words),
        rng.choice(ENDINGS).format(**words),
    ]
    if rng.random() < 0.5:
        lines.insert(3, rng.choice([
            "The {animal} was {fl} and did not know what to do.",
            "It was {weather} and the wind was strong.",
            "{name} thought for a moment.",
        ]).format(fl=feeling, weather=weather, **words))
    return " ".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stories", type=int, default=12000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("stories.txt"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    text = "\n\n".join(story(rng) for _ in range(args.stories)) + "\n"
    args.out.write_text(text)
    print(f"wrote {args.out}: {args.stories} stories, {len(text) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
