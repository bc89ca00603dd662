"""A seeded request workload for engine-level load tests (integration/vllm/test_vllm_pd_load.py,
integration/soak/test_soak.py): prompts of random lengths sharing a few prefixes, arrivals spread
over the first steps, random output lengths, and multi-turn reuse (a finished request may come
back as its prompt + its output + new tokens). Everything but the step a follow-up arrives at is
fixed by the seed; follow-ups arrive a seeded number of steps after their first turn finished.

A workload can be cut in parts that share the prefixes (`first`: the index of its first request)
and can bring back conversations of an earlier run (`returning`: their histories, e.g. across an
engine restart)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from helpers import vllm_harness as vh


@dataclass
class Workload:
    seed: int
    requests: int
    spread_steps: int = 30  # arrivals of first turns fall in [0, spread_steps)
    max_prompt: int = 420
    max_tokens: int = 60
    followup_p: float = 0.5
    block_size: int = 32
    prefixes: list[list[int]] = field(default_factory=list)
    first: int = 0  # index of the first request (parts of one workload: disjoint ids)
    # Conversations of an earlier run (request id -> prompt + output) that come back, each as
    # one follow-up turn arriving in [0, spread_steps).
    returning: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.prefixes = [
            vh.prompt_tokens(self.seed * 100 + i, rng.randrange(32, 161)) for i in range(4)
        ]
        self._arrivals: list[tuple[int, str, list[int], int]] = []
        for i in range(self.first, self.first + self.requests):
            prefix = rng.choice(self.prefixes)
            length = min(len(prefix) + rng.randrange(1, 200), self.max_prompt)
            prompt = vh.prompt_tokens(self.seed * 10_000 + i, length, prefix)
            at = rng.randrange(0, self.spread_steps)
            tokens = rng.randrange(1, self.max_tokens)
            self._arrivals.append((at, f"s{self.seed}-R{i}", prompt, tokens))
        for rid, history in sorted(self.returning.items()):
            turn = random.Random(f"{self.seed}/back/{rid}")
            at, prompt, tokens = self._followup(turn, history, 0, self.spread_steps)
            # "-T": a returning turn does not come back again (drive's rule for follow-ups).
            self._arrivals.append((at, rid.replace("-R", "-TB"), prompt, tokens))
        self._arrivals.sort(key=lambda a: (a[0], a[1]))

    def _followup(
        self, rng: random.Random, history: list[int], step: int, spread: int
    ) -> tuple[int, list[int], int]:
        """(arrival step in [step, step + spread), prompt, max tokens) of the next turn of a
        conversation: its history (cut to leave room) and a few new tokens."""
        keep = history[: self.max_prompt - 64]
        prompt = vh.prompt_tokens(rng.randrange(10**6), len(keep) + rng.randrange(1, 64), keep)
        return step + rng.randrange(0, spread), prompt, rng.randrange(1, 40)


@dataclass
class RunStats:
    steps: int = 0  # engine steps while requests were waiting or running
    busy_steps: int = 0  # those that scheduled tokens (the others wait on transfers or arrivals)
    longest_idle_s: float = 0.0  # longest run of steps that scheduled nothing, wall seconds
    requests: int = 0
    preemptions: int = 0
    followups: int = 0
    chunks: int = 0  # prefill chunks that left part of their prompt for later steps
    seconds: float = 0.0
    connector: dict[str, float] = field(default_factory=dict)  # kv_connector_stats, summed
    invalid_blocks: int = 0  # blocks the workers reported they could not load
    # First turns' prompt + output (histories=True): conversations that may come back later.
    histories: dict[str, list[int]] = field(default_factory=dict)


def drive(
    e: vh.Engine,
    w: Workload,
    max_steps: int,
    *,
    rid_prefix: str = "",
    max_idle_s: float | None = None,
    max_busy_steps: int | None = None,
    histories: bool = False,
    keep_records: bool = True,
) -> RunStats:
    """Add `w`'s requests at their steps and step until every one (follow-ups included) has
    finished; AssertionError past `max_steps` (or `max_busy_steps` that scheduled tokens), or
    after `max_idle_s` seconds of steps that scheduled nothing (a stall: requests wait on
    transfers that do not finish), naming what is left. The connector's stores may still be in
    flight afterwards (`Engine.run` drains them).
    `keep_records` False: the engine's per-step records (`history`, `stats`) are dropped once
    counted here, so a long run's memory is the engine's own (a soak measures it)."""
    pending = list(w._arrivals)
    reqs: dict[str, Any] = {}
    came_back: set[str] = set()
    stats = RunStats()
    t0 = time.monotonic()
    idle_since: float | None = None
    step = 0

    def left() -> dict[str, Any]:
        return {
            rid: (str(r.status), r.num_computed_tokens, r.num_tokens, r.num_preemptions)
            for rid, r in e.scheduler.requests.items()
        }

    while True:
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens = pending.pop(0)
            rid = rid_prefix + rid
            reqs[rid] = e.add(
                vh.make_request(rid, prompt, max_tokens=max_tokens, block_size=w.block_size)
            )
            stats.requests += 1
        if not pending and not e.scheduler.requests:
            break
        over_busy = max_busy_steps is not None and stats.busy_steps >= max_busy_steps
        if step >= max_steps or over_busy:
            raise AssertionError(
                f"requests not finished after {step} steps ({stats.busy_steps} scheduled "
                f"tokens): {left()}"
            )
        rec = e.step()
        step += 1
        now = time.monotonic()
        if rec.scheduled:
            stats.busy_steps += 1
            idle_since = None
        else:
            idle_since = now if idle_since is None else idle_since
            stats.longest_idle_s = max(stats.longest_idle_s, now - idle_since)
            if max_idle_s is not None and now - idle_since > max_idle_s:
                raise AssertionError(
                    f"nothing scheduled for {now - idle_since:.1f} s (step {step}, "
                    f"{len(pending)} requests not yet added): {left()}"
                )
        stats.invalid_blocks += len(rec.invalid_block_ids)
        for rid in rec.scheduled:
            r = reqs.get(rid)
            # Scheduled (its computed tokens already advanced) and its prompt still not done.
            if (
                r is not None
                and not r.is_finished()
                and r.num_computed_tokens < r.num_prompt_tokens
            ):
                stats.chunks += 1
        for s in e.stats:
            for k, v in s.items():
                if isinstance(v, (int, float)):
                    stats.connector[k] = stats.connector.get(k, 0) + v
        e.stats.clear()
        if not keep_records:
            e.history.clear()
        for rid, r in list(reqs.items()):
            if not r.is_finished():
                continue
            # Finished: counted and let go (a long run keeps no request it is done with).
            del reqs[rid]
            stats.preemptions += r.num_preemptions
            if rid in came_back or "-T" in rid:
                continue
            came_back.add(rid)
            history = list(r.prompt_token_ids) + e.outputs[rid]
            if histories:
                stats.histories[rid] = history
            rng = random.Random(f"{w.seed}/{rid}")
            if rng.random() >= w.followup_p:
                continue
            at, prompt, tokens = w._followup(rng, history, step, 20)
            base = rid[len(rid_prefix) :]
            pending.append((at, base.replace("-R", "-TR"), prompt, tokens))
            pending.sort(key=lambda a: (a[0], a[1]))
            stats.followups += 1
        if not rec.scheduled:
            time.sleep(0.0005)  # an idle step yields the CPU to the transfer threads
    stats.steps = step
    stats.seconds = time.monotonic() - t0
    return stats
