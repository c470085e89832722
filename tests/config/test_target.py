"""Target files: the shipped ones validate; bad ones fail with file, line and field (exit 2)."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from edgesdk.config import builtin_targets, load_target, target_schema
from edgesdk.errors import EXIT_USAGE, UsageError


def test_shipped_targets_validate():
    shipped = builtin_targets()
    assert set(shipped) == {"arm_2tpu", "x86", "rtx3090"}
    arm, _ = load_target("arm_2tpu")
    assert arm.host.arch == "aarch64"
    assert arm.device_map() == {"cpu": "cpu", "edgetpu:0": "usb:0", "edgetpu:1": "usb:1"}
    assert arm.host.codegen["mattr"] == ["+neon"]
    gpu, _ = load_target("rtx3090")
    assert gpu.logical_ids("gpu") == ["gpu:0"]
    x86, _ = load_target("x86")
    assert [d.kind for d in x86.devices] == ["cpu"]


def test_every_cost_figure_names_a_source():
    for path in builtin_targets().values():
        t, _ = load_target(path)
        figures = []
        for d in t.devices:
            for _, value in d:
                items = value.values() if isinstance(value, dict) else [value]
                for v in items:
                    if hasattr(v, "source"):
                        figures.append(v)
                    if hasattr(v, "bandwidth"):
                        figures += [v.bandwidth, v.latency]
        assert len(figures) >= 4
        assert all(len(f.source) > 10 for f in figures), path


def _write(tmp_path, text):
    p = tmp_path / "t.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def _problems(path):
    with pytest.raises(UsageError) as e:
        load_target(path)
    assert e.value.exit_code == EXIT_USAGE
    return e.value.notes


def test_unknown_key_names_file_line_and_field(tmp_path):
    text = (builtin_targets()["x86"]).read_text().replace("    cores: 4\n", "    cores: 4\n    turbo: yes\n")
    p = _write(tmp_path, text)
    line = text.splitlines().index("    turbo: yes") + 1
    assert _problems(p) == [f"{p}:{line}: unknown key 'devices.0.turbo'"]


def test_wrong_type_and_missing_field(tmp_path):
    text = builtin_targets()["arm_2tpu"].read_text()
    text = text.replace("    count: 2\n", "    count: two\n").replace("description: quad-core", "descr: quad-core")
    p = _write(tmp_path, text)
    notes = _problems(p)
    count_line = text.splitlines().index("    count: two") + 1
    assert any(n.startswith(f"{p}:{count_line}: field 'devices.1.count'") for n in notes), notes
    top = text.splitlines().index("name: arm_2tpu") + 1  # a missing key points at its mapping
    assert f"{p}:{top}: missing field 'description'" in notes
    assert any("unknown key 'descr'" in n for n in notes)


def test_physical_devices_must_match_count(tmp_path):
    text = builtin_targets()["arm_2tpu"].read_text().replace('physical: ["usb:0", "usb:1"]', 'physical: ["usb:0"]')
    notes = _problems(_write(tmp_path, text))
    assert any("physical lists 1 devices but count is 2" in n for n in notes)


def test_not_yaml_and_unknown_target(tmp_path):
    p = _write(tmp_path, "name: [unclosed\n")
    with pytest.raises(UsageError, match=r"t.yaml:\d+: not valid YAML"):
        load_target(p)
    with pytest.raises(UsageError, match="unknown target 'nope'") as e:
        load_target("nope")
    assert "arm_2tpu" in e.value.hint


def test_schema_is_json_schema_with_device_union():
    schema = target_schema()
    text = json.dumps(schema)
    assert schema["title"] == "edgesdk target"
    for kind in ("CpuDevice", "EdgeTpuDevice", "GpuDevice"):
        assert kind in schema["$defs"]
    assert '"additionalProperties": false' in text


def test_layer_overhead_is_an_optional_cpu_figure(tmp_path):
    arm, _ = load_target("arm_2tpu")
    assert arm.host.layer_overhead is not None and arm.host.layer_overhead.unit == "us"
    for name in ("x86", "rtx3090"):
        assert load_target(name)[0].host.layer_overhead is None
    # a figure like any other: a value > 0 with a source; on an Edge TPU it is an unknown key
    text = builtin_targets()["arm_2tpu"].read_text()
    bad, n = re.subn(r"(    layer_overhead:\n      value: )[0-9.]+", r"\g<1>-1.0", text)
    assert n == 1
    p = _write(tmp_path, bad)
    line = bad.splitlines().index("      value: -1.0") + 1
    assert any(n.startswith(f"{p}:{line}: field 'devices.0.layer_overhead.value'") for n in _problems(p))
    misplaced = text.replace("    on_chip_memory:\n", "    layer_overhead: {value: 1.0, unit: us, source: nowhere}\n"
                             "    on_chip_memory:\n")
    assert any("unknown key 'devices.1.layer_overhead'" in n for n in _problems(_write(tmp_path, misplaced)))


def test_cpu_backend_figures_are_optional_and_checked(tmp_path):
    text = builtin_targets()["x86"].read_text()
    entry = ("    backends:\n      litert:\n        kernel_overhead: {value: 2.5, unit: us, source: edgesdk calibrate}\n"
             "        peak_gflops:\n          float32: {value: 150.0, unit: GFLOP/s, source: edgesdk calibrate}\n")
    good = text.replace("    step_dispatch:\n", entry + "    step_dispatch:\n")
    t, _ = load_target(_write(tmp_path, good))
    own = t.host.backends["litert"]
    assert own.kernel_overhead.value == 2.5 and own.peak_gflops["float32"].value == 150.0
    assert own.memory_bandwidth is None and own.layer_overhead is None  # the CPU's own
    # an entry is a mapping of figures like the CPU's: an unknown key, a bad value, a bad name are refused
    bad = good.replace("        kernel_overhead: {value: 2.5,", "        turbo: yes\n        kernel_overhead: {value: -2.5,")
    p = _write(tmp_path, bad)
    problems = _problems(p)
    line = bad.splitlines().index("        turbo: yes") + 1
    assert any(n.startswith(f"{p}:{line}: unknown key 'devices.0.backends.litert.turbo'") for n in problems)
    assert any("devices.0.backends.litert.kernel_overhead.value" in n for n in problems)
    assert any("backends.Lite RT" in n for n in _problems(_write(tmp_path, good.replace("      litert:", "      Lite RT:"))))


@pytest.mark.parametrize("device, field", [(0, "peak_gflops"), (1, "peak_tflops")])
def test_a_cpu_or_gpu_without_a_float32_rate_is_refused(tmp_path, device, field):
    """float32 is the rate every float node is costed at (devices/cpu.py, gpu.py); a target without it
    used to validate and then fail in the schedule stage (KeyError, exit 3; found by tests/fuzz)."""
    lines = builtin_targets()["rtx3090"].read_text().splitlines()
    start = lines.index("    peak_gflops:" if device == 0 else "    peak_tflops:")
    rate = start + 1  # float32 comes first, then its value, unit and source
    assert lines[rate].strip() == "float32:"
    p = _write(tmp_path, "\n".join(lines[:rate] + lines[rate + 4:]) + "\n")
    assert any(n.startswith(f"{p}:{start + 1}: field 'devices.{device}.{field}'") and "no float32 rate" in n
               for n in _problems(p))
