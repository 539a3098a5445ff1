"""Tiny models, prompts and a cache-free reference decoder for the generation tests.

The reference recomputes everything with full forwards (no cache): the main token of the next
row from `speech_logits(hidden[:, -1])`, then codes 1..C-1 of that row one at a time from the
teacher-forced tower, appending the candidate row and refilling it code by code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from codec_helpers import tiny_codec
from model_helpers import CODEBOOK_SIZE, EOS, NUM_CODEBOOKS, SEMANTIC_START, tiny_model, tokenizer_config
from transformers_drama3 import Drama3ForSpeechGeneration
from transformers_drama3.processing_drama3 import Drama3Processor
from transformers_drama3.prompting.tokenizer_build import build_drama3_tokenizer

__all__ = [
    "CODEBOOK_SIZE", "EOS", "NUM_CODEBOOKS", "SEMANTIC_START", "SEPARATOR", "tiny_model",
    "prompt", "line_prompt", "line_model", "left_pad", "reference_greedy", "reference_greedy_lines",
    "script_main_tokens", "tiny_speech_bundle", "RecordingStreamer", "load_bundled_tiny", "GrowingCache",
    "ops_serve_cpu_rows",
]


@dataclass
class GrowingCache:
    """The plain reference of the package's `DecodeCache`: transformers' growing `DynamicCache`s,
    one for the backbone (hybrid) and one for the tower, which `model.prefill` / `model.extend` fill."""

    backbone: DynamicCache
    tower: DynamicCache

    @classmethod
    def empty(cls, config) -> "GrowingCache":
        return cls(backbone=DynamicCache(config=config.text_config), tower=DynamicCache())

IM_START = 3  # any text id stands in for <|im_start|> in these prompts
SEPARATOR = 100  # a free text id of the tiny vocabulary stands in for <|audio_separator|>


def prompt(seed: int, text_rows: int = 5, audio_rows: int = 4, tail_rows: int = 3):
    """A prompt shaped like the published layout: text, a reference's frames, `<|im_end|>`, then
    the turn to speak (text, `<|im_end|>`, a few rows). Returns input_ids [rows], audio_codes [rows, C]."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, SEMANTIC_START, (text_rows,), generator=generator).tolist()
    codes = [[0] * NUM_CODEBOOKS for _ in ids]
    for _ in range(audio_rows):
        frame = torch.randint(0, CODEBOOK_SIZE, (NUM_CODEBOOKS,), generator=generator).tolist()
        ids.append(SEMANTIC_START + frame[0])
        codes.append(frame)
    tail = [EOS, IM_START, *torch.randint(4, SEMANTIC_START, (tail_rows,), generator=generator).tolist(), EOS, IM_START]
    ids += tail
    codes += [[0] * NUM_CODEBOOKS for _ in tail]
    return torch.tensor(ids), torch.tensor(codes)


def line_prompt(seed: int, lines: int = 3, spoken: int = 0):
    """A line-by-line prompt: `prompt(seed)` whose turn to speak holds `lines` lines of two tokens
    separated by SEPARATOR, and whose voice turn already holds `spoken` segments of two frames,
    each followed by SEPARATOR. Returns input_ids [rows], audio_codes [rows, C]."""
    generator = torch.Generator().manual_seed(seed + 1000)
    ids, codes = prompt(seed, tail_rows=2)
    head_ids, head_codes = ids[:-5].tolist(), codes[:-5]
    body = []
    for line in range(lines):
        body += ([SEPARATOR] if line else []) + torch.randint(4, SEMANTIC_START, (2,), generator=generator).tolist()
    tail = [EOS, IM_START, *body, EOS, IM_START]
    tail_codes = [[0] * NUM_CODEBOOKS for _ in tail]
    for _ in range(spoken):
        for frame in torch.randint(0, CODEBOOK_SIZE, (2, NUM_CODEBOOKS), generator=generator).tolist():
            tail.append(SEMANTIC_START + frame[0])
            tail_codes.append(frame)
        tail.append(SEPARATOR)
        tail_codes.append([0] * NUM_CODEBOOKS)
    return torch.tensor(head_ids + tail), torch.cat([head_codes, torch.tensor(tail_codes)])


def line_model(seed: int = 0, scale: float = 3.0, **config_overrides):
    """`tiny_model(seed)` whose lm_head row for SEPARATOR is `scale` times that of <|semantic:0|>:
    greedy decoding of `line_prompt(2)` then draws the separator after frames 2 and 7 (seed 0)."""
    model = tiny_model(seed=seed, **config_overrides)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[SEPARATOR] = scale * weight[SEMANTIC_START]
    return model


