"""Planner specs: hardware presets and cluster strings, model shapes, workload distributions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest

from flowrl.contract.hardware import save_hardware
from flowrl.contract.workload import Histogram, LogNormal, mean_length, sample_lengths
from flowrl.errors import ConfigError
from flowrl.planner.hardware import (
    HARDWARE_PRESETS,
    ClusterSpec,
    HardwareSpec,
    default_profile_path,
    load_hardware,
    parse_cluster,
)
from flowrl.planner.modelspec import MODEL_PRESETS, ModelSpec, load_model_spec
from flowrl.planner.workload import Fixed, WorkloadSpec, load_workload, workload_from_flags

# ------------------------------------------------------------------ hardware / cluster


def test_presets_are_named_and_sane() -> None:
    assert set(HARDWARE_PRESETS) == {"A100-40G", "A100-80G", "H100-80G", "H200-141G", "H20"}
    for name, hw in HARDWARE_PRESETS.items():
        assert hw.name == name
        assert hw.peak_flops_bf16 > hw.peak_flops_fp32 > 0
        assert hw.intra_node_bandwidth > hw.inter_node_bandwidth
    assert HARDWARE_PRESETS["A100-80G"].memory_bytes == 80 * 1024**3
    assert HARDWARE_PRESETS["H100-80G"].peak_flops_bf16 == 989e12
    assert HARDWARE_PRESETS["H200-141G"].memory_bytes > HARDWARE_PRESETS["H100-80G"].memory_bytes


@pytest.mark.parametrize(
    ("text", "nodes", "per_node", "hardware"),
    [
        ("16xA100-80G", 2, 8, "A100-80G"),
        ("16x A100-80G", 2, 8, "A100-80G"),
        ("16xa100-80g", 2, 8, "A100-80G"),
        ("4xH100-80G", 1, 4, "H100-80G"),
        ("8xH20", 1, 8, "H20"),
        ("2x8xH200-141G", 2, 8, "H200-141G"),
        (" 3x4xA100-40G ", 3, 4, "A100-40G"),
    ],
)
def test_parse_cluster_strings(text: str, nodes: int, per_node: int, hardware: str) -> None:
    cluster = parse_cluster(text)
    assert (cluster.nodes, cluster.devices_per_node, cluster.hardware.name) == (nodes, per_node, hardware)
    assert cluster.devices == nodes * per_node
    assert parse_cluster(cluster.label) == cluster


def test_partial_nodes_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"12 devices do not fill whole 8-device nodes; use 8, 16, 24"):
        parse_cluster("12xA100-80G")
    with pytest.raises(ConfigError, match="at most 8 devices"):
        parse_cluster("2x16xH100-80G")


def test_unknown_preset_suggests() -> None:
    with pytest.raises(ConfigError, match=r"Did you mean 'A100-80G'\?.*Presets: A100-40G, A100-80G") as info:
        parse_cluster("16xA100-80")
    assert "H200-141G" in str(info.value)
    with pytest.raises(ConfigError, match="give a device count"):
        parse_cluster("H100-80G")


def test_extra_presets() -> None:
    mine = msgspec.structs.replace(HARDWARE_PRESETS["H100-80G"], name="MI300X", devices_per_node=8)
    assert parse_cluster("8xmi300x", extra_presets={"MI300X": mine}).hardware is mine
    with pytest.raises(ConfigError, match="MI300X"):
        parse_cluster("8xMI300", extra_presets={"MI300X": mine})


def test_cluster_file_with_preset_and_inline_override(tmp_path: Path) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text("nodes: 2\ndevices_per_node: 8\nhardware: A100-80G\n")
    assert parse_cluster(str(plain)) == ClusterSpec(nodes=2, devices_per_node=8, hardware=HARDWARE_PRESETS["A100-80G"])

    custom = tmp_path / "custom.yaml"
    custom.write_text("nodes: 4\nhardware:\n  preset: a100-80g\n  memory_bytes: 70e9\n  inter_node_bandwidth: 12.5e9\n")
    cluster = parse_cluster(str(custom))
    assert (cluster.nodes, cluster.devices_per_node) == (4, 8)  # devices_per_node defaults to the hardware's
    assert cluster.hardware.memory_bytes == 70_000_000_000
    assert cluster.hardware.inter_node_bandwidth == 12.5e9
    assert cluster.hardware.peak_flops_bf16 == HARDWARE_PRESETS["A100-80G"].peak_flops_bf16

    full = tmp_path / "full.json"
    spec = msgspec.to_builtins(HARDWARE_PRESETS["H20"]) | {"name": "box", "devices_per_node": 4}
    full.write_text(json.dumps({"nodes": 1, "devices_per_node": 4, "hardware": spec}))
    assert parse_cluster(str(full)).hardware.name == "box"


def test_cluster_file_errors_name_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: 2\nhardware:\n  preset: A100-80G\n  matmul_efficiency: 1.5\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*hardware\.matmul_efficiency"):
        parse_cluster(str(bad))
    bad.write_text("nodes: 2\nhardware:\n  preset: A100-80G\n  memroy_bytes: 1\n")
    with pytest.raises(
        ConfigError, match=r"unknown field 'hardware\.memroy_bytes'.*Did you mean 'hardware\.memory_bytes'"
    ):
        parse_cluster(str(bad))
    bad.write_text("nodes: 2\nhardware: B200\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*unknown hardware preset 'B200'"):
        parse_cluster(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        parse_cluster(str(tmp_path / "missing.yaml"))


def test_local_needs_a_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path / "home"))
    assert default_profile_path() == tmp_path / "home" / "hardware" / "local.yaml"
    with pytest.raises(ConfigError, match="flowrl profile"):
        parse_cluster("local")
    measured = msgspec.structs.replace(HARDWARE_PRESETS["A100-40G"], name="local", matmul_efficiency=0.61)
    save_hardware(measured, default_profile_path())
    cluster = parse_cluster("LOCAL")
    assert (cluster.nodes, cluster.devices_per_node, cluster.hardware) == (1, 1, measured)
    other = tmp_path / "other.yaml"
    with pytest.raises(ConfigError, match="flowrl profile"):
        parse_cluster("local", local_path=other)


def test_hardware_round_trip_and_errors(tmp_path: Path) -> None:
    for spec in HARDWARE_PRESETS.values():
        path = save_hardware(spec, tmp_path / "hw" / f"{spec.name}.yaml")
        assert load_hardware(path) == spec
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\npeak_flops_bf16: fast\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml.*peak_flops_bf16"):
        load_hardware(broken)
    with pytest.raises(ConfigError, match="does not exist"):
        load_hardware(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="memory_bytes"):
        msgspec.structs.replace(HARDWARE_PRESETS["H20"], memory_bytes=0)
    cpu = HardwareSpec(
        name="cpu", peak_flops_bf16=1e12, peak_flops_fp32=1e12, memory_bytes=2**34,
        memory_bandwidth=1e11, intra_node_bandwidth=1e10, inter_node_bandwidth=1e9, devices_per_node=1,
    )  # fmt: skip
    assert cpu.matmul_efficiency == 0.55 and cpu.kernel_overhead == 2e-5
    assert load_hardware(save_hardware(cpu, tmp_path / "cpu.yaml")) == cpu
    with pytest.raises(ConfigError, match="comm_efficiency"):
        msgspec.structs.replace(cpu, comm_efficiency=0.0)


# ------------------------------------------------------------------ models


@pytest.mark.parametrize(
    ("name", "expected", "tolerance"),
    [
        ("llama-7b", 6.74e9, 0.01),
        ("llama-70b", 68.98e9, 0.01),
        ("qwen2.5-7b", 7.62e9, 0.01),
        ("qwen2.5-0.5b", 0.494e9, 0.02),
    ],
)
def test_preset_parameter_counts(name: str, expected: float, tolerance: float) -> None:
    assert abs(MODEL_PRESETS[name].parameters() - expected) / expected < tolerance


def test_model_formulas() -> None:
    llama = MODEL_PRESETS["llama-7b"]
    assert llama.parameters() == 6_738_415_616  # the checkpoint's exact count
    assert llama.kv_bytes_per_token() == 2 * 32 * 32 * 128 * 2
    assert MODEL_PRESETS["llama-70b"].kv_bytes_per_token(dtype_bytes=1) == 2 * 80 * 8 * 128
    embed = llama.vocab * llama.hidden
    assert llama.flops_per_token(0) == 2 * (llama.parameters() - embed)
    assert llama.flops_per_token(1000) - llama.flops_per_token(0) == 4 * 32 * 1000 * 4096
    tied = MODEL_PRESETS["qwen2.5-0.5b"]
    assert tied.flops_per_token(0) == 2 * tied.parameters()  # the tied lm_head still multiplies
    assert all(name == name.lower() for name in MODEL_PRESETS)
    with pytest.raises(ConfigError, match="kv_heads"):
        ModelSpec(name="x", layers=1, hidden=64, heads=4, kv_heads=3, intermediate=128, vocab=10)


def _hf_config(**overrides: object) -> dict[str, object]:
    config: dict[str, object] = {
        "model_type": "qwen2",
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    }
    config.update(overrides)
    return {k: v for k, v in config.items() if v is not None}


def test_load_model_spec(tmp_path: Path) -> None:
    assert load_model_spec("Qwen2.5-7B") is MODEL_PRESETS["qwen2.5-7b"]
    model_dir = tmp_path / "Qwen2.5-7B-Instruct"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(_hf_config()))
    for text in (str(model_dir), str(model_dir / "config.json")):
        spec = load_model_spec(text)
        assert spec.name == "Qwen2.5-7B-Instruct"
        assert spec.parameters() == MODEL_PRESETS["qwen2.5-7b"].parameters()
        assert spec.qkv_bias and not spec.tied_embeddings
    llama = tmp_path / "llama" / "config.json"
    llama.parent.mkdir()
    llama.write_text(json.dumps(_hf_config(model_type="llama", num_key_value_heads=None, head_dim=64)))
    spec = load_model_spec(str(llama))
    assert (spec.kv_heads, spec.head_dim, spec.qkv_bias) == (28, 64, False)


def test_load_model_spec_errors(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_hf_config(intermediate_size=None)))
    with pytest.raises(ConfigError, match=r"config\.json.*'intermediate_size'"):
        load_model_spec(str(config))
    config.write_text(json.dumps(_hf_config(hidden_size="big")))
    with pytest.raises(ConfigError, match=r"config\.json.*'hidden_size' must be an integer"):
        load_model_spec(str(config))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        load_model_spec(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"Did you mean 'qwen2\.5-7b'\?.*Presets: llama-7b"):
        load_model_spec("qwen2.5-7")


# ------------------------------------------------------------------ workloads


def test_load_workload_lognormal_and_histogram(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(
        "prompts_per_step: 512\nsamples_per_prompt: 8\nprompt_length: 2048\n"
        "response_length: {kind: lognormal, median: 512, sigma: 1.0, max: 8192}\nppo_epochs: 2\nmini_batches: 4\n"
    )
    w = load_workload(path)
    assert w.sequences == 4096
    assert w.response_length == LogNormal(median=512.0, sigma=1.0, max=8192)
    assert w.max_response() == 8192
    path.write_text("response_length:\n  kind: histogram\n  lengths: [100, 200, 4000]\n  weights: [3, 1, 1]\n")
    w = load_workload(path)
    assert w.response_length == Histogram(lengths=[100, 200, 4000], weights=[3.0, 1.0, 1.0])
    assert w.max_response() == 4000 and mean_length(w.response_length) == pytest.approx(900.0)
    path.write_text("response_length: 256\n")
    assert load_workload(path).response_length == Fixed(value=256)
    toml = tmp_path / "w.toml"
    toml.write_text('prompts_per_step = 4\n[response_length]\nkind = "fixed"\nvalue = 7\n')
    assert load_workload(toml) == WorkloadSpec(prompts_per_step=4, response_length=Fixed(value=7))


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ("response_length: {kind: lognormal, median: 512, sigma: -1, max: 10}", r"response_length\.sigma"),
        ("response_length: {kind: lognormal, median: 512, sigma: 1}", r"response_length.*max"),
        ("response_length: {kind: gamma, value: 3}", r"response_length.*gamma"),
        ("response_length: {kind: histogram, lengths: [1, 2], weights: [1]}", r"response_length.*same length"),
        ("response_length: {kind: histogram, lengths: [1, 2], weights: [1, 0]}", r"response_length\.weights"),
        ("response_length: {kind: histogram, lengths: [], weights: []}", r"response_length.*must not be empty"),
        ("response_length: {kind: histogram, lengths: [0], weights: [1]}", r"response_length\.lengths"),
        ("prompts_per_step: 0", r"prompts_per_step"),
        ("prompts_per_step: 2\nmini_batches: 3", r"mini_batches"),
        ("promts_per_step: 2", r"Did you mean 'prompts_per_step'"),
    ],
)
def test_bad_workloads_name_the_field(tmp_path: Path, body: str, pattern: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(body + "\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml") as info:
        load_workload(path)
    assert re.search(pattern, str(info.value)), str(info.value)


def test_direct_construction_is_checked() -> None:
    with pytest.raises(ConfigError, match="same length"):
        Histogram(lengths=[1, 2], weights=[1.0])
    with pytest.raises(ConfigError, match="weights"):
        Histogram(lengths=[1], weights=[-1.0])
    with pytest.raises(ConfigError, match="sigma"):
        LogNormal(median=10, sigma=-0.5, max=100)


def test_sampling_is_deterministic_and_long_tailed() -> None:
    dist = LogNormal(median=512, sigma=1, max=8192)
    a = sample_lengths(dist, 4096, np.random.default_rng(7))
    b = sample_lengths(dist, 4096, np.random.default_rng(7))
    assert a.dtype == np.int64 and np.array_equal(a, b)
    assert a.min() >= 1 and a.max() <= 8192
    assert a.max() / np.median(a) >= 6
    big = sample_lengths(dist, 100_000, np.random.default_rng(0))
    assert mean_length(dist) == pytest.approx(big.mean(), rel=0.02)
    assert np.array_equal(sample_lengths(Fixed(value=9), 3, np.random.default_rng()), [9, 9, 9])
    hist = Histogram(lengths=[10, 20], weights=[1, 3])
    h = sample_lengths(hist, 20_000, np.random.default_rng(1))
    assert set(np.unique(h)) == {10, 20} and (h == 20).mean() == pytest.approx(0.75, abs=0.02)
    assert np.array_equal(h, sample_lengths(hist, 20_000, np.random.default_rng(1)))
    assert mean_length(LogNormal(median=100, sigma=0, max=50)) == 50


def test_workload_from_flags() -> None:
    base = WorkloadSpec(prompts_per_step=8, response_length=LogNormal(median=100, sigma=0.5, max=400))
    assert workload_from_flags(None, None, None, None, base) is base
    w = workload_from_flags(16, 4, 256, None, base)
    assert (w.prompts_per_step, w.samples_per_prompt, w.prompt_length, w.sequences) == (16, 4, 256, 64)
    assert w.response_length == base.response_length
    assert workload_from_flags(None, None, None, 300, None).response_length == Fixed(value=300)
    with pytest.raises(ConfigError, match="prompts"):
        workload_from_flags(0, None, None, None, None)
