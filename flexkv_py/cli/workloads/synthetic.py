"""Synthetic KV-reuse workload: multi-turn chats over a shared system prompt, many of them about
one of a few long shared documents chosen with Zipf skew.

Each user's turn t sends: system prompt + (its document) + every earlier turn's message and answer
+ a new message. So a turn reuses the previous turn's prompt (chat history), users share the
system prompt, and users reading the same document share it too. Turns of different users are
interleaved at random, which spreads reuse distances: some reuse hits the GPU prefix cache, older
reuse has to come back from host memory or SSD.

With `tenants > 1`, users belong to tenants that salt their cache keys (vLLM's `cache_salt`):
equal content under different keys, which the SSD tier stores once (content dedup).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from flexkv_py.cli.workloads.base import Request, Workload, chain_hashes
from flexkv_py.errors import ConfigError

VOCAB = 32000


@dataclass(frozen=True)
class SyntheticSpec:
    users: int = 24
    turns: int = 6
    prefix_tokens: int = 1024  # shared system prompt
    docs: int = 6
    doc_tokens: int = 4096
    doc_fraction: float = 0.75  # share of users whose chat is about a document
    zipf: float = 1.2  # document popularity skew (0 = uniform)
    message_tokens: int = 96
    output_tokens: int = 192
    tenants: int = 1
    block_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("users", "turns", "block_tokens", "tenants"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("prefix_tokens", "docs", "doc_tokens", "message_tokens", "output_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.doc_fraction <= 1.0:
            raise ConfigError(f"doc_fraction: must be in [0, 1], got {self.doc_fraction}")
        if self.zipf < 0:
            raise ConfigError(f"zipf: must be >= 0, got {self.zipf}")


def zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, n, dtype=np.int32)


def _block_parts(tokens: np.ndarray, block_tokens: int) -> list[bytes]:
    full = len(tokens) // block_tokens  # only full blocks are cached
    return [tokens[i * block_tokens : (i + 1) * block_tokens].tobytes() for i in range(full)]


def generate_synthetic(spec: SyntheticSpec) -> Workload:
    rng = np.random.default_rng(spec.seed)
    system = _tokens(rng, spec.prefix_tokens)
    docs = [_tokens(rng, spec.doc_tokens) for _ in range(spec.docs)]
    weights = zipf_weights(spec.docs, spec.zipf) if spec.docs else None

    # Per user: the token context every turn starts from, and its tenant salt.
    contexts: list[np.ndarray] = []
    salts: list[bytes] = []
    for user in range(spec.users):
        ctx = system
        if docs and rng.random() < spec.doc_fraction:
            ctx = np.concatenate([ctx, docs[int(rng.choice(spec.docs, p=weights))]])
        contexts.append(ctx)
        salts.append(b"tenant-%d" % (user % spec.tenants))

    remaining = [spec.turns] * spec.users
    requests: list[Request] = []
    while any(remaining):
        active = [u for u, left in enumerate(remaining) if left]
        user = int(rng.choice(active))
        remaining[user] -= 1
        prompt = np.concatenate([contexts[user], _tokens(rng, spec.message_tokens)])
        parts = _block_parts(prompt, spec.block_tokens)
        content = chain_hashes(parts)
        keys = content if spec.tenants == 1 else chain_hashes(parts, seed=salts[user])
        requests.append(
            Request(
                arrival=float(len(requests)),
                keys=tuple(keys),
                contents=tuple(content),
                prompt_tokens=len(prompt),
                output_tokens=spec.output_tokens,
            )
        )
        # The answer joins the history the next turn sends.
        contexts[user] = np.concatenate([prompt, _tokens(rng, spec.output_tokens)])
    return Workload("synthetic", spec.block_tokens, requests, params=asdict(spec))
