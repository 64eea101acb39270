"""Bounded concurrent load on loopback: 64 WebSocket games and 64 HTTP games at once, zero errors."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
from wordle_helpers import answer_for, wrong_guesses

from env_space.client import WordleEnv, WordleHTTPEnv
from env_space.models import WordleAction

GAMES_PER_TRANSPORT = 64
DEADLINE_S = 90.0


async def _play(cls, base_url: str, seed: int, latencies: list[float]) -> tuple[bool, float]:
    """One full game: ``seed % 7`` wrong guesses, then the answer if a turn is left."""
    target = answer_for(seed)
    moves = wrong_guesses(target, seed % 7)[:6] + [target]
    async with cls(base_url=base_url) as env:
        t0 = time.perf_counter()
        result = await env.reset(seed=seed)
        latencies.append(time.perf_counter() - t0)
        for word in moves:
            if result.done:
                break
            t0 = time.perf_counter()
            result = await env.step(WordleAction(message=f"[{word}]"))
            latencies.append(time.perf_counter() - t0)
        state = await env.state()
    assert result.done and state.raw_state["secret_word"] == target
    return state.raw_state["won"], result.reward


async def _load(base_url: str) -> tuple[list, list[float]]:
    latencies: list[float] = []
    games = [
        _play(cls, base_url, seed, latencies)
        for cls in (WordleEnv, WordleHTTPEnv)
        for seed in range(1000, 1000 + GAMES_PER_TRANSPORT)
    ]
    results = await asyncio.wait_for(asyncio.gather(*games, return_exceptions=True), DEADLINE_S)
    return results, latencies


def _active(base_url: str) -> int:
    return httpx.get(f"{base_url}/sessions", timeout=10).json()["active_sessions"]


def test_128_concurrent_games(server) -> None:
    before = _active(server.base_url)
    start = time.perf_counter()
    results, latencies = asyncio.run(_load(server.base_url))
    elapsed = time.perf_counter() - start

    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == [], f"{len(errors)} games failed, first: {errors[:1]!r}"
    wins = sum(won for won, _ in results)
    # seed % 7 == 6 means six wrong guesses: those games are lost, all others won.
    assert wins == sum(1 for s in range(1000, 1000 + GAMES_PER_TRANSPORT) if s % 7 != 6) * 2

    latencies.sort()
    p50 = statistics.median(latencies)
    p95 = latencies[int(0.95 * (len(latencies) - 1))]
    print(
        f"\nload: {len(results)} games ({GAMES_PER_TRANSPORT} ws + {GAMES_PER_TRANSPORT} http) at once, "
        f"{len(latencies)} requests in {elapsed:.2f}s, 0 errors, "
        f"latency p50 {p50 * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
    )
    # Latency is reported, not asserted: speed belongs in benchmarks, not in pass/fail.
    # Every session was released when its client closed.
    deadline = time.monotonic() + 10
    while _active(server.base_url) != before:
        assert time.monotonic() < deadline, "sessions leaked after the load test"
        time.sleep(0.1)
    server.assert_alive()
