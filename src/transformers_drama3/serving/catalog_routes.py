"""What the server speaks with: the model listings (`GET /v1/models`, `GET /v1/audio/models`) and
the stored voices (`GET` and `POST /v1/audio/voices`, `DELETE /v1/audio/voices/{id}`; a voice with
an "adapter" is a fine-tuned one, `adapter_routes`). `app.create_app` includes `router`; the
service and settings come from the app (`speech_answer.service_or_503`, `app.state.settings`).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request

from .openai_names import model_listing
from .protocol import ApiError, parse_voice_upload
from .speech_answer import json_body, service_or_503
from .voices import VoiceBusy, VoiceExists

logger = logging.getLogger(__name__)

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    service = service_or_503(request)
    return {"object": "list", "data": model_listing(service.model_name)}


@router.get("/v1/audio/models")
async def audio_models(request: Request):  # Open WebUI asks here first, then falls back to /v1/models
    service = service_or_503(request)
    return {"models": [{"id": model["id"]} for model in model_listing(service.model_name)]}


@router.get("/v1/audio/voices")
async def list_voices(request: Request):
    service = service_or_503(request)
    aliases = request.app.state.settings.voice_aliases
    return {"voices": await asyncio.to_thread(service.voice_listing), "aliases": aliases.listing()}


@router.post("/v1/audio/voices")
async def create_voice(request: Request):
    service, limits = service_or_503(request), request.app.state.settings.limits
    body = await json_body(request)
    if isinstance(body, dict) and "adapter" in body:  # a fine-tuned voice (serving.adapter_routes)
        from .adapter_routes import register_adapter_voice  # the adapter code loads only when it is used

        return await asyncio.to_thread(register_adapter_voice, service, body, limits)
    voice_id, name, references = parse_voice_upload(body, limits)
    if voice_id in service.voices:
        raise ApiError(409, f"id: a voice {voice_id!r} exists; delete it first", "id", "voice_exists")
    try:
        await asyncio.to_thread(service.voices.add, voice_id, references, name)
    except ValueError as error:
        param = str(error).split(":")[0] if ":" in str(error) else None
        raise ApiError(400, str(error), param) from None
    except VoiceExists as error:
        raise ApiError(409, str(error), "id", "voice_exists") from None
    except VoiceBusy as error:
        raise ApiError(409, str(error), "id", "voice_busy") from None
    except OSError as error:
        logger.error("storing voice %r failed: %s", voice_id, error)
        raise ApiError(500, f"the voice {voice_id!r} could not be stored ({error.strerror or type(error).__name__}); "
                            "nothing was changed", None, "voice_write_failed") from None
    return {"id": voice_id, "name": name}


@router.delete("/v1/audio/voices/{voice_id}")
async def delete_voice(voice_id: str, request: Request):
    service = service_or_503(request)
    if service.adapter_of(voice_id) is not None:
        from .adapter_routes import delete_adapter_voice

        return await asyncio.to_thread(delete_adapter_voice, service, voice_id)
    try:
        await asyncio.to_thread(service.voices.delete, voice_id)
    except KeyError:
        raise ApiError(404, f"voice: no voice {voice_id!r}", "voice", "voice_not_found") from None
    except VoiceBusy as error:
        raise ApiError(409, str(error), "voice", "voice_busy") from None
    return {"id": voice_id, "deleted": True}
