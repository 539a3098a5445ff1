"""The phoneme text front end: espeak-ng phonemes for spoken text, tags as written, recorded in the
tokenizer's and the processor's saved config; a model without it reads text as before."""

import json
import subprocess
import sys

import pytest
import torch

from processor_helpers import random_codes
from transformers_drama3.processing_drama3 import Drama3Processor
from transformers_drama3.prompting import Line, Reference, Script, phonemes
from transformers_drama3.prompting.phonemes import PhonemeFrontEnd, frontend_config, phoneme_symbols, phoneme_token
from transformers_drama3.prompting.tokenizer_build import build_drama3_tokenizer

TEXTS = ["Hello there, how are you today?", "The quick brown fox jumps over the lazy dog!", "¿Qué tal, amigo?"]


@pytest.fixture(scope="module")
def config():
    return frontend_config(languages={"spanish": "es"})


@pytest.fixture(scope="module")
def front_end(config):
    return PhonemeFrontEnd(config)


@pytest.fixture(scope="module")
def phoneme_tokenizer(config, front_end):
    symbols = front_end.inventory([*TEXTS[:2], f"<spanish>{TEXTS[2]}</spanish>"])
    return build_drama3_tokenizer(TEXTS, codebook_size=8, phoneme_symbols=symbols, text_frontend=config)


def processor_for(tokenizer, **kwargs):
    return Drama3Processor(tokenizer, codebook_size=8, num_codebooks=2, **kwargs)


def test_phonemes_are_espeak_ipa_with_punctuation_and_word_boundaries(front_end):
    assert front_end.phonemes("Hello, world!") == "həlˈoʊ, wˈɜːld!"


def test_phonemising_the_same_text_twice_gives_the_same_phonemes(front_end):
    text = "If a messenger comes to the station, tell him the train left at nine."
    assert front_end.phonemes(text) == front_end.phonemes(text)


