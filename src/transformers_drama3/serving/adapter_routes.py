"""The HTTP side of fine-tuned voices: `POST /v1/audio/voices` with an "adapter", and its `DELETE`.

    POST /v1/audio/voices  {"id": "me", "adapter": {"path": "me/adapter"}}
                           {"id": "me", "adapter": {"adapter_config.json": {...},
                                                    "adapter_model.safetensors": "<base64>"},
                            "references": [{"audio": "<base64>", "text": "..."}]}   (optional clips)

A server path is read only under the folder the operator allowed (`drama3 serve --adapter-root`);
an upload is checked in a temporary folder before it is stored. Either way the adapter is checked
against the served model first and refused (400, naming what differs) without changing anything.
"""

from __future__ import annotations

from .adapter_layers import AdapterError, AdapterOutsideRoot
from .adapters import MAX_PATH_CHARS, AdapterExists, decode_upload
from .protocol import ApiError, parse_references
from .voices import VoiceBusy, VoiceExists


def register_adapter_voice(service, body: dict, limits) -> dict:
    """Register the adapter (and its optional reference clips) a checked JSON body describes."""
    registry = service.adapters
    if registry is None:
        raise ApiError(400, "adapter: this server takes no adapters (start it with --adapter NAME=PATH or "
                            "--adapter-root DIR)", "adapter", "adapters_off")
    voice_id = body.get("id") or body.get("name")
    name = body.get("name") or voice_id
    if not isinstance(voice_id, str) or not isinstance(name, str):
        raise ApiError(400, "id: expected the voice id as a string", "id")
    if service.has_voice(voice_id):
        raise ApiError(409, f"id: a voice {voice_id!r} exists; delete it first", "id", "voice_exists")
    references = parse_references(body["references"], limits, None) if body.get("references") is not None else []
    adapter = body["adapter"]
    try:
        if isinstance(adapter, dict) and set(adapter) == {"path"}:
            path = adapter["path"]
            if not isinstance(path, str) or not path or "\0" in path or len(path) > MAX_PATH_CHARS:
                raise ApiError(400, f"adapter.path: expected a folder's path under the server's --adapter-root, a "
                                    f"string of 1 to {MAX_PATH_CHARS} characters without NUL", "adapter.path")
            registry.register_path(voice_id, adapter["path"])
        else:
            registry.register_upload(voice_id, decode_upload(adapter))
    except PermissionError as error:
        raise ApiError(403, str(error), "adapter.path" if "path" in str(error)[:5] else "adapter", "adapter_forbidden") from None
    except AdapterExists as error:
        raise ApiError(409, str(error), "id", "voice_exists") from None
    except AdapterOutsideRoot as error:
        raise ApiError(403, str(error), "adapter", "adapter_forbidden") from None
    except AdapterError as error:
        raise ApiError(400, str(error), "adapter", "adapter_refused") from None
    except ValueError as error:
        param = str(error).split(":")[0] if ":" in str(error) else "adapter"
        raise ApiError(400, str(error), "adapter.path" if param == "path" else param) from None
    except OSError as error:  # the disk failed while the adapter was stored: nothing was registered
        raise ApiError(500, f"adapter: the adapter {voice_id!r} could not be stored ({error.strerror or type(error).__name__}); "
                            "nothing was changed", None, "adapter_write_failed") from None
    if references:
        try:
            service.voices.add(voice_id, references, name)
        except (ValueError, VoiceExists, VoiceBusy, OSError) as error:
            registry.delete(voice_id)  # the clips were refused: the voice is not half there
            raise ApiError(400 if isinstance(error, ValueError) else 409, str(error), "references") from None
    return {"id": voice_id, "name": name, "adapter": True}


def delete_adapter_voice(service, voice_id: str) -> dict:
    """Forget an adapter voice (a request using it finishes first) and its reference clips; 404 when
    another delete of it came first."""
    try:
        service.adapters.delete(voice_id)
    except KeyError:
        raise ApiError(404, f"voice: no voice {voice_id!r}", "voice", "voice_not_found") from None
    try:
        if voice_id in service.voices:  # its reference clips, if it has any
            service.voices.delete(voice_id)
    except KeyError:
        pass
    except VoiceBusy as error:
        raise ApiError(409, f"{error} (its reference clips; the adapter is deleted)", "voice", "voice_busy") from None
    return {"id": voice_id, "deleted": True}
