"""`localctx plan` and the planner behind run: output, --json, and one-line errors."""
import json


def test_plan_on_paper_for_a_named_gpu_as_json(cli):
    r = cli("plan", "-m", "llama-3-8b", "--hardware", "rtx4090", "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["plan"]["policy"] == "fp16" and out["plan"]["exact"] is True
    assert out["plan"]["backend"] == "torch"
    assert out["model_source"].startswith("assets/models.json")
    assert [p["context"] for p in out["projections"]] == [4096, 8192]
    assert out["projections"][1]["kv_bytes"] == 8192 * 131_072
    assert out["hardware"]["key"] == "rtx4090"


def test_plan_text_names_the_choice_the_projection_and_the_rejected(cli):
    r = cli("plan", "-m", "llama-3-8b-q4", "--hardware", "cpu-24gb", "--context", "32768")
    assert r.code == 0, r.err
    assert "policy    fp16+sink4+win4092" in r.out
    assert "projected with this policy:" in r.out and "32,768" in r.out
    assert "rejected:" in r.out and "trained on" in r.out


def test_plan_states_what_a_speed_target_cost(cli):
    # a calibration in the (test-isolated) user cache: 6 ms per step plus 80 ps per fp16 KV byte
    from localctx.backends.machine.detect import named
    from localctx.kvcache import calibration
    from localctx.kvcache.calibration import Calibration, FormatCost

    hw = named("cpu-24gb")
    calibration.save(Calibration(backend="llamacpp", hardware_key=hw.key, model="SmolLM2-135M-Instruct",
                                 weight_bytes=96_576_768, bandwidth_bytes_s=hw.bandwidth_bytes_s,
                                 formats={"fp16": FormatCost(0.006, 8e-11)}))
    r = cli("plan", "-m", "smollm2-135m", "--hardware", "cpu-24gb", "--context", "16384", "--min-tok-s", "100",
            "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["plan"]["policy"].startswith("fp16+sink4+win")
    assert any("bound by --min-tok-s 100" in x for x in out["plan"]["reasons"])
    assert any("speed target 100 tok/s met" in x for x in out["plan"]["reasons"])
    assert out["plan"]["decode_tok_s"] >= 100
    assert out["calibration"].endswith("calibration-llamacpp-cpu-intel-r-xeon-r-processor-2c.json")
    # 1 / (6 ms + 80 ps × 23,040 B × tokens) ≥ 110 tok/s (the target plus its 10% margin) holds up to 1,676 tokens
    assert out["plan"]["policy"] == "fp16+sink4+win1672"


def test_a_model_that_cannot_fit_is_refused_with_exit_2(cli):
    r = cli("plan", "-m", "llama-3-8b", "--hardware", "m1-8gb")
    assert r.code == 2
    assert "does not fit" in r.out


def test_plan_bad_input_is_one_line(cli):
    r = cli("plan", "--hardware", "rtx9999")
    assert r.code == 2 and r.err.count("\n") == 1 and "unknown hardware profile" in r.err
    r = cli("plan", "-m", "no-such-model")
    assert r.code == 2 and "llama-3-8b" in r.err  # lists the known shapes
    r = cli("plan", "-m", "llama-3-8b", "--hardware", "rtx4090", "--max-memory", "lots")
    assert r.code == 2 and "6GB" in r.err
    r = cli("plan", "--calibrate", "--backend", "fake")  # nothing to calibrate: said before anything is timed
    assert r.code == 2 and r.err.count("\n") == 1 and "--backend llamacpp or --backend torch" in r.err


def test_list_hardware(cli):
    r = cli("plan", "--list-hardware")
    assert r.code == 0 and "rtx4090" in r.out.split() and "m2-max-64gb" in r.out.split()


def test_run_refuses_a_kv_policy_that_cannot_fit_before_loading(cli):
    r = cli("run", "--backend", "fake", "--kv", "fp16", "--max-memory", "1MB", "hello")
    assert r.code == 2 and "cannot fit" not in r.out
    assert "--max-memory" in r.err or "does not fit" in r.err


def test_kv_and_planner_targets_conflict(cli):
    r = cli("run", "--backend", "fake", "--kv", "fp16", "--exact", "hello")
    assert r.code == 2 and "--kv names the policy itself" in r.err


def test_run_uses_the_plan_by_default(cli):
    r = cli("run", "--backend", "fake", "--json", "hello there")
    assert r.code == 0, r.err
    assert json.loads(r.out)["policy"] == "fp16"


def test_plan_refuses_a_named_policy_its_backend_cannot_run_as_run_does(cli):
    r = cli("plan", "-m", "llama-3-8b-q4", "--hardware", "cpu-24gb", "--backend", "llamacpp", "--kv", "int4+res128")
    assert r.code == 2 and "backend llamacpp cannot run KV policy int4+res128" in r.err
    assert "residual" in r.err and len(r.err.strip().splitlines()) == 1
    ok = cli("plan", "-m", "llama-3-8b-q4", "--hardware", "cpu-24gb", "--backend", "llamacpp", "--kv", "k8v4")
    assert ok.code == 0 and "q8_0 keys, q4_0 values" in ok.out
