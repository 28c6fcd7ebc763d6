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


# The quantized vectors' built-in calibration (model/quantize.py): each dimension's range over these, with
# SENTENCES, MORE and PASSAGE: questions, statements and passages across everyday topics, as an index holds them.
CALIBRATION = (
    "Where can I find the cheapest flights to Lisbon in March?",
    "How many calories are in a banana?",
    "best way to remove rust from a bicycle chain",
    "Is it safe to take ibuprofen with coffee?",
    "symptoms of vitamin D deficiency in adults",
    "How long does it take for concrete to cure?",
    "What time does the pharmacy on Main Street close on Sundays?",
    "python list comprehension with two conditions",
    "Why does my laptop fan run loudly when the lid is closed?",
    "Which countries border Switzerland?",
    "The train to Edinburgh was delayed by forty minutes because of a signal failure near York.",
    "She planted tomatoes, basil and peppers in raised beds along the south wall of the garden.",
    "Our support team answers emails within one business day, and urgent issues by phone.",
    "The museum's new wing houses a collection of ceramics from the Song dynasty.",
    "He forgot his umbrella and arrived at the interview soaked to the skin.",
    "Add the flour slowly, stirring constantly so that no lumps form in the sauce.",
    "The firmware update fixes a bug that drained the battery while the device was asleep.",
    "Volunteers collected more than two tonnes of plastic from the beach over the weekend.",
    "The contract may be terminated by either party with thirty days' written notice.",
    "A light breeze carried the smell of rain across the empty market square.",
    "The orchestra rehearsed the second movement until the strings were perfectly in tune.",
    "Patients should fast for eight hours before the blood test.",
    "The startup raised twelve million dollars to expand its delivery network to three new cities.",
    "Glaciers in the Alps have lost roughly a third of their volume since the 1990s.",
    "Please restart the router and wait two minutes before testing the connection again.",
    "The novel follows three generations of a fishing family on the coast of Norway.",
    "Children under twelve travel free when accompanied by an adult with a valid ticket.",
    "The referee stopped the match after a floodlight failed in the second half.",
    "Mix one part vinegar with three parts water to clean the windows without streaks.",
    "The library will extend its opening hours during the exam period in December.",
    "A low-pressure system will bring heavy snow to the northern mountains on Friday.",
    "The senator introduced a bill to cap the interest rate on student loans.",
    "Our hotel room overlooked the harbour, where fishing boats came in at dawn.",
    "The algorithm sorts the list in place and runs in linear time on nearly sorted input.",
    "Keep the medicine in a cool, dry place, out of the reach of children.",
    "The band's third album sold fewer copies than the first two but won over the critics.",
    "Heavy rainfall caused the river to burst its banks, flooding several villages downstream.",
    "The recipe calls for two eggs, a cup of sugar and a pinch of salt.",
    "Engineers traced the outage to a misconfigured load balancer in the east data centre.",
    "The painting was stolen in 1990 and has never been recovered.",
    "He ran the marathon in just under three hours, a personal best.",
    "The company recalled forty thousand cars because of a faulty brake sensor.",
    "Bees communicate the direction of flowers to the hive with a waggle dance.",
    "The tenants complained that the heating had been broken for two weeks.",
    "A good night's sleep improves memory, mood and concentration.",
    "The spacecraft entered orbit around Mars after a seven-month journey.",
    "Interest in electric bicycles has grown quickly among commuters in large cities.",
    "The teacher asked the students to summarise the chapter in their own words.",
    "My package was marked as delivered, but it never arrived at my door.",
    "The cathedral took more than two centuries to build and was finished in 1880.",
    "Update the app to the latest version to use the new offline maps.",
    "The defence argued that the evidence had been collected without a warrant.",
    "Farmers are switching to drought-resistant crops as summers grow hotter and drier.",
    "The kitten hid under the sofa for the whole first day in its new home.",
    "The price includes breakfast, free parking and access to the swimming pool.",
    "Scientists sequenced the genome of the ancient wheat found in the tomb.",
    "The meeting has been moved to Thursday at ten because the manager is travelling.",
    "Wear a helmet and bright clothing when cycling on busy roads at night.",
    "The bakery on the corner sells the best sourdough bread in town.",
    "Inflation slowed for the third month in a row, easing pressure on households.",
    "The hiking trail climbs steeply through pine forest before reaching the lake.",
    "The software license allows use on up to five devices per household.",
    "Tourists crowded the bridge to watch the sunset over the old town.",
    "The surgeon explained the risks of the operation before the patient signed the consent form.",
    "A power cut left thousands of homes without electricity during the storm.",
    "She learned to speak fluent Japanese after living in Osaka for four years.",
    "Return the form by the end of the month to keep your place on the course.",
    "The vaccine was shown to be ninety percent effective in preventing severe illness.",
    "The city council approved a new bike lane along the river embankment.",
    "The detective noticed that the clock on the mantelpiece had stopped at midnight.",
    "Customers can return unused items within thirty days for a full refund, provided they keep the receipt "
    "and the original packaging; sale items can be exchanged but not refunded.",
    "The study followed more than ten thousand adults for twenty years and found that those who walked at "
    "least thirty minutes a day had a markedly lower risk of heart disease, even after accounting for diet, "
    "smoking and income.",
    "To install the package, create a virtual environment, activate it, and run the installer with the "
    "dependencies pinned; if the build fails, check that a compiler and the development headers are present.",
    "The river delta supports hundreds of bird species, and conservation groups warn that the planned port "
    "would destroy the wetlands where many of them nest in spring.",
)


def builtin_sentences() -> list[str]:
    """The built-in real text a model that takes text is judged on without --calibration: queries, sentences and
    passages of mixed lengths, one past 128 tokens."""
    return [*SENTENCES, *MORE, PASSAGE * 3]


def calibration_sentences() -> list[str]:
    """The quantized vectors' built-in calibration: the built-in sentences and CALIBRATION's."""
    return [*builtin_sentences(), *CALIBRATION]
