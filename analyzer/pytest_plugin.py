"""The KL consistency check inside your own pytest suite.

A mixin, for a server you start yourself (like sglang's KLDivergenceMixin):

    from dumpdiff.analyzer.pytest_plugin import KLConsistency

    class TestMyServer(KLConsistency):
        kl_url = "http://127.0.0.1:30000"        # or --kl-url / DUMPDIFF_KL_URL, or override the
                                                 # `dumpdiff_kl_url` fixture (e.g. from your server fixture)
        kl_max_samples = 32
        kl_max_new_tokens = 512
        kl_thresholds = "dumpdiff-kl-thresholds.json"   # committed next to the tests

It adds one test, ``test_kl_consistency``: the three helpers, the verdict, and on failure the
whole table (and the `dumpdiff localize` command) in the assertion message.

Functions, for anything else (an in-process HF model, a custom server fixture):

    from dumpdiff.analyzer.pytest_plugin import assert_kl_pass, kl_check_server, kl_check_model
    assert_kl_pass(kl_check_model(model, prompts, max_new_tokens=32))

Or load it as a plugin (``pytest_plugins = ["dumpdiff.analyzer.pytest_plugin"]`` in conftest.py) for
the ``dumpdiff_kl`` fixture (a function url -> result that fails the test unless it passes)
and the ``--kl-url`` / ``--kl-thresholds`` command-line options.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest

from .kl import render as kl_render
from .kl import score as kl
from .kl.helpers import check_server as kl_check_server  # noqa: F401 - re-exported
from .kl.inprocess import check_model as kl_check_model  # noqa: F401 - re-exported
from .kl.result import KLResult


class KLCheckFailed(AssertionError):
    """The KL check did not pass; str() is the full report."""


def assert_kl_pass(result: KLResult, allow_inconclusive: bool = False) -> KLResult:
    """Fail with the rendered table unless the verdict is pass."""
    kind = result["verdict"]["kind"]
    if kind == kl.PASS or (allow_inconclusive and kind == kl.INCONCLUSIVE):
        return result
    raise KLCheckFailed("\n" + kl_render.to_text(result))


class KLConsistency:
    """Mixin: one test that runs the KL check against `kl_url` and asserts it passes."""

    kl_url: Optional[str] = None
    kl_max_samples: int = 32
    kl_max_new_tokens: int = 512
    kl_prompt_len: int = 256
    kl_prompts_file: Optional[str] = None
    kl_thresholds: Optional[str] = None
    kl_threshold: Optional[float] = None
    kl_seed: int = 0
    kl_helpers = kl.HELPERS

    @pytest.fixture
    def dumpdiff_kl_url(self, request):
        """The server's URL: kl_url, else --kl-url, else DUMPDIFF_KL_URL. Override this fixture
        in the subclass to take it from your own server fixture."""
        url = self.kl_url or _option(request, "--kl-url") or os.environ.get("DUMPDIFF_KL_URL")
        if not url:
            pytest.skip("no server for the KL check: set kl_url, --kl-url or DUMPDIFF_KL_URL")
        return url

    def kl_options(self) -> dict:
        return {
            "max_samples": self.kl_max_samples,
            "max_new_tokens": self.kl_max_new_tokens,
            "prompt_len": self.kl_prompt_len,
            "prompts_file": self.kl_prompts_file,
            "thresholds_file": self.kl_thresholds,
            "threshold": self.kl_threshold,
            "seed": self.kl_seed,
            "helpers": tuple(self.kl_helpers),
        }

    def test_kl_consistency(self, dumpdiff_kl_url) -> None:
        result = kl_check_server(dumpdiff_kl_url, **self.kl_options())
        assert_kl_pass(result)


def _option(request, name: str):
    try:
        return request.config.getoption(name)
    except (ValueError, AttributeError):
        return None


# -- as a plugin ---------------------------------------------------------------------------------


def pytest_addoption(parser) -> None:
    group = parser.getgroup("dumpdiff-kl", "dumpdiff KL consistency check")
    group.addoption("--kl-url", default=None, help="sglang server for the KL check (or DUMPDIFF_KL_URL)")
    group.addoption("--kl-thresholds", default=None, help="thresholds file (default dumpdiff-kl-thresholds.json)")


@pytest.fixture
def dumpdiff_kl(request):
    """A function: dumpdiff_kl(url=None, **check_server options) -> result; fails unless it passes."""

    def run(url: Optional[str] = None, **options):
        url = url or _option(request, "--kl-url") or os.environ.get("DUMPDIFF_KL_URL")
        if not url:
            pytest.skip("no server for the KL check: --kl-url or DUMPDIFF_KL_URL")
        options.setdefault("thresholds_file", _option(request, "--kl-thresholds"))
        return assert_kl_pass(kl_check_server(url, **options))

    return run
