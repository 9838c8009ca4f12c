"""The backend registry: the CLI offers the real backends only (the fake one is registered by the
test suite), and the over-long-prompt hint names a policy the chosen backend accepts."""
from __future__ import annotations

import dataclasses

import pytest

from localctx.backends import registry
from localctx.backends.base import check_prompt_fits
from localctx.backends.fake.session import FAKE_SPEC
from localctx.kvcache.errors import UserError
from localctx.kvcache.plan import Plan
from localctx.kvcache.policy import KVPolicy


def test_the_cli_does_not_offer_the_fake_backend(cli, monkeypatch):
    monkeypatch.delenv(registry.PLUGINS_ENV, raising=False)
    assert "fake" not in registry.names()
    res = cli("run", "--backend", "fake", "hi")
    assert res.code == 2 and res.out == ""
    assert res.err.strip().splitlines() == [
        "localctx: error: unknown backend 'fake'; choose one of llamacpp, torch, mlx, openai (or auto; openai takes "
        "--endpoint URL)"]
    assert "fake" not in cli("run", "--help").out


def test_plugins_reach_the_registry_in_process_and_through_the_environment(monkeypatch):
    monkeypatch.delenv(registry.PLUGINS_ENV, raising=False)
    monkeypatch.setattr(registry, "_registered", {})
    registry.register("double", "localctx.backends.fake.backend:FakeBackend")
    assert registry.get("double").name == "fake"
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.setenv(registry.PLUGINS_ENV, "other=localctx.backends.fake.backend:FakeBackend, llamacpp=x:Y")
    assert registry.names() == ["llamacpp", "torch", "mlx", "openai", "other"]  # a built-in is never replaced
    with pytest.raises(ValueError, match="built in"):
        registry.register("torch", "localctx.backends.fake.backend:FakeBackend")


SPEC = dataclasses.replace(FAKE_SPEC, head_dim=64)


@pytest.mark.parametrize("backend, suggested", [("llamacpp", "fp16+sink4+win32"), ("torch", "int8+sink4+win32"),
                                                ("fake", "int8+sink4+win32")])
def test_the_over_long_prompt_hint_names_a_policy_the_backend_accepts(backend, suggested):
    plan = Plan.fixed(backend, SPEC, KVPolicy(), 64)
    with pytest.raises(UserError) as err:
        check_prompt_fits(100, plan, SPEC, 8)
    message = str(err.value)
    assert "prompt is 100 tokens" in message and message.endswith(f"--kv {suggested}")
    cls = registry.backend_class(backend)
    assert cls is not None and cls().refusals(KVPolicy.parse(suggested), SPEC) == []
    if backend == "llamacpp":  # the hint it gave before: refused by llama.cpp
        assert cls().refusals(KVPolicy.parse("int8+sink4+win32"), SPEC)
