"""Test-wide settings.

Hypothesis runs derandomized by default, so CI explores the same examples on every run and a
failure reproduces anywhere; `HYPOTHESIS_PROFILE=explore` draws fresh random examples (and more
of them) when hunting for new bugs locally.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("default", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
