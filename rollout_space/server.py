"""The rollout Space's HTTP app: OpenAI-compatible generation plus weight-sync control.

Generation goes through vLLM's own OpenAI serving classes (so token ids, logprobs, ``n``,
streaming and the real ``openai`` client behave as with ``vllm serve``); each response gains
``policy_version`` (and an ``X-Policy-Version`` header), taken from the weight-version spans the
engine reports for the tokens it generated. Control endpoints: ``POST /update`` (bearer token),
``GET /version``, ``GET /weights/digest``, ``GET /health``, ``GET /metrics``, the write-through
probe (``POST /probe`` with the bearer token runs it, ``GET /probe`` shows the last report) and
vLLM-style ``/pause`` ``/resume`` ``/is_paused``.

Closed by default: everything that changes or pauses the replica (``/update``, ``/pause``,
``/resume``, ``/probe``) and a forced digest (``/weights/digest?fresh=true``) need the bearer token (compared
in constant time, never logged); ``--api-key`` guards ``/v1/*`` as in ``vllm serve``; bodies over
``--max-body-bytes`` get 413. None of vLLM's dev-mode routes (``/collective_rpc``, ``/sleep``, ...)
exist here, whatever ``VLLM_SERVER_DEV_MODE`` says: this app is not built by vLLM's ``build_app``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from argparse import Namespace
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from shared.access import bearer_ok
from shared.asgi import BodySizeLimit
from shared.schemas import (
    DigestResponse,
    HealthResponse,
    PauseMode,
    UpdateRequest,
    UpdateResponse,
    VersionResponse,
)

from .engine import SPANS, Damaged, ProbeBusy, RolloutEngine, UpdateRefused, label_of, version_of

log = logging.getLogger("rollout_space.server")

REFUSAL_STATUS = {"wrong_base": 409, "out_of_order": 409, "missing": 404, "busy": 409, "internal": 500,
                  "write_through": 503}
POLL_RETRY_MAX_S = 60.0  # the longest a poller waits before trying a refused version again
PROBE_SUMMARY = ("outcome", "why", "version", "covered", "checked", "failed", "seconds", "message")


def policy_fields(spans: dict[int, list[tuple[str, int, int]]], fallback: str) -> dict:
    """``policy_version`` for a response whose choices (by index) produced these spans. Spans are
    listed in choice-index order; in a stream, a chunk lists the choices finished so far, and the
    last one to finish lists them all."""
    choices = [spans[i] for i in sorted(spans)]
    labels: list[str] = []
    for choice in choices:
        for label, _, _ in choice:
            if label not in labels:
                labels.append(label)
    if not labels:
        labels = [fallback]
    versions = [version_of(lb) for lb in labels]
    if len(versions) == 1:
        return {"policy_version": versions[0]}
    return {"policy_version": None, "policy_versions": versions,
            "policy_version_spans": [[{"version": version_of(lb), "start": s, "end": e}
                                      for lb, s, e in choice] for choice in choices]}


def policy_headers(fields: dict) -> dict[str, str]:
    """``X-Policy-Version: 4``, or for tokens from several versions ``X-Policy-Versions: 4,5``, so a
    client reading ``X-Policy-Version`` as one version number is never handed a list."""
    if "policy_versions" in fields:
        return {"X-Policy-Versions": ",".join(str(v) for v in fields["policy_versions"])}
    return {"X-Policy-Version": str(fields["policy_version"])}  # "None": weights of no chain version


def create_app(args: Namespace) -> FastAPI:
    replica = RolloutEngine(args)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state

        await replica.start()
        tasks = await replica.engine.get_supported_tasks()
        await init_app_state(replica.engine, app.state, args, tasks)
        poller = asyncio.create_task(_poll(replica, args.poll_s)) if args.poll_s > 0 else None
        try:
            yield
        finally:
            if poller:
                poller.cancel()
            await replica.stop()

    app = FastAPI(title="DeltaSync rollout", lifespan=lifespan)
    app.state.replica = replica
    # --api-key (or VLLM_API_KEY) guards /v1/* exactly as in `vllm serve`, with vLLM's own middleware.
    if api_keys := [k for k in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if k]:
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        app.add_middleware(AuthenticationMiddleware, tokens=api_keys)
    # Outermost: an oversize body is refused before anything reads it.
    app.add_middleware(BodySizeLimit, max_bytes=args.max_body_bytes)
    token = args.token

    def authorized(request: Request) -> None:
        if not bearer_ok(request.headers.get("authorization"), token):
            client = request.client.host if request.client else "?"
            log.warning("refused %s %s from %s: missing or wrong bearer token", request.method,
                        request.url.path, client)  # never the header itself
            raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    Auth = Depends(authorized)

    async def json_body(request: Request) -> None:
        """A body in any other media type is refused (415), as ``vllm serve`` does, rather than read
        as JSON whatever its Content-Type says; an empty ``/update`` body still means "the latest"."""
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json" and (media or await request.body()):
            raise HTTPException(status_code=415, detail=f"Content-Type must be application/json, not {media!r}")

    JSONBody = Depends(json_body)

    # ------------------------------------------------------------------ generation
    async def generate(raw_request: Request, kind: str):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
        from vllm.exceptions import VLLMError

        def refused() -> JSONResponse:
            why = replica.state.damage or "replica holds weights of no version"
            return JSONResponse({"error": {"message": f"replica damaged: {why}", "code": 503}}, status_code=503)

        await replica.wait_open()  # a write-through probe in progress may end in damage
        if replica.state.status == "damaged":
            return refused()
        spans: dict = {}
        SPANS.set(spans)
        fallback = label_of(replica.state.version)
        state = raw_request.app.state
        try:
            body = await raw_request.json()
            if kind == "completion":
                request = CompletionRequest.model_validate(body)
                result = await state.openai_serving_completion.create_completion(request, raw_request)
            else:
                request = ChatCompletionRequest.model_validate(body)
                result = await state.openai_serving_chat.create_chat_completion(request, raw_request)
        except Damaged:  # passed the check above just before a probe closed the gate
            return refused()
        except (VLLMError, ValueError, TypeError, OverflowError) as e:
            # What vllm serve's exception handlers answer (400 for a bad request, with vLLM's
            # message), scoped to generation so our own routes keep their error bodies.
            result = create_error_response(e)
        if isinstance(result, ErrorResponse):
            return JSONResponse(result.model_dump(), status_code=result.error.code)
        if not hasattr(result, "__aiter__"):
            fields = policy_fields(spans, fallback)
            return JSONResponse(result.model_dump() | fields, headers=policy_headers(fields))
        return StreamingResponse(_annotate_stream(result, spans, fallback), media_type="text/event-stream",
                                 headers=policy_headers(policy_fields({}, fallback)))

    @app.post("/v1/completions", dependencies=[JSONBody])
    async def completions(raw_request: Request):
        return await generate(raw_request, "completion")

    @app.post("/v1/chat/completions", dependencies=[JSONBody])
    async def chat_completions(raw_request: Request):
        return await generate(raw_request, "chat")

    @app.get("/v1/models")
    async def models(raw_request: Request):
        listing = await raw_request.app.state.openai_serving_models.show_available_models()
        return JSONResponse(listing.model_dump())

    @app.get("/server_info")
    async def server_info(raw_request: Request, config_format: Annotated[str, Query()] = "text"):
        """vLLM's resolved config, as ``vllm serve`` reports it (trl reads ``model_config.dtype``,
        ``lora_config`` and ``parallel_config``); vLLM's environment and host details are left out."""
        import pydantic
        from vllm.config import VllmConfig

        config = replica.engine.vllm_config
        dumped = str(config) if config_format == "text" else \
            pydantic.TypeAdapter(VllmConfig).dump_python(config, mode="json", fallback=str)
        return JSONResponse({"vllm_config": dumped})

    @app.get("/get_world_size")
    async def get_world_size():
        parallel = replica.engine.vllm_config.parallel_config
        return JSONResponse({"world_size": parallel.world_size_across_dp})

    # ------------------------------------------------------------------ weight sync
    @app.post("/update", dependencies=[Auth, JSONBody], response_model=UpdateResponse)
    async def update(raw_request: Request, wait: Annotated[bool, Query()] = True,
                     mode: Annotated[PauseMode | None, Query()] = None):
        raw = await raw_request.body()
        try:
            req = UpdateRequest.model_validate_json(raw) if raw.strip() else UpdateRequest()
        except ValidationError as e:
            return JSONResponse({"detail": str(e)}, status_code=422)
        mode = mode or req.mode
        if not wait:
            task = asyncio.create_task(_quiet(replica.update(req.version, mode)))
            raw_request.app.state.update_task = task
            s = replica.state
            return JSONResponse(UpdateResponse(version=s.version, commitment=s.commitment,
                                               state_digest=s.state_digest, state_fingerprint=s.state_fingerprint,
                                               target=req.version).model_dump(), status_code=202)
        try:
            resp = await replica.update(req.version, mode)
        except UpdateRefused as e:
            reason = e.response.refused.reason  # type: ignore[union-attr]
            return JSONResponse(e.response.model_dump(), status_code=REFUSAL_STATUS.get(reason, 422))
        return JSONResponse(resp.model_dump())

    @app.get("/version", response_model=VersionResponse)
    async def version():
        s, report = replica.state, replica.write_probe_report
        return JSONResponse(VersionResponse(
            version=s.version, commitment=s.commitment, state_digest=s.state_digest,
            state_fingerprint=s.state_fingerprint, status=s.status,  # type: ignore[arg-type]
            model=args.model, store=args.store, latest_seen=s.latest_seen, damage=s.damage,
            write_probe={k: report[k] for k in PROBE_SUMMARY if k in report} if report else None).model_dump())

    @app.get("/probe")
    async def last_probe():
        """The last write-through probe's full report (per parameter: checkpoint tensors, elements,
        whether its write reached the output); 404 before any ran."""
        if replica.write_probe_report is None:
            return JSONResponse({"detail": "no write-through probe has run"}, status_code=404)
        return JSONResponse(replica.write_probe_report)

    @app.post("/probe", dependencies=[Auth])
    async def run_probe():
        """Run the write-through probe now, holding generation (new requests wait, running ones
        finish first). 200: passed; 503: failed (the replica is now damaged) or could not conclude;
        409: generation is paused or requests did not end."""
        try:
            report = await replica.write_probe("request")
        except ProbeBusy as e:
            return JSONResponse({"detail": str(e)}, status_code=409)
        return JSONResponse(report, status_code=200 if report["ok"] else 503)

    @app.get("/weights/digest", response_model=DigestResponse)
    async def weights_digest(request: Request, fresh: Annotated[bool, Query()] = False):
        """The state digest of the live engine weights. Computed once per state of the weights
        (version, commitment, writes) and cached; concurrent callers share one computation.
        ``fresh=true`` reads the weights again and needs the bearer token."""
        if fresh:
            authorized(request)
        d, cached = await replica.live_digest(fresh=fresh)
        return DigestResponse(version=d["version"], commitment=d["commitment"], state_digest=d["state_digest"],
                              state_fingerprint=d["state_fingerprint"], matches_held=not d["mismatched"],
                              mismatched=d["mismatched"], seconds=d["digest_s"], cached=cached)

    @app.get("/health")
    async def health():
        s = replica.state
        status = "ok" if s.status in ("ready", "updating") else s.status
        try:
            await replica.engine.check_health()
        except Exception:  # noqa: BLE001
            status = "dead"
        code = 200 if status == "ok" else 503
        return JSONResponse(HealthResponse(status=status, version=s.version).model_dump(),  # type: ignore[arg-type]
                            status_code=code)

    @app.get("/metrics")
    async def metrics_endpoint():
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ vLLM-style pause
    @app.post("/pause", dependencies=[Auth])
    async def pause(mode: Annotated[PauseMode, Query()] = "abort",
                    clear_cache: Annotated[bool, Query()] = True):
        await replica.pause(mode, clear_cache)
        return JSONResponse({"status": "paused"})

    @app.post("/resume", dependencies=[Auth])
    async def resume():
        await replica.resume()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused():
        return JSONResponse({"is_paused": await replica.engine.is_paused()})

    return app


