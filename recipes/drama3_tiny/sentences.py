"""Seeded sentence grammars for the drama3-tiny corpus: English (main) and Spanish (bonus).

Every sentence is generated here from word lists written for this project (no dataset text).
Numbers are always spelled out, because the tiny model reads words, not digits. The generators
take a `random.Random` so a corpus is a pure function of its seed.
"""

from __future__ import annotations

import random

# ---- numbers spelled out ------------------------------------------------------------------------

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_to_words(n: int) -> str:
    """English words for 0 <= n < 10000, e.g. 2417 -> 'two thousand four hundred seventeen'."""
    if not 0 <= n < 10000:
        raise ValueError(f"number_to_words covers 0..9999; got {n}")
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (f" {_ONES[ones]}" if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return f"{_ONES[hundreds]} hundred" + (f" {number_to_words(rest)}" if rest else "")
    thousands, rest = divmod(n, 1000)
    return f"{_ONES[thousands]} thousand" + (f" {number_to_words(rest)}" if rest else "")


def year_to_words(year: int) -> str:
    """A year as it is read aloud: 1984 -> 'nineteen eighty four', 2007 -> 'two thousand seven'."""
    if 2000 <= year < 2010:
        return number_to_words(year)
    high, low = divmod(year, 100)
    if low == 0:
        return f"{number_to_words(high)} hundred"
    return f"{number_to_words(high)} {'oh ' + _ONES[low] if low < 10 else number_to_words(low)}"


# ---- English vocabulary -------------------------------------------------------------------------

NAMES = (
    "Anna Bruno Clara Daniel Edith Felix Greta Hugo Irene Jonas Karin Leo Mara Nils Olga Peter "
    "Rosa Simon Tara Victor Wanda Yusuf Zelda Amir Bianca Conrad Delia Emil Fiona Gideon Hazel "
    "Ivan Julia Kofi Lena Milo Nadia Oscar Priya Ruben"
).split()

NOUNS = (
    "lamp kettle ladder blanket basket candle mirror bucket saddle drawer violin trumpet parcel "
    "envelope notebook pencil compass lantern umbrella suitcase wagon bicycle tractor canoe sailboat "
    "rocket helmet jacket sweater scarf glove boot necklace bracelet teapot saucer spoon fork plate "
    "bottle barrel crate hammer shovel rake ribbon button feather pebble shell acorn pumpkin melon "
    "carrot onion lemon apple pear cherry biscuit pancake sandwich pie pudding loaf cabbage turnip "
    "garden meadow orchard river harbour bridge tower castle cottage cabin chapel market bakery "
    "library museum station airport island valley canyon glacier desert forest swamp village "
    "harvest concert festival riddle puzzle letter message rumour secret promise journey voyage "
    "photograph painting statue sculpture poem novel chapter recipe ticket passport map calendar "
    "clock engine motor signal whistle drum guitar piano flute banner flag tent fence gate chimney "
    "window curtain carpet pillow mattress cupboard shelf table chair bench stool stove oven "
    "fountain lighthouse windmill tunnel highway pathway staircase balcony rooftop cellar attic "
    "dolphin penguin tortoise rabbit squirrel sparrow falcon pigeon beetle spider donkey pony camel "
    "goat lamb kitten puppy otter beaver badger walrus lobster"
).split()

_IRREGULAR_PLURALS = {"loaf": "loaves", "shelf": "shelves", "scarf": "scarves", "knife": "knives"}

ADJECTIVES = (
    "old young quiet noisy bright gloomy tiny enormous heavy light narrow wide crooked straight "
    "dusty shiny rusty polished wooden golden silver purple orange yellow crimson pale dark "
    "cheerful grumpy clever careless patient stubborn gentle fierce curious sleepy hungry thirsty "
    "ancient modern fragile sturdy slippery smooth rough warm chilly frozen soggy crisp fragrant "
    "bitter sweet sour salty spotless muddy broken borrowed forgotten hidden famous ordinary "
    "peculiar mysterious elegant clumsy lonely crowded empty tidy messy striped spotted velvet"
).split()

# (base, past)
TRANSITIVE_VERBS = (
    ("carry", "carried"), ("paint", "painted"), ("repair", "repaired"), ("borrow", "borrowed"),
    ("polish", "polished"), ("bury", "buried"), ("deliver", "delivered"), ("measure", "measured"),
    ("sketch", "sketched"), ("wrap", "wrapped"), ("open", "opened"), ("hide", "hid"),
    ("find", "found"), ("sell", "sold"), ("buy", "bought"), ("throw", "threw"),
    ("catch", "caught"), ("build", "built"), ("fold", "folded"), ("lift", "lifted"),
    ("clean", "cleaned"), ("count", "counted"), ("weigh", "weighed"), ("return", "returned"),
    ("describe", "described"), ("examine", "examined"), ("guard", "guarded"), ("trade", "traded"),
    ("steal", "stole"), ("drop", "dropped"), ("push", "pushed"), ("pull", "pulled"),
    ("chase", "chased"), ("admire", "admired"), ("forget", "forgot"), ("remember", "remembered"),
    ("unlock", "unlocked"), ("decorate", "decorated"), ("rescue", "rescued"), ("inspect", "inspected"),
)
INTRANSITIVE_VERBS = (
    ("sing", "sang"), ("laugh", "laughed"), ("whistle", "whistled"), ("wander", "wandered"),
    ("shiver", "shivered"), ("arrive", "arrived"), ("vanish", "vanished"), ("sparkle", "sparkled"),
    ("tremble", "trembled"), ("rest", "rested"), ("wait", "waited"), ("dance", "danced"),
    ("sleep", "slept"), ("hurry", "hurried"), ("complain", "complained"), ("listen", "listened"),
    ("glow", "glowed"), ("drift", "drifted"), ("rattle", "rattled"), ("squeak", "squeaked"),
    ("giggle", "giggled"), ("stumble", "stumbled"), ("sneeze", "sneezed"), ("yawn", "yawned"),
)

ADVERBS = (
    "slowly quickly quietly loudly carefully happily sadly suddenly gently proudly eagerly "
    "nervously politely calmly bravely lazily secretly boldly patiently cheerfully"
).split()

PLACES = (
    "near the harbour", "behind the old mill", "under the kitchen table", "beside the river",
    "at the top of the hill", "inside the museum", "across the valley", "on the balcony",
    "in the crowded market", "next to the station", "at the edge of the forest", "in the attic",
    "under the bridge", "by the fountain", "in the back garden", "on the second floor",
    "outside the bakery", "along the narrow path", "behind the lighthouse", "in the cellar",
)

TIMES = (
    "this morning", "last night", "before breakfast", "after lunch", "at midnight", "on Sunday",
    "on Tuesday evening", "every Friday", "in the spring", "during the storm", "at sunrise",
    "yesterday afternoon", "next winter", "before the concert", "after the festival",
    "on Monday", "at dawn", "later today", "in early autumn", "on Thursday",
)

DEADLINES = ("breakfast", "lunch", "midnight", "sunset", "the concert", "Friday", "the storm")

RELATIVES = "aunt uncle cousin grandmother grandfather neighbour sister brother teacher friend".split()

CITIES = (
    "Lisbon Oslo Vienna Dublin Prague Madrid Warsaw Helsinki Athens Geneva Boston Denver Seattle "
    "Toronto Sydney Nairobi Cairo Lima Quito Osaka"
).split()

CONTAINERS = "box jar tin drawer basket bag chest bowl".split()


def pluralize(noun: str) -> str:
    """English plural of a noun from the lists above."""
    if noun in _IRREGULAR_PLURALS:
        return _IRREGULAR_PLURALS[noun]
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _capitalize(sentence: str) -> str:
    return sentence[0].upper() + sentence[1:]


def _count(rng: random.Random) -> str:
    """A spelled-out count, mostly small, sometimes large."""
    n = rng.choice((rng.randint(2, 20), rng.randint(21, 99), rng.randint(100, 9999)))
    return number_to_words(n)


def _clock(rng: random.Random) -> str:
    hour = number_to_words(rng.randint(1, 12))
    minute = rng.choice((0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55))
    if minute == 0:
        return f"{hour} o'clock"
    return f"{hour} {'oh five' if minute == 5 else number_to_words(minute)}"


def _english_templates(rng: random.Random) -> str:
    c = rng.choice
    noun, noun2 = c(NOUNS), c(NOUNS)
    adj, adj2 = c(ADJECTIVES), c(ADJECTIVES)
    t_base, t_past = c(TRANSITIVE_VERBS)
    i_base, i_past = c(INTRANSITIVE_VERBS)
    name, name2 = c(NAMES), c(NAMES)
    templates = (
        lambda: f"{name} {t_past} {_article(adj)} {adj} {noun} {c(PLACES)}.",
        lambda: f"the {adj} {noun} {i_past} {c(ADVERBS)} {c(TIMES)}.",
        lambda: f"we counted {_count(rng)} {pluralize(noun)} {c(PLACES)}.",
        lambda: f"did {name} really {t_base} the {noun} {c(TIMES)}?",
        lambda: f"please {t_base} the {adj} {noun} before {c(DEADLINES)}.",
        lambda: f"in {year_to_words(rng.randint(1890, 2009))}, {name} {t_past} {_count(rng)} {pluralize(noun)}.",
        lambda: f"the {noun} {c(PLACES)} was {adj} and {adj2}.",
        lambda: f"{name} said that the {noun} would {i_base} {c(ADVERBS)}.",
        lambda: f"there are {_count(rng)} {adj} {pluralize(noun)} {c(PLACES)}.",
        lambda: f"why did the {adj} {noun} {i_base} {c(TIMES)}?",
        lambda: f"my {c(RELATIVES)} keeps {_count(rng)} {pluralize(noun)} in {_article(adj)} {adj} {c(CONTAINERS)}.",
        lambda: f"the train to {c(CITIES)} leaves at {_clock(rng)}.",
        lambda: f"{name} and {name2} {t_past} the {noun2} {c(ADVERBS)}.",
        lambda: f"nobody knew why the {noun} was so {adj}.",
        lambda: f"the {c(RELATIVES)} from {c(CITIES)} {t_past} {_count(rng)} {adj} {pluralize(noun2)}.",
        lambda: f"if the {noun} is {adj}, {name} will {t_base} the {noun2}.",
        lambda: f"{name} {i_past} {c(ADVERBS)} while the {adj} {noun} {c(INTRANSITIVE_VERBS)[1]}.",
        lambda: f"room {number_to_words(rng.randint(100, 999))} has {_article(adj)} {adj} {noun} and {_count(rng)} {pluralize(noun2)}.",
    )
    return _capitalize(c(templates)())


def english_sentence(rng: random.Random) -> str:
    """One English sentence, 5-16 words, numbers spelled out; a pure function of `rng`'s state."""
    return _english_templates(rng)


# ---- Spanish vocabulary (the bonus language) ----------------------------------------------------

_ES_ONES = (
    "cero uno dos tres cuatro cinco seis siete ocho nueve diez once doce trece catorce quince "
    "dieciséis diecisiete dieciocho diecinueve veinte"
).split()

# (singular, plural, gender)
ES_NOUNS = (
    ("libro", "libros", "m"), ("mesa", "mesas", "f"), ("ventana", "ventanas", "f"),
    ("perro", "perros", "m"), ("gato", "gatos", "m"), ("casa", "casas", "f"),
    ("barco", "barcos", "m"), ("flor", "flores", "f"), ("llave", "llaves", "f"),
    ("silla", "sillas", "f"), ("árbol", "árboles", "m"), ("camino", "caminos", "m"),
    ("manzana", "manzanas", "f"), ("carta", "cartas", "f"), ("reloj", "relojes", "m"),
    ("pájaro", "pájaros", "m"), ("puente", "puentes", "m"), ("lámpara", "lámparas", "f"),
    ("guitarra", "guitarras", "f"), ("sombrero", "sombreros", "m"), ("botella", "botellas", "f"),
    ("caballo", "caballos", "m"), ("nube", "nubes", "f"), ("vaso", "vasos", "m"),
)
ES_ADJECTIVES = (  # (masculine, feminine)
    ("viejo", "vieja"), ("nuevo", "nueva"), ("pequeño", "pequeña"), ("rojo", "roja"),
    ("blanco", "blanca"), ("tranquilo", "tranquila"), ("bonito", "bonita"), ("oscuro", "oscura"),
    ("grande", "grande"), ("verde", "verde"), ("azul", "azul"), ("alegre", "alegre"),
)
ES_NAMES = "Lucía Mateo Carmen Diego Elena Pablo Sofía Andrés Julia Tomás".split()
ES_PLACES = (
    "en la plaza", "en el mercado", "cerca del río", "en la cocina", "junto al puerto",
    "en el jardín", "detrás de la iglesia", "en la estación",
)
ES_DESTINATIONS = ("a la plaza", "al mercado", "al río", "a la playa", "al puerto", "a la estación")
ES_TIMES = ("hoy", "mañana", "ayer", "el lunes", "el viernes", "esta noche", "por la tarde")
ES_VERBS_PAST = ("compró", "encontró", "pintó", "vendió", "buscó", "limpió", "guardó", "trajo")


def _es_det(gender: str, plural: bool = False) -> str:
    return {("m", False): "el", ("f", False): "la", ("m", True): "los", ("f", True): "las"}[gender, plural]


def spanish_sentence(rng: random.Random) -> str:
    """One Spanish sentence from a small grammar (gender and number agree); spelled-out numbers."""
    c = rng.choice
    sing, plural, gender = c(ES_NOUNS)
    masc, fem = c(ES_ADJECTIVES)
    adj = masc if gender == "m" else fem
    adj_plural = adj + ("es" if adj[-1] not in "aeo" else "s")
    count = _ES_ONES[rng.randint(2, 20)]
    templates = (
        lambda: f"{c(ES_NAMES)} {c(ES_VERBS_PAST)} {count} {plural} {adj_plural} {c(ES_PLACES)}.",
        lambda: f"{_es_det(gender)} {sing} {adj} está {c(ES_PLACES)}.",
        lambda: f"{c(ES_TIMES)} vamos {c(ES_DESTINATIONS)} con {c(ES_NAMES)}.",
        lambda: f"¿Dónde está {_es_det(gender)} {sing} de {c(ES_NAMES)}?",
        lambda: f"hay {count} {plural} {c(ES_PLACES)}.",
        lambda: f"{c(ES_NAMES)} dice que {_es_det(gender, True)} {plural} son {adj_plural}.",
    )
    return _capitalize(c(templates)())


def english_content_words() -> set[str]:
    """Every distinct content word the English grammar can use (for the vocabulary test)."""
    words = set(NAMES) | set(NOUNS) | {pluralize(n) for n in NOUNS} | set(ADJECTIVES) | set(ADVERBS)
    words |= {w for pair in TRANSITIVE_VERBS + INTRANSITIVE_VERBS for w in pair}
    words |= set(RELATIVES) | set(CITIES) | set(CONTAINERS)
    return {w.lower() for w in words}


# ---- grammar 2: utterances from one word up, everyday vocabulary (issue 19) ------------------------

EVERYDAY_NOUNS = (
    "door key bus car phone book water coffee tea bread milk soup house room street city table bed "
    "shoe hat bag coat money ticket letter dog cat bird tree flower garden kitchen window chair "
    "doctor teacher baby child family friend school office shop bank park beach road bridge train "
    "plane boat dinner lunch breakfast apple orange egg cheese cake box picture song film game ball "
    "clock watch lamp cup glass plate knife pen paper map bottle radio computer camera jacket"
).split()
EVERYDAY_VERBS = (  # (base, third person, past)
    ("go", "goes", "went"), ("come", "comes", "came"), ("see", "sees", "saw"), ("take", "takes", "took"),
    ("give", "gives", "gave"), ("make", "makes", "made"), ("call", "calls", "called"), ("help", "helps", "helped"),
    ("need", "needs", "needed"), ("want", "wants", "wanted"), ("like", "likes", "liked"), ("know", "knows", "knew"),
    ("close", "closes", "closed"), ("start", "starts", "started"), ("stop", "stops", "stopped"),
    ("bring", "brings", "brought"), ("send", "sends", "sent"), ("read", "reads", "read"),
    ("write", "writes", "wrote"), ("cook", "cooks", "cooked"), ("wash", "washes", "washed"),
    ("pay", "pays", "paid"), ("lose", "loses", "lost"), ("keep", "keeps", "kept"), ("move", "moves", "moved"),
    ("watch", "watches", "watched"), ("fix", "fixes", "fixed"), ("check", "checks", "checked"),
)
COLOURS = "red blue green black white brown grey pink".split()
SIZES = "big small long short new old hot cold clean dirty full empty heavy".split()
PRONOUNS = (("I", "my"), ("you", "your"), ("we", "our"), ("they", "their"))
SINGLE_WORDS = (
    "Hi Hey Yes No Okay Sure Maybe Please Thanks Sorry Wait Stop Look Listen Welcome Goodnight "
    "Cheers Bravo Wonderful Perfect Great Fine Really Absolutely Never Always Tomorrow Today Tonight "
    "Yesterday Now Later Again Careful Quiet Ready Done Finally Coming Right Left Here There Why How "
    "Where When What Who Exactly Indeed Certainly Hurry Enough Congratulations Nonsense Excellent"
).split()
GREETINGS = (
    "good morning", "good evening", "good afternoon", "hello there", "hello again", "thank you",
    "thanks a lot", "excuse me", "see you soon", "see you later", "good luck", "well done",
    "not now", "not yet", "of course", "no problem", "come in", "sit down", "hold on", "take care",
    "all right", "why not", "me too", "right away", "just a moment", "never mind", "how lovely",
)
_ENDINGS = (".", ".", ".", "!", "?")

LENGTH_PROBES = {
    "1 word": ("Hello.", "Thanks.", "Goodbye."),
    "3 words": ("Open the door.", "See you tomorrow.", "I am hungry."),
    "6 words": ("The bus is late again today.", "She reads a book every night.", "Put the keys on the table."),
}
"""Short texts the evaluation asks for (`intelligibility_levers lm`): grammar 2 never writes them."""


def _everyday_noun(rng: random.Random) -> str:
    return rng.choice(EVERYDAY_NOUNS + NOUNS) if rng.random() < 0.3 else rng.choice(EVERYDAY_NOUNS)


def one_word(rng: random.Random) -> str:
    """'Hello.'-like utterances of one word: an interjection, a name, a noun or a number."""
    c = rng.choice
    kind = rng.random()
    if kind < 0.5:
        word = c(SINGLE_WORDS)
    elif kind < 0.65:
        word = c(NAMES)
    elif kind < 0.85:
        word = _capitalize(_everyday_noun(rng))
    else:
        word = _capitalize(number_to_words(rng.randint(1, 99)).replace(" ", "-"))
    return word + c(_ENDINGS)


def few_words(rng: random.Random) -> str:
    """Utterances of two or three words."""
    c = rng.choice
    noun = _everyday_noun(rng)
    base, third, past = c(EVERYDAY_VERBS)
    templates = (
        lambda: c(GREETINGS),
        lambda: f"{c(GREETINGS)}, {c(NAMES)}",
        lambda: f"the {c(COLOURS + SIZES)} {noun}",
        lambda: f"{base} the {noun}",
        lambda: f"{c(PRONOUNS)[1]} {noun}",
        lambda: f"{c(NAMES)} {past} it",
        lambda: f"{c(SINGLE_WORDS).lower()}, {c(NAMES)}",
        lambda: f"{number_to_words(rng.randint(2, 20))} {pluralize(noun)}",
        lambda: f"where is {c(NAMES)}",
        lambda: f"not the {noun}",
    )
    return _capitalize(c(templates)()) + c(_ENDINGS)


def short_sentence(rng: random.Random) -> str:
    """Everyday sentences of four to six words."""
    c = rng.choice
    noun, noun2 = _everyday_noun(rng), _everyday_noun(rng)
    base, third, past = c(EVERYDAY_VERBS)
    subject, possessive = c(PRONOUNS)
    templates = (
        lambda: f"{subject} {past} the {noun} {c(('today', 'yesterday', 'again', 'twice', 'early'))}.",
        lambda: f"the {noun} is {c(COLOURS + SIZES)} and {c(SIZES)}.",
        lambda: f"please {base} {possessive} {noun} now.",
        lambda: f"can you {base} the {noun}?",
        lambda: f"{c(NAMES)} {third} the {c(COLOURS + SIZES)} {noun}.",
        lambda: f"where did {subject} put the {noun}?",
        lambda: f"put the {noun} on the {noun2}.",
        lambda: f"the {noun} is {c(PLACES)}.",
        lambda: f"{subject} need {number_to_words(rng.randint(2, 12))} more {pluralize(noun)}.",
        lambda: f"{c(NAMES)} is {c(('late', 'early', 'here', 'tired', 'happy', 'busy', 'away'))} {c(TIMES)}.",
        lambda: f"is this {possessive} {noun}, {c(NAMES)}?",
        lambda: f"{subject} never {base} the {noun}.",
    )
    return _capitalize(c(templates)())


UTTERANCE_LENGTHS = (("1 word", 0.12, one_word), ("2-3 words", 0.18, few_words), ("4-6 words", 0.25, short_sentence),
                     ("sentence", 0.45, english_sentence))
"""Grammar 2's mix: (name, share, generator); the sentences are grammar 1's."""


def english_utterance(rng: random.Random) -> str:
    """One English utterance of grammar 2: one word, two or three, four to six, or a full sentence
    (shares in `UTTERANCE_LENGTHS`); a pure function of `rng`'s state."""
    draw, total = rng.random(), 0.0
    for _, share, generate in UTTERANCE_LENGTHS:
        total += share
        if draw < total:
            return generate(rng)
    return english_sentence(rng)
