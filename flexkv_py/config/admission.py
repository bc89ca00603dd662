"""The `admission` config value: when a block is copied from the host tier to the SSD tier.

Grammar (case-insensitive, parts joined by ``+`` or ``,``)::

    write_back                 copy to SSD only when the block is evicted from host (default)
    write_through              copy to SSD as soon as it is stored in host
    min_hits:N                 only blocks accessed at least N times (store + hits) reach SSD;
                               alone it means ``write_back+min_hits:N``
    write_through+min_hits:N   write-through for blocks already seen N times, the others are
                               still copied at eviction once they reach N

Frequencies survive a host eviction for a while (a bounded "ghost" table in the index), so a block
that keeps coming back reaches N even if it never stays resident long.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexkv_py.config.choices import AdmissionMode, values
from flexkv_py.errors import ConfigError

ADMISSION_MODES: tuple[AdmissionMode, ...] = values(AdmissionMode)  # type: ignore[assignment]


@dataclass(frozen=True)
class AdmissionSpec:
    mode: AdmissionMode = "write_back"
    min_hits: int = 1

    def __str__(self) -> str:
        if self.min_hits == 1:
            return self.mode
        return f"{self.mode}+min_hits:{self.min_hits}"


def parse_admission(text: str, *, key: str = "admission") -> AdmissionSpec:
    """Parse an admission string; errors name `key` and the offending part."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{key}: expected a non-empty string like 'write_back', got {text!r}")
    mode: AdmissionMode | None = None
    min_hits: int | None = None
    for raw in text.replace(",", "+").split("+"):
        part = raw.strip().lower().replace("-", "_")
        if part in ADMISSION_MODES:
            if mode is not None:
                raise ConfigError(f"{key}: more than one mode in {text!r}")
            mode = part  # type: ignore[assignment]
        elif part.startswith("min_hits:"):
            if min_hits is not None:
                raise ConfigError(f"{key}: min_hits given twice in {text!r}")
            value = part.removeprefix("min_hits:")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{key}: min_hits must be an integer >= 1, got {value!r}")
            min_hits = int(value)
        else:
            raise ConfigError(
                f"{key}: unknown part {raw.strip()!r} in {text!r}; expected write_back, "
                "write_through and/or min_hits:N"
            )
    return AdmissionSpec(mode=mode or "write_back", min_hits=min_hits or 1)