async def _annotate_stream(chunks, spans: dict, fallback: str):
    """Pass SSE chunks through; the ones that finish a choice gain ``policy_version``."""
    async for chunk in chunks:
        if chunk.startswith("data: {") and '"finish_reason":null' not in chunk.replace(" ", ""):
            try:
                payload = json.loads(chunk[len("data: "):])
                if any(c.get("finish_reason") is not None for c in payload.get("choices", [])):
                    payload |= policy_fields(spans, fallback)
                    chunk = f"data: {json.dumps(payload)}\n\n"
            except ValueError:
                pass
        yield chunk


async def _quiet(coro) -> None:
    try:
        await coro
    except UpdateRefused:
        pass  # already counted and logged


async def _poll(replica: RolloutEngine, every_s: float) -> None:
    """Catch up on versions whose notification never arrived (a replica that was down, a lost
    POST): reading ``latest.json`` is cheap. A refused target is tried again after a backoff that
    doubles up to ``POLL_RETRY_MAX_S``: the store may have been unreachable for a while, or a
    damaged object re-uploaded; a newer version is tried at once."""
    refused, retry_in, retry_at = None, every_s, 0.0
    while True:
        await asyncio.sleep(every_s)
        try:
            latest = await asyncio.to_thread(replica.chain.latest)
            if latest is None:
                continue
            replica.state.latest_seen = latest.version
            held = replica.state.version
            behind = held is None or latest.version > held
            if not behind or replica._lock.locked() or (latest.version == refused and time.monotonic() < retry_at):
                continue
            log.info("store has v%d, replica v%s: catching up", latest.version, held)
            try:
                await replica.update(latest.version)
                refused, retry_in = None, every_s
            except UpdateRefused:  # already counted and logged
                retry_in = retry_in if latest.version == refused else every_s
                refused, retry_at = latest.version, time.monotonic() + retry_in
                retry_in = min(2 * retry_in, POLL_RETRY_MAX_S)
        except Exception:  # noqa: BLE001
            log.exception("polling the store failed")
