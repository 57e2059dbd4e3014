"""The soak's clients: streaming completions of a mixed workload, some dropped mid-stream.

Kinds: ``system`` (one of a few shared system prompts with a short question),
``document`` (one of a few long documents asked about again), ``oneoff`` (a
random prompt), ``burst`` (a fault: many long one-offs at once). Each request
asks for one of several ``max_tokens``; a share of streams is closed by the client
after a few chunks. Every request's outcome is a :class:`Outcome`; completed ones
carry their token ids (``return_tokens_as_token_ids``) for the reference check.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvoffload_hal.demo.tiny_model import synthetic_text

MAX_TOKENS = (1, 4, 16, 48)
SYSTEMS = [synthetic_text(110, seed=9000 + i) for i in range(3)]
DOCUMENTS = [synthetic_text(360, seed=9100 + i) for i in range(6)]
KINDS = (("system", 0.35), ("document", 0.35), ("oneoff", 0.3))
DROP_SHARE = 0.12


@dataclass
class Outcome:
    kind: str
    prompt: str
    max_tokens: int
    started: float
    ended: float = 0.0
    status: str = "running"  # ok, dropped, error, late
    error: str = ""
    tokens: list[int] = field(default_factory=list)


def prompt_for(kind: str, rng: random.Random) -> str:
    question = synthetic_text(rng.randint(8, 24), seed=rng.randrange(1 << 30))
    if kind == "system":
        return f"{rng.choice(SYSTEMS)} {question}"
    if kind == "document":
        return f"{rng.choice(DOCUMENTS)} {question}"
    return synthetic_text(rng.randint(60, 380), seed=rng.randrange(1 << 30))


def token_ids(chunk) -> list[int]:
    logprobs = chunk.choices[0].logprobs
    tokens = logprobs.tokens if logprobs is not None else None
    return [int(t.split(":", 1)[1]) for t in tokens or ()]


async def stream(client, model: str, out: Outcome, drop_after: int | None,
                 deadline_s: float) -> Outcome:
    """One streamed request; ``drop_after``: chunks read before the client closes it."""
    try:
        async with asyncio.timeout(deadline_s):
            chunks = await client.completions.create(
                model=model, prompt=out.prompt, max_tokens=out.max_tokens, temperature=0.0,
                stream=True, logprobs=1,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            async for chunk in chunks:
                if chunk.choices:
                    out.tokens.extend(token_ids(chunk))
                if drop_after is not None and len(out.tokens) >= drop_after:
                    await chunks.close()
                    out.status = "dropped"
                    break
        if out.status == "running":
            done = len(out.tokens) == out.max_tokens
            out.status = "ok" if done else "error"
            out.error = "" if done else f"{len(out.tokens)} of {out.max_tokens} tokens"
    except TimeoutError:
        out.status, out.error = "late", f"no end within {deadline_s:g} s"
    except Exception as e:  # noqa: BLE001 - every failure is a finding, kept with its text
        out.status, out.error = "error", f"{type(e).__name__}: {e}"[:300]
    out.ended = time.monotonic()
    return out


async def client_loop(client, model: str, rng: random.Random, stop_at: float,
                      outcomes: list[Outcome], deadline_s: float,
                      until: Callable[[], bool] | None = None,
                      go: asyncio.Event | None = None) -> None:
    """Requests one after another until ``stop_at`` (monotonic) or ``until()``; each
    waits while ``go`` is clear (a fault that needs the disk tier to itself)."""
    while time.monotonic() < stop_at and not (until is not None and until()):
        if go is not None:
            await go.wait()
        kind = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
        out = Outcome(kind, prompt_for(kind, rng), rng.choice(MAX_TOKENS), time.monotonic())
        outcomes.append(out)
        drop = rng.randint(1, 3) if rng.random() < DROP_SHARE and out.max_tokens > 4 else None
        await stream(client, model, out, drop, deadline_s)


async def burst(client, model: str, rng: random.Random, n: int, outcomes: list[Outcome],
                deadline_s: float) -> None:
    """``n`` long one-offs at once: more blocks than the device and CPU tier hold."""
    batch = [Outcome("burst", synthetic_text(380, seed=rng.randrange(1 << 30)), 16,
                     time.monotonic()) for _ in range(n)]
    outcomes.extend(batch)
    await asyncio.gather(*(stream(client, model, o, None, deadline_s) for o in batch))


@dataclass
class FaultOps:
    """What a fault asks of the clients: a burst, or one prompt of its own."""

    client: object
    model: str
    rng: random.Random
    outcomes: list[Outcome]
    deadline_s: float
    clients_go: asyncio.Event = field(default_factory=asyncio.Event)  # set: clients run

    def new_prompt(self) -> str:
        return synthetic_text(380, seed=self.rng.randrange(1 << 30))

    async def ask(self, prompt: str, max_tokens: int = 16) -> Outcome:
        out = Outcome("fault-probe", prompt, max_tokens, time.monotonic())
        self.outcomes.append(out)
        return await stream(self.client, self.model, out, None, self.deadline_s)

    async def burst(self, n: int) -> None:
        await burst(self.client, self.model, self.rng, n, self.outcomes, self.deadline_s)
