"""A calibration's verify step costs (prompt lookup's prior): stored, read back, damage refused."""
from __future__ import annotations

import json

import pytest

from localctx.kvcache import calibration
from localctx.kvcache.calibration import Calibration, FormatCost


def sample(verify: dict) -> Calibration:
    fc = FormatCost.fit([(128, 1000, 0.01), (1024, 8000, 0.012)])
    return Calibration(backend="llamacpp", hardware_key="cpu-test-2c", model="m", weight_bytes=1,
                       bandwidth_bytes_s=1.0, formats={"fp16": fc}, verify_step_cost=verify)


def test_verify_costs_survive_a_round_trip_and_old_files_have_none():
    cal = sample({2: 1.66, 9: 4.94})
    back = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert back.verify_step_cost == {2: 1.66, 9: 4.94}
    old = cal.to_dict()
    old.pop("verify_step_cost")
    assert Calibration.from_dict(old).verify_step_cost == {}
    assert "verify_step_cost" not in sample({}).to_dict()


@pytest.mark.parametrize("bad", [{"2": 0.5}, {"1": 1.0}])
def test_a_damaged_verify_cost_is_refused(bad):
    d = sample({}).to_dict()
    d["verify_step_cost"] = bad
    with pytest.raises(ValueError):
        Calibration.from_dict(d)


def test_a_damaged_user_file_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "cache_dir", lambda: tmp_path)
    d = sample({}).to_dict()
    d["verify_step_cost"] = {"3": 0.2}
    calibration.save(Calibration.from_dict(sample({}).to_dict()))  # a good file, then damage it
    path = calibration.user_path("llamacpp", "cpu-test-2c")
    path.write_text(json.dumps(d))
    assert calibration.load("llamacpp", "cpu-test-2c") is None  # no committed default for this key
