"""Hardware profiles: named machines from assets/hardware.json, detection paths, the cached CPU benchmark."""
import json

import pytest

from localctx.backends.machine import detect
from localctx.kvcache.errors import UserError
from localctx.kvcache.hardware_profile import GB, GiB, HardwareProfile

CUDA_FRACTION = detect.table()["achievable_fraction"]["cuda"]
APPLE_FRACTION = detect.table()["achievable_fraction"]["apple"]


def test_named_rtx4090_and_rtx4080():
    hw = detect.named("rtx4090")
    assert (hw.kind, hw.memory_bytes, hw.detected) == ("cuda", 24 * GiB, False)
    assert hw.bandwidth_bytes_s == pytest.approx(1008 * GB * CUDA_FRACTION)
    assert hw.free_bytes < hw.memory_bytes
    assert detect.named("RTX-4080").memory_bytes == 16 * GiB


def test_named_apple_profiles_use_the_chip_and_the_memory_option():
    m2max = detect.named("m2-max-64gb")
    assert (m2max.kind, m2max.memory_bytes) == ("apple", 64 * GiB)
    assert m2max.bandwidth_bytes_s == pytest.approx(400 * GB * APPLE_FRACTION)
    assert m2max.free_bytes == int(64 * GiB * 0.75)  # Metal's working set on a large machine
    binned = detect.named("m3-max-36gb")  # the 36 GB M3 Max is the 300 GB/s part
    assert binned.bandwidth_bytes_s == pytest.approx(300 * GB * APPLE_FRACTION)
    assert detect.named("m1-8gb").free_bytes == int(8 * GiB * 0.67)


def test_apple_table_covers_every_m1_to_m4_tier():
    chips = detect.table()["apple"]["chips"]
    for gen in (1, 2, 3, 4):
        for tier in ("", " Pro", " Max"):
            assert f"M{gen}{tier}" in chips
    for gen in (1, 2, 3):  # Apple has shipped no M4 Ultra
        assert f"M{gen} Ultra" in chips


def test_unknown_or_impossible_profiles_are_one_line_user_errors():
    with pytest.raises(UserError, match="unknown hardware profile 'rtx9999'.*rtx4090"):
        detect.named("rtx9999")
    with pytest.raises(UserError, match="was not sold with 64 GB"):
        detect.named("m1-64gb")


def test_every_listed_profile_resolves():
    names = detect.profile_names()
    assert {"rtx4090", "rtx3090", "rtx5090", "m2-max-64gb", "m3-pro-36gb", "cpu-24gb"} <= set(names)
    for name in names:
        assert detect.named(name).bandwidth_bytes_s > 0


def test_nvidia_known_name_uses_the_table_and_unknown_uses_bus_width_times_clock():
    known = detect.nvidia_profile("NVIDIA GeForce RTX 4090", total=24 * GiB, free=20 * GiB)
    assert (known.bandwidth_source, known.key) == ("table", "rtx4090")
    assert detect.nvidia_table_entry("NVIDIA GeForce RTX 4080 SUPER")[0] == "RTX 4080 SUPER"
    # GDDR6X at 10,501 MHz on a 384-bit bus: 2 × 10.501e9 × 48 bytes ≈ 1008 GB/s
    odd = detect.nvidia_profile("NVIDIA Prototype X", total=24 * GiB, free=24 * GiB,
                                  mem_clock_khz=10_501_000, bus_width_bits=384)
    assert odd.bandwidth_source == "bus width x memory clock"
    assert odd.bandwidth_bytes_s == pytest.approx(2 * 10_501e6 * 48 * CUDA_FRACTION)
    with pytest.raises(UserError, match="--hardware"):
        detect.nvidia_profile("NVIDIA Prototype Y", total=GiB, free=GiB)


def test_detect_apple_reads_sysctl(monkeypatch):
    values = {"machdep.cpu.brand_string": "Apple M3 Pro", "hw.memsize": str(36 * GiB)}
    monkeypatch.setattr(detect, "_sysctl", values.__getitem__)
    hw = detect.detect_apple()
    assert (hw.name, hw.memory_bytes, hw.detected) == ("Apple M3 Pro", 36 * GiB, True)
    assert hw.bandwidth_bytes_s == pytest.approx(150 * GB * APPLE_FRACTION)
    assert hw.free_bytes <= int(36 * GiB * 0.67)


def test_cpu_bandwidth_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(detect, "load_per_core", lambda: 0.1)  # a quiet machine
    calls = []
    monkeypatch.setattr(detect, "measure_copy_bandwidth", lambda: calls.append(1) or 7.5e9)
    first = detect.detect_cpu()
    second = detect.detect_cpu()
    assert calls == [1]
    assert (first.bandwidth_bytes_s, first.bandwidth_source) == (7.5e9, "measured")
    assert (second.bandwidth_bytes_s, second.bandwidth_source) == (7.5e9, "measured (cached)")
    assert (tmp_path / "hardware.json").is_file()
    assert first.key == detect.cpu_class() and first.kind == "cpu"


def test_a_bandwidth_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path))
    load, figures = [3.0], iter([2e9, 9e9])
    monkeypatch.setattr(detect, "load_per_core", lambda: load[0])
    monkeypatch.setattr(detect, "measure_copy_bandwidth", lambda: next(figures))
    busy = detect.detect_cpu()
    assert (busy.bandwidth_bytes_s, busy.bandwidth_source) == (2e9, "measured (on a busy machine: load 3.0 per core)")
    still_busy = detect.detect_cpu()  # no new measurement while the machine is busy: it would read low too
    assert (still_busy.bandwidth_bytes_s, still_busy.bandwidth_source) == (
        2e9, "measured (cached, on a busy machine: load 3.0 per core)")
    load[0] = 0.2
    quiet = detect.detect_cpu()
    assert (quiet.bandwidth_bytes_s, quiet.bandwidth_source) == (9e9, "measured")
    assert detect.detect_cpu().bandwidth_source == "measured (cached)"
    saved = json.loads((tmp_path / "hardware.json").read_text())[detect.cpu_class()]
    assert saved["quiet"] is True and saved["load_per_core"] == 0.2


def test_a_cached_figure_without_the_load_it_was_measured_under_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALCTX_CACHE_DIR", str(tmp_path))
    (tmp_path / "hardware.json").write_text(json.dumps({detect.cpu_class(): {"bandwidth_bytes_s": 5.6e9}}))
    monkeypatch.setattr(detect, "load_per_core", lambda: 0.1)
    monkeypatch.setattr(detect, "measure_copy_bandwidth", lambda: 15e9)
    assert detect.detect_cpu().bandwidth_bytes_s == 15e9


def test_copy_benchmark_measures_a_plausible_bandwidth():
    bw = detect.measure_copy_bandwidth(size_bytes=8 * 1024 * 1024, repeats=2)
    assert 1e8 < bw < 1e13


def test_profile_validation():
    with pytest.raises(ValueError, match="kind"):
        HardwareProfile(kind="tpu", name="x", memory_bytes=1, free_bytes=1, bandwidth_bytes_s=1,
                        bandwidth_source="table")
    with pytest.raises(ValueError, match="free memory"):
        HardwareProfile(kind="cpu", name="x", memory_bytes=1, free_bytes=2, bandwidth_bytes_s=1,
                        bandwidth_source="table")
    hw = detect.named("rtx4090")
    assert HardwareProfile.from_dict(hw.to_dict()) == hw


@pytest.mark.cuda
def test_detect_finds_the_nvidia_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    hw = detect.detect()
    assert hw.kind == "cuda" and hw.memory_bytes > 0 and hw.bandwidth_bytes_s > 100e9