def left_pad(prompts, pad_id: int = 0):
    """Left-pad prompts [(input_ids [rows], audio_codes [rows, C])] into a batch."""
    rows = max(ids.shape[0] for ids, _ in prompts)
    input_ids = torch.full((len(prompts), rows), pad_id, dtype=torch.long)
    audio_codes = torch.zeros(len(prompts), rows, NUM_CODEBOOKS, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), rows, dtype=torch.long)
    for item, (ids, codes) in enumerate(prompts):
        input_ids[item, rows - ids.shape[0]:] = ids
        audio_codes[item, rows - ids.shape[0]:] = codes
        attention_mask[item, rows - ids.shape[0]:] = 1
    return input_ids, audio_codes, attention_mask


@torch.no_grad()
def reference_greedy(model, input_ids: torch.Tensor, audio_codes: torch.Tensor, max_frames: int):
    """Greedy frames of one prompt (input_ids [rows], audio_codes [rows, C]) by full forwards only.

    Returns (frames [n, C] before eos, whether eos ended it)."""
    ids, codes = input_ids[None].clone(), audio_codes[None].clone()
    frames = []
    for _ in range(max_frames):
        hidden = model(ids, codes).last_hidden_state
        main = int(model.speech_token_ids()[model.speech_logits(hidden[0, -1]).argmax()])
        if main == EOS:
            return torch.tensor(frames, dtype=torch.long).view(-1, NUM_CODEBOOKS), True
        frame = [main - SEMANTIC_START] + [0] * (NUM_CODEBOOKS - 1)
        for codebook in range(1, NUM_CODEBOOKS):
            candidate_ids = torch.cat((ids, torch.tensor([[main]])), dim=1)
            candidate_codes = torch.cat((codes, torch.tensor([[frame]])), dim=1)
            logits = model(candidate_ids, candidate_codes).codebook_logits[0, -2, codebook - 1]
            frame[codebook] = int(logits.argmax())
        frames.append(frame)
        ids = torch.cat((ids, torch.tensor([[main]])), dim=1)
        codes = torch.cat((codes, torch.tensor([[frame]])), dim=1)
    return torch.tensor(frames, dtype=torch.long).view(-1, NUM_CODEBOOKS), False


@torch.no_grad()
def reference_greedy_lines(model, input_ids: torch.Tensor, audio_codes: torch.Tensor, max_frames: int, separators: int):
    """`reference_greedy` for a line-by-line prompt: SEPARATOR is a candidate after the band and
    eos while fewer than `separators` have been drawn; drawing it appends a text row.

    Returns (frames [n, C], line boundaries: frames before each separator, whether eos ended it)."""
    ids, codes = input_ids[None].clone(), audio_codes[None].clone()
    candidates = torch.cat((model.speech_token_ids(), torch.tensor([SEPARATOR])))
    frames, boundaries = [], []
    while len(frames) < max_frames:
        hidden = model(ids, codes).last_hidden_state[0, -1]
        separator = hidden @ model.lm_head.weight[SEPARATOR] if len(boundaries) < separators else torch.tensor(float("-inf"))
        main = int(candidates[torch.cat((model.speech_logits(hidden), separator[None])).argmax()])
        if main == EOS:
            return torch.tensor(frames, dtype=torch.long).view(-1, NUM_CODEBOOKS), boundaries, True
        frame = [0] * NUM_CODEBOOKS
        if main == SEPARATOR:
            boundaries.append(len(frames))
        else:
            frame[0] = main - SEMANTIC_START
            for codebook in range(1, NUM_CODEBOOKS):
                candidate_ids = torch.cat((ids, torch.tensor([[main]])), dim=1)
                candidate_codes = torch.cat((codes, torch.tensor([[frame]])), dim=1)
                logits = model(candidate_ids, candidate_codes).codebook_logits[0, -2, codebook - 1]
                frame[codebook] = int(logits.argmax())
            frames.append(frame)
        ids = torch.cat((ids, torch.tensor([[main]])), dim=1)
        codes = torch.cat((codes, torch.tensor([[frame]])), dim=1)
    return torch.tensor(frames, dtype=torch.long).view(-1, NUM_CODEBOOKS), boundaries, False


