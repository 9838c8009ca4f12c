"""The chat tests' fixture: a history in a tmp dir (LOCALCTX_DATA_DIR)."""
from __future__ import annotations

import pytest

from localctx.app.history import History


@pytest.fixture
def history(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCTX_DATA_DIR", str(tmp_path))
    hist, notice = History.open()
    assert notice is None
    yield hist
    hist.close()
