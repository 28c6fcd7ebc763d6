"""Built-in real text: what the export judges a model on when no --calibration is given, and the benchmarks'
sentences of mixed lengths."""

from __future__ import annotations

# Sentences for the reference check when no --calibration is given: short queries and a few passages, the
# lengths sentence-embedding users send.
SENTENCES = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a white horse on an enclosed ground.",
    "A woman is playing violin.",
    "Someone in a gorilla costume is playing a set of drums.",
    "How do I reset my password if I no longer have access to the email address on my account?",
    "What is the boiling point of water at high altitude?",
    "The quarterly report shows revenue grew eight percent while operating costs fell, driven mostly by lower "
    "energy prices and a smaller workforce in the European division.",
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen as a "
    "by-product; it takes place in the chloroplasts of plant cells, mostly in the leaves.",
)

# More real text of mixed lengths (the benchmarks' and the built-in calibration's), and a long passage.
MORE = (
    "A cheetah is running behind its prey.",
    "The new movie is awesome.",
    "The new movie is so great.",
    "The cat sits outside.",
    "The dog plays in the garden.",
    "I love pasta.",
    "Do you like pizza?",
    "Two men pushed carts through the woods.",
    "A monkey is playing drums.",
    "A man is playing a flute.",
    "A woman is slicing an onion.",
    "Stock markets fell sharply after the central bank raised interest rates again.",
)
PASSAGE = (
    "The committee met on Tuesday to review the proposed changes to the city's zoning rules, which would allow "
    "taller residential buildings near the new light rail stations and reduce parking minimums. "
)


def builtin_sentences() -> list[str]:
    """The built-in real text a model that takes text is judged on without --calibration: queries, sentences and
    passages of mixed lengths, one past 128 tokens."""
    return [*SENTENCES, *MORE, PASSAGE * 3]