def script_main_tokens(model, scripts: list[list[int]]):
    """Make `model` draw the given main token ids, one list per item, step by step (then eos):
    replaces its `speech_logits` with logits that put all mass on the scripted id.

    A script may hold SEPARATOR: the model's SEPARATOR row of lm_head is zeroed (logit 0), the
    scripted band/eos token gets +1e4 and the others -1e4, so the separator wins exactly where it
    is scripted (and it is allowed: masked, the argmax falls on <|semantic:0|>)."""
    candidates = model.speech_token_ids()
    index_of = {int(token): index for index, token in enumerate(candidates)}
    state = {"step": 0}
    with torch.no_grad():
        model.get_output_embeddings().weight[SEPARATOR] = 0.0

    def speech_logits(hidden):
        step = state["step"]
        state["step"] += 1
        logits = torch.full((hidden.shape[0], hidden.shape[1], candidates.shape[0]), -1e4)
        for item, script in enumerate(scripts):
            token = script[step] if step < len(script) else EOS
            if token != SEPARATOR:
                logits[item, :, index_of[token]] = 1e4
        return logits

    model.speech_logits = speech_logits
    return model


# ---- a tiny model that matches a real tokenizer and codec (pipelines, CLI, long-form) -------------

BUNDLE_CODEBOOK_SIZE = CODEBOOK_SIZE  # the tiny models' semantic band, here a real tokenizer's


def tiny_speech_bundle(seed: int = 0):
    """(model, processor): a tiny model whose token ids match a tiny Drama 3 tokenizer (32 semantic
    tokens) and a tiny codec (4 codebooks), float32, random weights."""
    tokenizer = build_drama3_tokenizer(vocab_size=300, codebook_size=BUNDLE_CODEBOOK_SIZE)
    codec = tiny_codec(seed, semantic_codebook_size=BUNDLE_CODEBOOK_SIZE)
    torch.manual_seed(seed)
    # the model counts the codec's frames: its config carries the codec's rate and frame size
    config = tokenizer_config(tokenizer, BUNDLE_CODEBOOK_SIZE, sampling_rate=codec.sampling_rate, frame_size=codec.hop_length)
    model = Drama3ForSpeechGeneration(config).float().eval()
    # the tiny codec makes ~1400 frames a second, so its references last milliseconds: no length check
    processor = Drama3Processor(tokenizer, codec=codec, codebook_size=BUNDLE_CODEBOOK_SIZE, min_reference_fraction=0.0)
    return model, processor


class RecordingStreamer:
    """A streamer that keeps every chunk `put` to it and counts the calls to `end`."""

    def __init__(self):
        self.values, self.ends = [], 0

    def put(self, value):
        self.values.append(value)

    def end(self):
        self.ends += 1


def load_bundled_tiny():
    """drama3-tiny, the model shipped inside the package, loaded through the Auto classes.
    Returns (model, processor); conftest's `bundled_tiny` loads it once per test run."""
    from transformers import AutoModel, AutoProcessor

    from transformers_drama3.tiny import shipped

    model = AutoModel.from_pretrained(shipped.TINY_MODEL_PATH).eval()
    return model, AutoProcessor.from_pretrained(shipped.TINY_MODEL_PATH)


def recorded_step_order(stepper, monkeypatch, functions=("draw", "feed")) -> list[str]:
    """The order in which `stepper` (a `DecodeRun` or the serving engine) calls its step functions
    `functions` (by name: "draw", "feed", "step") and reads a step on the host ("read",
    `PendingStep.wait`), as it happens."""
    from transformers_drama3.decoding.loop import PendingStep

    events, wait = [], PendingStep.wait

    def recorded(name, function):
        def call(*args):
            events.append(name)
            return function(*args)
        return call

    for name in functions:
        setattr(stepper, f"_{name}", recorded(name, getattr(stepper, f"_{name}")))
    monkeypatch.setattr(PendingStep, "wait", lambda self: (events.append("read"), wait(self))[1])
    return events


def ops_serve_cpu_rows(monkeypatch):
    """Route CPU decode rows to the backbone's decode ops (`drama3::short_conv_update`,
    `drama3::gated_delta_rule_decode`; their kernels run in Triton's interpreter) as CUDA rows are
    routed."""
    from transformers_drama3.kernels import recurrent_decode, short_conv

    monkeypatch.setattr(short_conv, "kernel_serves", lambda hidden, activation: hidden.shape[-1] == 1)
    monkeypatch.setattr(recurrent_decode, "kernel_serves", lambda query, cu_seqlens=None: cu_seqlens is None and query.shape[1] == 1)
