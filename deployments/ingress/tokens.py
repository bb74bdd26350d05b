"""POST /tokenize and /detokenize, vLLM's shapes: a prompt's or a conversation's token ids (exactly those the
completion routes generate from) and back to text. No LLM work."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deployments.ingress.fetch import MediaFetcher
from deployments.ingress.http import parse, read_json
from deployments.ingress.prepare import Preparer
from schemas.completions import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from schemas.openai import ChatCompletionRequest


class TokenRoutes:
    def __init__(self, prep: Preparer, fetcher: MediaFetcher, max_request_bytes: int):
        self.prep, self.fetcher, self.max_request_bytes = prep, fetcher, max_request_bytes

    async def tokenize(self, request: Request, request_id: str) -> Response:
        """`prompt`: its ids as /v1/completions makes them. `messages`: the ids /v1/chat/completions would generate
        from (images and videos checked and expanded to their placeholder runs), whether or not they fit the
        context: `count` against `max_model_len` says."""
        req = parse(TokenizeRequest, await read_json(request, self.max_request_bytes))
        self.prep.check_model(req.model)
        if req.prompt is not None:
            tokens = await asyncio.to_thread(self.prep.encode, req.prompt, req.add_special_tokens is not False)
        else:
            chat = ChatCompletionRequest(
                model=req.model,
                messages=req.messages,
                tools=req.tools or [],
                mm_processor_kwargs=req.mm_processor_kwargs,
            )
            self.prep.check(chat)
            fetched = await self.fetcher.fetch_request(chat)
            generation_prompt = req.add_generation_prompt is not False
            tokens = await asyncio.to_thread(self.prep.tokenize_chat, chat, fetched, generation_prompt)
        body = TokenizeResponse(count=len(tokens), max_model_len=self.prep.max_model_len, tokens=tokens)
        return JSONResponse(body.model_dump())

    async def detokenize(self, request: Request, request_id: str) -> Response:
        """The ids' text, special tokens included (as vLLM's /detokenize)."""
        req = parse(DetokenizeRequest, await read_json(request, self.max_request_bytes))
        self.prep.check_model(req.model)
        self.prep.check_ids(req.tokens, "tokens")
        text = await asyncio.to_thread(self.prep.tokenizer.decode, req.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


__all__ = ["TokenRoutes"]