def test_speech_that_switches_voice_in_its_ssml_leaves_the_phonemes_unchanged(front_end):
    # Spoken in a child: this process keeps the library's first speech for the tests that fork
    # (speak_in_fresh_process). An SSML <voice> leaves another voice selected inside the library.
    script = (
        "from transformers_drama3.prompting.phonemes import espeak\n"
        "library = espeak()\n"
        "before = library.phonemes('Hello there', 'en-us')\n"
        "library.speak('<speak>Hola <voice xml:lang=\"es\">amigo</voice> bye</speak>', 'en-us', 50, 170)\n"
        "print(before + '|' + library.phonemes('Hello there', 'en-us'))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    before, after = result.stdout.strip().split("|")
    assert before == after == front_end.phonemes("Hello there")


def test_tags_styles_and_notes_stay_as_written(front_end):
    text = "(fast) [calmly] Hello [pause] <whisper>bye now</whisper>!"
    kept = [piece.content for piece in front_end.pieces(text) if not piece.phonemes]
    assert kept == ["(fast)", "[calmly]", "[pause]", "<whisper>", "</whisper>"]


def test_a_language_tag_phonemises_its_text_with_its_voice(front_end):
    inside = [p.content for p in front_end.pieces("<spanish>gracias</spanish>") if p.phonemes]
    assert inside == [front_end.backend.phonemes("gracias", "es")]
    assert inside != [front_end.phonemes("gracias")]


def test_digits_keep_their_decimal_point_inside_a_clause(front_end):
    assert "." not in front_end.phonemes("It is 2.5 metres") and front_end.phonemes("It is 2.5 metres.").endswith(".")


def test_the_tokenizer_spells_one_token_per_phoneme_symbol(phoneme_tokenizer, front_end):
    processor = processor_for(phoneme_tokenizer)
    ids = processor.rows(Script("Hello there.")).input_ids.tolist()
    symbols = phoneme_symbols(front_end.phonemes(" Hello there."))
    assert "oʊ" in symbols  # a diphthong is one symbol
    expected = [phoneme_tokenizer.convert_tokens_to_ids(phoneme_token(s)) for s in symbols]
    start = ids.index(expected[0], ids.index(phoneme_tokenizer.convert_tokens_to_ids("<|speaker:0|>")))
    assert ids[start : start + len(expected)] == expected


def test_reference_transcripts_are_phonemised_and_their_frame_rows_kept(phoneme_tokenizer):
    processor = processor_for(phoneme_tokenizer)
    codes = random_codes(40, seed=1, num_codebooks=2) % 8
    rows = processor.rows(Script("Hello.", references=[Reference("How are you today?", codes, 0)]))
    tokens = phoneme_tokenizer.convert_ids_to_tokens(rows.input_ids.tolist())
    question, first_frame = tokens.index("<|ph:?|>"), tokens.index("<|semantic:0|>".replace("0", str(int(codes[0, 0]))))
    assert phoneme_token("ɑː") in tokens[:question]
    assert phoneme_tokenizer.decode(rows.input_ids[question + 1 : first_frame]) == "\nSpeech: "
    assert torch.equal(rows.audio_codes[processor.token_ids.is_semantic(rows.input_ids)], codes.T)


def test_ids_before_the_phoneme_tokens_are_those_of_a_text_tokenizer(phoneme_tokenizer):
    plain = build_drama3_tokenizer(TEXTS, codebook_size=8)
    vocab = phoneme_tokenizer.get_vocab()
    assert all(vocab[token] == index for token, index in plain.get_vocab().items())
    assert min(i for t, i in vocab.items() if t.startswith("<|ph:")) == len(plain)


def test_a_saved_processor_and_tokenizer_keep_the_front_end(phoneme_tokenizer, config, tmp_path):
    processor = processor_for(phoneme_tokenizer)
    processor.save_pretrained(tmp_path)
    for name in ("processor_config.json", "tokenizer_config.json"):
        assert json.loads((tmp_path / name).read_text())["text_frontend"] == config
    loaded = Drama3Processor.from_pretrained(tmp_path)
    script = Script([Line("Hello there, how are you?", 0), Line("<whisper>The fox</whisper> [pause] jumps.", 1)])
    assert loaded.text_frontend == config
    assert torch.equal(loaded(script)["input_ids"], processor(script)["input_ids"])


def test_a_processor_without_a_front_end_saves_no_entry_and_reads_text(tmp_path):
    processor = processor_for(build_drama3_tokenizer(TEXTS, codebook_size=8))
    processor.save_pretrained(tmp_path)
    assert "text_frontend" not in json.loads((tmp_path / "processor_config.json").read_text())
    ids = processor.rows(Script("Hello there.")).input_ids.tolist()
    text = processor.tokenizer.encode(" Hello there.", add_special_tokens=False)
    assert ids[ids.index(processor.tokenizer.convert_tokens_to_ids("<|speaker:0|>")) + 1 :][: len(text)] == text


def test_a_front_end_the_tokenizer_disagrees_with_is_refused(phoneme_tokenizer, config):
    with pytest.raises(ValueError, match="disagrees with the tokenizer"):
        processor_for(phoneme_tokenizer, text_frontend={**config, "language": "en-gb"})


def test_a_front_end_without_phoneme_tokens_is_refused(config):
    with pytest.raises(ValueError, match="no phoneme tokens"):
        processor_for(build_drama3_tokenizer(TEXTS, codebook_size=8), text_frontend=config)


def test_an_unknown_front_end_type_is_refused(config):
    with pytest.raises(ValueError, match="unknown front end 'graphemes'"):
        PhonemeFrontEnd({**config, "type": "graphemes"})


def test_a_missing_phonemiser_names_the_front_end_and_the_install(config, monkeypatch):
    # A process without the library yet: the loaded one is kept aside, never initialised twice.
    monkeypatch.setattr(phonemes, "_ESPEAK", [])
    monkeypatch.setitem(sys.modules, "espeakng_loader", None)
    with pytest.raises(ImportError, match="pip install espeakng-loader") as error:
        PhonemeFrontEnd(config)
    assert "text_frontend=" in str(error.value)


def test_phoneme_symbols_take_the_longest_multi_character_phoneme():
    assert phoneme_symbols("tʃˈɜːtʃ aɪəɹ") == ["tʃ", "ˈ", "ɜː", "tʃ", " ", "aɪə", "ɹ"]


def test_a_multi_character_phoneme_outside_the_vocabulary_is_spelled_by_its_characters(config):
    tokenizer = build_drama3_tokenizer(TEXTS, codebook_size=8, phoneme_symbols={"ɔ", "ɪ", " "}, text_frontend=config)
    phonemes = processor_for(tokenizer).token_ids.phonemes
    assert processor_for(tokenizer).token_ids.phoneme_ids("ɔɪ ɔ") == [phonemes[s] for s in ("ɔ", "ɪ", " ", "ɔ")]


def test_a_symbol_outside_the_vocabulary_is_left_out_with_a_warning(phoneme_tokenizer):
    processor = processor_for(phoneme_tokenizer)
    with pytest.warns(UserWarning, match="not in the tokenizer's vocabulary"):
        ids = processor.token_ids.phoneme_ids("hʁ")
    assert ids == [processor.token_ids.phonemes["h"]]


# ---- phonemes written by hand, and parse of phoneme rows -------------------------------------------


def test_phonemes_in_braces_are_read_as_written(front_end):
    assert front_end.phonemes("Say {təmˈɑːtoʊ} twice") == front_end.phonemes("Say") + " təmˈɑːtoʊ " + front_end.phonemes("twice")
    assert front_end.phonemes("{həlˈoʊ}") == "həlˈoʊ" and front_end.phonemes("Hello") == "həlˈoʊ"


def test_phoneme_literal_puts_the_word_boundaries_outside_the_braces():
    assert phonemes.phoneme_literal(" həlˈoʊ, wˈɜːld ") == " {həlˈoʊ, wˈɜːld} "
    assert phonemes.phoneme_literal("bˈaɪ") == "{bˈaɪ}" and phonemes.phoneme_literal(" ") == " "


@pytest.mark.parametrize("text", [
    "Hello there, how are you today?",
    "(fast) [calmly] Hello [pause] <whisper>bye now</whisper>!",
    "<|speaker:0|> Hello. <|speaker:0|> How are you today?",
    "<spanish>¿Qué tal, amigo?</spanish> Hello.",
])
def test_phoneme_rows_parse_to_a_request_that_writes_them_again(phoneme_tokenizer, text):
    processor = processor_for(phoneme_tokenizer)
    codes = random_codes(30, seed=2, num_codebooks=2) % 8
    batch = processor(text=text, reference_audio=[codes], reference_text=["How are you today?"])
    request = processor.parse(batch)
    assert "<|ph:" not in request.text and "{" in request.text
    rows = processor.rows(request)
    assert torch.equal(rows.input_ids, batch["input_ids"][0][batch["attention_mask"][0].bool()])
    assert request.references[0].transcript.startswith("{")
