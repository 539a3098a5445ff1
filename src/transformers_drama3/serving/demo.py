"""The Gradio demo: direct a scene, hear it stream, then revise the take with a director's note.

    demo = build_demo(load_backend())         # drama3-tiny and its voices A and B, offline
    demo.queue().launch()                     # or `drama3 demo`; the Space's app.py does the same

The demo speaks through the server's path, not a second one: a `SpeechService` (the processor
turns each request into prompt rows, the engine decodes them with continuous batching) and the
codec's streaming decoder, window by window, as `/v1/audio/speech` streams. A model trained on
single-speaker cloning (drama3-tiny: `scene_mode` "turns") speaks a scene one speaker turn at a
time, one engine job per turn (`prompting.speaker_turns`); a model that speaks scenes jointly gets
one job for the whole script.

Revising a take is the paper's multi-turn revision: each request of the last take is asked again
with that take (its text and its codes) kept in context and the director's note as a relative
instruction (`prompting.revision`).

On a ZeroGPU Space the GPU exists only inside a call wrapped with `spaces.GPU`, so there the
engine has no scheduler thread and the wrapped call steps it (`driven_events`); elsewhere the
engine's own thread runs every request and concurrent users share its batch.

"Speak as it arrives" is streaming text input: a text is fed word by word on a clock, as a language
model would stream it, to `model.stream_text` (the server's WebSocket path), and its audio plays
while later words are still arriving.

The page is a list of tabs (`TABS`): a new mode is one more `(title, build)` pair. What the page does
is `serving.director`; this module is the page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import gradio as gr

from ..decoding import Option
from ..generation.live_text import ChunkSpoken, ChunkStarted
from ..prompting import CHUNK_BYTES
from .audio_formats import encode
from .protocol import MIN_CHUNK_BYTES
from .director import (  # noqa: F401  (the page's names, and the director's, importable from here as before)
    EXAMPLES,
    INSERTS,
    LICENCE_NOTICE,
    OWN_CLIP,
    PRESETS,
    SPEAKERS,
    TAKE_OPTIONS,
    WORDS_PER_SECOND,
    ArrivalUpdate,
    ArrivingText,
    Backend,
    Director,
    SpokenRequest,
    TakeSettings,
    TakeUpdate,
    VoiceChoice,
    gpu_call,
    load_backend,
    on_zero_gpu,
)


def _voice_choices(values: list) -> list[VoiceChoice]:
    """The panel's fields, (voice, clip, transcript) per speaker, flattened as gradio passes them."""
    return [VoiceChoice(speaker, *values[3 * speaker : 3 * speaker + 3]) for speaker in range(len(values) // 3)]


def _page_updates(director: Director, updates: Iterator[TakeUpdate], progress) -> Iterator[tuple]:
    """(streamed chunk, final take file, report, take state) for gradio, from a take's updates."""
    rate = director.service.processor.sampling_rate
    for update in updates:
        seconds = update.frames / director.service.processor.frame_rate
        progress(None, desc=f"request {update.request + 1}: {update.frames} frames, {seconds:.1f} s of audio")
        if update.take is not None:
            yield gr.skip(), update.path, update.report, update.take
        elif update.audio is not None:
            # WAV bytes, 16-bit: gradio scales float arrays each to its own peak, and writes arrays to
            # a cache file named by their content, which two streams with an equal chunk would share
            yield encode(update.audio, rate, "wav"), gr.skip(), gr.skip(), gr.skip()


def _voice_panel(director: Director, voices: list[str]) -> list:
    """A voice per speaker, and each speaker's own clip and transcript folded away; returns the
    fields as the handlers take them: (voice, clip, transcript) per speaker."""
    names = director.voice_names
    with gr.Row():
        pickers = [
            gr.Dropdown(voices, value=names[speaker % len(names)] if names else OWN_CLIP,
                        label=f"Speaker {speaker} voice", elem_id=f"voice-{speaker}", min_width=100)
            for speaker in range(SPEAKERS)
        ]
    fields = []
    with gr.Accordion(f"Your own voices (choose {OWN_CLIP!r} above): a clip and what it says", open=False):
        for speaker, picker in enumerate(pickers):
            with gr.Row():
                clip = gr.Audio(sources=["upload", "microphone"], type="numpy", label=f"Speaker {speaker} clip")
                transcript = gr.Textbox(label=f"Speaker {speaker} transcript", placeholder="what the clip says", lines=3)
            fields += [picker, clip, transcript]
    return fields


def option_field(option: Option) -> gr.Number:
    """The panel's field of one request option (`decoding.options`): a number named by its label,
    empty by default (the option is left to the preset or the model), whole for an integer option."""
    return gr.Number(value=None, precision=0 if option.kind is int else None, label=f"{option.demo_label} (empty: {option.unset})",
                     info=option.help, elem_id=f"option-{option.name.replace('_', '-')}")


def _named(values) -> dict:
    """The panel's field values (in `TAKE_OPTIONS`' order) by option name."""
    return {option.name: value for option, value in zip(TAKE_OPTIONS, values)}


def build_scene_tab(director: Director) -> None:
    """The "Direct a scene" tab: script, chips, voices, sampling, the streamed take and its revision."""
    voices = [OWN_CLIP, *director.voice_names]
    with gr.Row():
        with gr.Column(scale=3):
            script = gr.Textbox(label="Script", lines=6, elem_id="script",
                                placeholder="<|speaker:0|> Did you hear that?\n<|speaker:1|> [whispers] <whisper>It's only the cat.</whisper>")
            with gr.Row():
                chips = [(gr.Button(label, size="sm", min_width=60), text) for label, text in INSERTS]
            note = gr.Textbox(label="Director's note", elem_id="note", placeholder="tense, hushed (written before every line)")
            voice_fields = _voice_panel(director, voices)
            with gr.Accordion("Sampling", open=False):
                preset = gr.Radio(list(PRESETS), value="model default", label="Preset")
                option_fields = [option_field(option) for option in TAKE_OPTIONS]
            generate = gr.Button("Generate", variant="primary", elem_id="generate")
        with gr.Column(scale=2):
            stream = gr.Audio(label="Take (streaming)", streaming=True, autoplay=True, interactive=False, elem_id="stream")
            final = gr.Audio(label="Final take (download)", type="filepath", interactive=False, elem_id="final-take")
            report = gr.Markdown(label="Report", elem_id="report")
            revision_note = gr.Textbox(label="Revision note", elem_id="revision-note", placeholder="slower, more tired")
            revise = gr.Button("Revise the take", elem_id="revise")
    take = gr.State(None)
    if {voice for example in EXAMPLES for voice in example[2:]} <= set(director.voice_names):
        gr.Examples([list(example) for example in EXAMPLES], [script, note, voice_fields[0], voice_fields[3]], label="Ready scripts")
    else:  # a model without drama3-tiny's voices: the scripts alone
        gr.Examples([list(example[:2]) for example in EXAMPLES], [script, note], label="Ready scripts")

    for button, text in chips:
        button.click(lambda current, text=text: (current or "") + text, script, script, api_visibility="private")
    sampling = [preset, *option_fields]
    outputs = [stream, final, report, take]
    options = len(option_fields)

    @gpu_call
    def speak_script(text, director_note, preset, *values, progress=gr.Progress()):
        settings = director.settings(preset, **_named(values[:options]))
        choices = _voice_choices(list(values[options:]))
        requests = director.scene_requests(director.script(text, director_note, choices), choices)
        yield from _page_updates(director, director.speak(requests, settings, 1), progress)

    @gpu_call
    def revise_take(last_take, revision_note, preset, *values, progress=gr.Progress()):
        settings = director.settings(preset, **_named(values))
        requests = director.revision_requests(last_take, revision_note)
        yield from _page_updates(director, director.speak(requests, settings, last_take.number + 1), progress)

    generate.click(speak_script, [script, note, *sampling, *voice_fields], outputs, api_name="generate",
                   concurrency_limit=director.backend.concurrency, concurrency_id="take")
    revise.click(revise_take, [take, revision_note, *sampling], outputs, api_name="revise",
                 concurrency_limit=director.backend.concurrency, concurrency_id="take")


def _timeline(feed: ArrivingText, chunks: list) -> str:
    """The chunks as a table: their text, when it was complete, when its audio started, the delay."""
    rows = ["| chunk | text | text complete at | first audio at | delay |", "|---|---|---|---|---|"]
    for chunk in chunks:
        final = feed.arrival(chunk.piece)
        if isinstance(chunk, ChunkSpoken) and chunk.first_audio_at is not None:
            audio, delay = f"{chunk.first_audio_at:.2f} s", f"{chunk.first_audio_at - final:.2f} s"
        else:
            audio, delay = ("speaking..." if isinstance(chunk, ChunkStarted) else "no audio"), ""
        text = chunk.text.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {chunk.index} | {text} | {final:.2f} s | {audio} | {delay} |")
    return "\n".join(rows)


def _arrival_updates(director: Director, feed: ArrivingText, updates: Iterator[ArrivalUpdate], progress) -> Iterator[tuple]:
    """(streamed chunk, text arrived, timeline, final file, report) for gradio."""
    rate = director.service.processor.sampling_rate
    for update in updates:
        progress(None, desc=f"{update.arrived} of {len(feed.words)} words arrived, {len(update.chunks)} chunks started")
        arrived = "".join(feed.words[: update.arrived])
        text = f"**{update.arrived} of {len(feed.words)} words have arrived:** {arrived}"
        if update.path is not None:
            yield gr.skip(), text, _timeline(feed, update.chunks), update.path, update.report
        else:
            audio = encode(update.audio, rate, "wav") if update.audio is not None else gr.skip()
            yield audio, text, _timeline(feed, update.chunks), gr.skip(), gr.skip()


ARRIVING_EXAMPLE = (
    "Good evening, and welcome back. Tonight we look at how the river changed the town, "
    "from the first bridge to the floods of last spring. [pause] It is a story of patience."
)


def build_text_stream_tab(director: Director) -> None:
    """The "Speak as it arrives" tab: a text fed word by word (a simulated language model) is
    spoken while it arrives; the timeline shows each chunk's text and when its audio started."""
    names = director.voice_names
    with gr.Row():
        with gr.Column(scale=3):
            text = gr.Textbox(label="Text (fed word by word, as a language model streams it)", lines=5,
                              value=ARRIVING_EXAMPLE, elem_id="arriving-text")
            with gr.Row():
                voice = gr.Dropdown([*names, OWN_CLIP], value=names[0] if names else OWN_CLIP, label="Voice",
                                    elem_id="arriving-voice", min_width=100)
                rate = gr.Slider(*WORDS_PER_SECOND, value=4, step=0.5, label="Words per second", elem_id="arriving-rate")
                chunk_bytes = gr.Slider(MIN_CHUNK_BYTES, CHUNK_BYTES, value=60, step=4,
                                        label="Chunk size (bytes; the published model uses 300)", elem_id="arriving-chunk")
            with gr.Accordion(f"Your own voice (choose {OWN_CLIP!r} above): a clip and what it says", open=False):
                with gr.Row():
                    clip = gr.Audio(sources=["upload", "microphone"], type="numpy", label="Speaker 0 clip")
                    transcript = gr.Textbox(label="Speaker 0 transcript", placeholder="what the clip says", lines=3)
            seed = gr.Number(value=None, precision=0, label="Seed (empty: random)", elem_id="arriving-seed")
            start = gr.Button("Stream it", variant="primary", elem_id="arriving-start")
            gr.Markdown(
                "Chunk k is spoken as soon as chunk k + 1 is known (the look-ahead the streaming layout "
                "needs), so the audio starts while the rest of the text is still arriving. drama3-tiny was "
                "not trained on the streaming layout: it shows the timing, the published model the voice."
            )
        with gr.Column(scale=2):
            stream = gr.Audio(label="Speech (streaming)", streaming=True, autoplay=True, interactive=False,
                              elem_id="arriving-stream")
            final = gr.Audio(label="Whole take (download)", type="filepath", interactive=False, elem_id="arriving-final")
            report = gr.Markdown(elem_id="arriving-report")
    arrived = gr.Markdown(elem_id="arriving-arrived")
    timeline = gr.Markdown(elem_id="arriving-timeline")

    @gpu_call
    def speak_arriving(text, voice, clip, transcript, rate, chunk_bytes, seed, progress=gr.Progress()):
        settings = director.settings("model default", seed=seed)
        feed = director.arriving_text(text, rate, chunk_bytes)
        choice = VoiceChoice(0, voice, clip, transcript)
        yield from _arrival_updates(director, feed, director.speak_as_it_arrives(feed, choice, settings, chunk_bytes), progress)

    start.click(speak_arriving, [text, voice, clip, transcript, rate, chunk_bytes, seed], [stream, arrived, timeline, final, report],
                api_name="speak_as_it_arrives", concurrency_limit=director.backend.concurrency, concurrency_id="take")


TABS: list[tuple[str, Callable[[Director], None]]] = [
    ("Direct a scene", build_scene_tab),
    ("Speak as it arrives", build_text_stream_tab),
]
"""The page's tabs, in order: (title, build(director)); a build adds its components inside the tab."""


def build_demo(backend: Backend) -> gr.Blocks:
    """The demo page over a loaded backend (see `load_backend`)."""
    director = Director(backend)
    with gr.Blocks(title="Drama 3: directed speech") as demo:
        gr.Markdown(
            f"# Drama 3: directed speech\nModel: **{backend.service.model_name}**. Write a scene with "
            "`<|speaker:N|>` turns, [directions] and `<tag>...</tag>` scoped tags, pick a voice per speaker "
            "(or give your own clip and its transcript), generate, then revise the take with a note."
        )
        with gr.Tabs():
            for title, build in TABS:
                with gr.Tab(title):
                    build(director)
        gr.Markdown(f"**{LICENCE_NOTICE}**", elem_id="licence")
    return demo


def launch(model: str | None = None, host: str = "127.0.0.1", port: int = 7860, share: bool = False,
           device: str = "auto", max_batch: int = 4, adapter_specs=(), **launch_kwargs):
    """Load the model once, then serve the demo (queued: takes beyond the engine's batch wait);
    `adapter_specs` ("NAME=PATH") add fine-tuned voices to the voice menus."""
    backend = load_backend(model, device, max_batch, adapter_specs)
    demo = build_demo(backend)
    demo.queue(default_concurrency_limit=backend.concurrency, max_size=64)
    return demo.launch(server_name=host, server_port=port, share=share, **launch_kwargs)
