"""Helpers shared by the tests of conventions."""

from __future__ import annotations

SECRET = "frenzy-test-secret-7c1d9e"  # moto accepts any keys: what matters is where this string shows
