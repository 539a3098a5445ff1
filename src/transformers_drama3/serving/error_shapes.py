"""The shape of an error body, by route: OpenAI's `{"error": {"message", "type", "param", "code"}}`
everywhere but on Fish Audio's routes (`serving.fish_protocol`), whose clients read
`{"status": int, "message": str}` (fish-audio-sdk maps the status to its typed exceptions; its
legacy client builds its exception from exactly these two keys, so no other key may come along)."""

from __future__ import annotations

FISH_PATHS = ("/v1/tts", "/v1/tts/live")
"""The routes of Fish Audio's API."""


def error_body(path: str | None, status: int, message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict:
    """The JSON body of an error answered on `path` (None: OpenAI's shape)."""
    if path in FISH_PATHS:
        return {"status": status, "message": message}
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
