"""Multi-turn revision: the revised request keeps the take in context and asks for the change."""

import torch

from transformers_drama3.prompting import Line, Reference, Script, Take, revision

CODES = torch.arange(40).reshape(4, 10) % 7


def test_a_revision_keeps_the_take_as_history_and_asks_again_with_the_instruction():
    script = Script("<|speaker:0|> Go home now.", references=[Reference("Hello.", CODES, 0)])
    revised = revision(script, CODES + 1, "slower, more tired")
    assert revised.text == script.text and revised.references == script.references
    assert revised.instruction == "slower, more tired"
    assert len(revised.history) == 1
    assert revised.history[0].text == "<|speaker:0|> Go home now."
    assert torch.equal(revised.history[0].audio.codes, CODES + 1)


def test_a_revision_lays_out_as_the_script_with_the_take_written_by_hand(bundled_tiny):
    _, processor = bundled_tiny
    codes = torch.arange(10 * processor.num_codebooks).reshape(processor.num_codebooks, 10) % 7
    script = Script([Line("Go home now.", 0), Line("Not yet.", 1)], references=[
        Reference("Hello.", codes, 0), Reference("Hi.", codes, 1)])
    by_hand = Script(script.lines, script.references, history=[Take(script.lines, codes + 2)], instruction="softer")
    rows = processor(revision(script, codes + 2, "softer"))
    expected = processor(by_hand)
    assert torch.equal(rows["input_ids"], expected["input_ids"])
    assert torch.equal(rows["audio_codes"], expected["audio_codes"])


def test_revising_a_revision_keeps_every_take_and_the_earlier_instruction_in_its_turn():
    first = revision(Script("Go home now."), CODES, "slower")
    second = revision(first, CODES + 1, "more tired")
    assert [take.text for take in second.history] == ["<|speaker:0|> Go home now.", "<|speaker:0|> [slower] Go home now."]
    assert second.instruction == "more tired"
