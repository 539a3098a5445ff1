"""Whether the server is up: `GET /health` (a load balancer's probe, open without the key),
`GET /metrics` (Prometheus text) and `GET /v1/test` (Kokoro-FastAPI's probe). `app.create_app`
includes `router`; the service comes from the app (`speech_answer.service_or_503`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from .speech_answer import service_or_503

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    service = request.app.state.get_service()
    if service is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    return {"status": "ok", "model": service.model_name, "running": service.engine.running,
            "queued": service.engine.queue_depth}


@router.get("/metrics")
async def metrics(request: Request):
    service = request.app.state.get_service()
    if service is None:
        return PlainTextResponse("", status_code=503)
    return PlainTextResponse(service.metrics.render(service.engine), media_type="text/plain; version=0.0.4")


@router.get("/v1/test")
async def probe(request: Request):  # Kokoro-FastAPI's probe: bridges that find it (wyoming-openai) list /v1/audio/voices
    service_or_503(request)
    return {"status": "ok"}
