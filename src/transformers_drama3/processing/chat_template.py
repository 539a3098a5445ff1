"""The chat template: conversations in the Hugging Face audio style (system / user / assistant or
speaker-number roles; text and audio items) -> the equivalent `Script` -> the same rows as the
script model. No Jinja is rendered: audio rows cannot be written as a string token for token."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..prompting import Clip, Reference, Script, Take, as_clip, check_speaker, parse_text, with_speaker_tag


class ChatTemplateMixin:
    """`Drama3Processor.apply_chat_template`: conversations -> scripts (`conversation_to_script`),
    then the processor's own `__call__` (rows) or `render` (text)."""

    def apply_chat_template(
        self,
        conversation: list[dict] | list[list[dict]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        return_dict: bool = True,
        return_tensors: str | None = "pt",
        processor_kwargs: dict | None = None,
        **kwargs,
    ):
        """Conversations in the Hugging Face audio style -> the same rows as the script model.

        Messages, in order:
        - `{"role": "system", "content": [text, audio, text, audio, ...]}`: references; each audio
          item follows its transcript; speaker from the audio item's or the message's "speaker" (0).
        - `{"role": "<N>"}` (a speaker 0-15, CSM style): text + audio = a reference of speaker N;
          text only = a line of speaker N.
        - `{"role": "user"}`: text = lines (raw text, `<|speaker:N|>` tags allowed); text followed
          by audio = a reference (speaker from the item's or message's "speaker", 0 by default).
        - `{"role": "assistant"}`: one audio item, the take of the lines since the previous take.
          Takes before the last lines are history; a take that ends the conversation is the target
          (training rows with labels).
        Content is a string or a list of `{"type": "text", "text"}` / `{"type": "audio", "path" |
        "url" | "audio" (+ "sampling_rate") | "codes"}` items.

        Returns the `__call__` BatchFeature (tokenize=True, return_dict=True), the input ids
        alone (return_dict=False), or the prompt text with audio as semantic tokens (tokenize=False).
        """
        if chat_template is not None:
            raise ValueError("chat_template: Drama 3 prompts are built by the layout, not by a Jinja template")
        unknown = set(kwargs) - {"return_assistant_tokens_mask", "continue_final_message"}
        if unknown:
            raise TypeError(f"apply_chat_template got unexpected arguments {sorted(unknown)}")
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        conversations = conversation if batched else [conversation]
        scripts = [
            conversation_to_script(messages, f"conversation[{index}]" if batched else "conversation")
            for index, messages in enumerate(conversations)
        ]
        if not add_generation_prompt and any(script.target is None for script in scripts):
            raise ValueError(
                "add_generation_prompt=False: a Drama 3 prompt without target audio always ends with the "
                "voice turn <|im_start|>assistant\\n<|voice|>"
            )
        if not tokenize:
            texts = [self.render(script) for script in scripts]
            return texts if batched else texts[0]
        outputs = self(scripts, return_tensors=return_tensors, **(processor_kwargs or {}))
        return outputs if return_dict else outputs["input_ids"]


def _content_items(message: dict, location: str) -> list[dict]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{location}.content: a string or a list of items; got {type(content).__name__}")
    for index, item in enumerate(content):
        if not isinstance(item, dict) or item.get("type") not in ("text", "audio"):
            raise ValueError(f"{location}.content[{index}]: items are {{'type': 'text'|'audio', ...}}")
    return list(content)


def _audio_clip(item: dict, location: str) -> Clip:
    keys = [key for key in ("path", "url", "audio", "codes") if item.get(key) is not None]
    if len(keys) != 1:
        raise ValueError(f"{location}: an audio item needs exactly one of path, url, audio or codes; got {keys}")
    value = item[keys[0]]
    if keys[0] in ("path", "url"):
        return Clip(path=os.fspath(value))
    if keys[0] == "codes":
        return Clip(codes=value if isinstance(value, (torch.Tensor, np.ndarray)) else np.asarray(value))
    return as_clip(value, location, item.get("sampling_rate"))


def _speaker_role(role: Any) -> int | None:
    if isinstance(role, (int, np.integer)) and not isinstance(role, bool):
        return int(role)
    if isinstance(role, str) and role.isdigit():
        return int(role)
    return None


def conversation_to_script(messages: Sequence[dict], location: str = "conversation") -> Script:
    """A conversation (see `Drama3Processor.apply_chat_template`) -> the equivalent `Script`."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{location}: a conversation is a non-empty list of messages")
    references: list[Reference] = []
    takes: list[Take] = []
    pending: list = []
    for index, message in enumerate(messages):
        where = f"{location}[{index}]"
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"{where}: a message is a dict with 'role' and 'content'")
        role = message["role"]
        items = _content_items(message, where)
        speaker = _speaker_role(role)
        if role in ("system", "user") or speaker is not None:
            default = check_speaker(speaker if speaker is not None else message.get("speaker", 0), f"{where}.role")
            texts: list[str] = []
            for position, item in enumerate(items):
                item_where = f"{where}.content[{position}]"
                if item["type"] == "text":
                    texts.append(item.get("text", ""))
                    continue
                if len(texts) != 1:
                    raise ValueError(
                        f"{item_where}: a reference audio needs exactly one transcript text item before it; "
                        f"got {len(texts)}"
                    )
                item_speaker = check_speaker(item.get("speaker", default), f"{item_where}.speaker")
                references.append(Reference(texts.pop(), _audio_clip(item, item_where), item_speaker))
            if texts and role == "system":
                raise ValueError(f"{where}: system text must be reference transcripts, each followed by its audio")
            pending.extend((text, default, f"{where}.content") for text in texts)
        elif role == "assistant":
            audio = [item for item in items if item["type"] == "audio"]
            if len(audio) != 1 or len(items) != 1:
                raise ValueError(f"{where}: an assistant message holds exactly one audio item (the take)")
            if not pending:
                raise ValueError(f"{where}: a take must follow the lines it speaks")
            takes.append(Take(_pending_lines(pending), _audio_clip(audio[0], f"{where}.content[0]")))
            pending = []
        else:
            raise ValueError(f"{where}.role: 'system', 'user', 'assistant' or a speaker 0-15; got {role!r}")
    if pending:
        return Script(lines=_pending_lines(pending), references=tuple(references), history=tuple(takes))
    if takes:
        *history, last = takes
        return Script(lines=last.lines, references=tuple(references), history=tuple(history), target=last.audio)
    raise ValueError(f"{location}: nothing to speak (no text lines)")


def _pending_lines(pending: list[tuple[str, int, str]]) -> str | tuple:
    """The lines of the text items since the last take: one item is raw text, spoken as given
    (tagged with its message's speaker when no tag leads it); several are read as lines."""
    if len(pending) == 1:
        text, speaker, where = pending[0]
        parse_text(text, where, default_speaker=speaker)
        return with_speaker_tag(text, speaker)
    return tuple(line for text, speaker, where in pending for line in parse_text(text, where, default_speaker=speaker))

