"""The ingress's routes that do no work: GET /health, the model list and card, and the playground page."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deployments.ingress.http import route_path
from schemas import InvalidRequest
from schemas.openai import ModelCard, ModelList

PLAYGROUND = Path(__file__).with_name("static") / "playground.html"


class InfoRoutes:
    def __init__(self, model_name: str, max_model_len: int):
        self.model_name, self.max_model_len = model_name, max_model_len
        self.page = PLAYGROUND.read_bytes()

    async def health(self, request: Request, request_id: str) -> Response:
        return JSONResponse({"status": "ok"})

    async def playground(self, request: Request, request_id: str) -> Response:
        """GET /: the one-file web playground (static/playground.html here); it loads nothing from elsewhere."""
        return Response(
            self.page,
            media_type="text/html; charset=utf-8",
            headers={
                "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; "
                "script-src 'unsafe-inline'; style-src 'unsafe-inline'",
                "Cache-Control": "no-cache",
            },
        )

    async def models(self, request: Request, request_id: str) -> Response:
        card = ModelCard(id=self.model_name, max_model_len=self.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    async def model(self, request: Request, request_id: str) -> Response:
        """GET /v1/models/{id} (the openai client's models.retrieve): the served model's card, else a 404."""
        if (model_id := route_path(request).removeprefix("/v1/models/")) != self.model_name:
            raise InvalidRequest(
                f"The model {model_id!r} does not exist", param="model", code="model_not_found", status=404
            )
        return JSONResponse(ModelCard(id=model_id, max_model_len=self.max_model_len).model_dump())


__all__ = ["PLAYGROUND", "InfoRoutes"]
