"""Hostile target files: each is refused quickly with a usage error (exit 2)
that names the file and the line, before it can hang a build. Each input is built here, small.

The CLI cases run `edgesdk targets validate` in a subprocess whose timeout (30 s) only catches a
hang; the refusals take milliseconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgesdk.config import builtin_targets, load_target
from edgesdk.config.cpus import LLVM_CPUS
from edgesdk.config.target import MAX_FILE_BYTES
from edgesdk.errors import EXIT_USAGE, UsageError

ROOT = Path(__file__).resolve().parents[2]
X86 = (ROOT / "targets" / "x86.yaml").read_text()
GPU = (ROOT / "targets" / "rtx3090.yaml").read_text()
X86_CODEGEN = "codegen: {kind: llvm, mtriple: x86_64-linux-gnu, mcpu: haswell}"


def _line(text: str, needle: str, nth: int = 1) -> int:
    """1-based line of the nth line that contains `needle`."""
    return [i + 1 for i, line in enumerate(text.splitlines()) if needle in line][nth - 1]


def _alias_bomb(levels: int = 10) -> str:
    """Billion laughs as a codegen value: each level a list of ten aliases of the level below (two
    billion values in under 1 KB)."""
    lines = ["      lol0: &l0 [lol]"]
    for i in range(1, levels):
        lines.append(f"      lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]")
    return "codegen:\n" + "\n".join(lines)


def _case(name: str) -> tuple[str | bytes, str, int | None, str]:
    """(file content, error code, line the message names or None for the file alone, text in it)."""
    cores = _line(X86, "cores: 4")
    codegen = _line(X86, X86_CODEGEN)
    if name == "alias-bomb":
        text = X86.replace(X86_CODEGEN, _alias_bomb())
        # l4 stands for 21,111 values, the first level past MAX_VALUES
        return text, "target.too-large", _line(text, "lol4:"), "once its aliases are expanded"
    if name == "deep-lists":
        return X86.replace("mcpu: haswell}", "mcpu: haswell, x: " + "[" * 5000 + "]" * 5000 + "}"), \
            "target.too-deep", codegen, "nested more than 32 levels"
    if name == "deep-mappings":
        return X86.replace("mcpu: haswell}", "mcpu: haswell, x: " + "{a: " * 5000 + "1" + "}" * 5000 + "}"), \
            "target.too-deep", codegen, "nested more than 32 levels"
    if name == "recursive-alias":
        return X86.replace("mcpu: haswell}", "mcpu: haswell, x: &loop [*loop]}"), "target.yaml", codegen, \
            "alias *loop is inside the node it names"
    if name == "many-values":
        return X86.replace("mcpu: haswell}", "mcpu: haswell, x: [" + ", ".join(["0"] * 20_000) + "]}"), \
            "target.too-large", codegen, "more than 10000 values"
    if name == "not-utf8":
        data = X86.replace("description: x86-64", "description: caf\udce9 x86-64")
        return data.encode("utf-8", "surrogateescape"), "target.encoding", _line(X86, "description:"), \
            "not utf-8 text (byte 0xe9)"
    if name == "nul-character":
        return X86.replace("cores: 4", "cores: 4\x00"), "target.yaml", cores, "character #x0000 is not allowed"
    if name == "duplicate-key":
        text = X86.replace("    cores: 4\n", "    cores: 4\n    turbo: yes\n    cores: 8\n")
        return text, "target.duplicate-key", cores + 2, f"duplicate key 'cores' (first given at line {cores})"
    if name == "duplicate-key-in-flow-mapping":
        return X86.replace("mcpu: haswell}", "mcpu: haswell, mcpu: znver4}"), "target.duplicate-key", codegen, \
            "duplicate key 'mcpu'"
    if name == "huge-integer":
        return X86.replace("cores: 4", "cores: " + "9" * 5000), "target.yaml", cores, "an integer of 5000 digits"
    if name == "huge-file":
        return X86 + "#" * MAX_FILE_BYTES + "\n", "target.too-large", None, "over the 1048576 byte limit"
    if name.startswith("cores="):
        return X86.replace("cores: 4", f"cores: {name[6:]}"), "target.invalid", cores, "devices.0.cores"
    if name.startswith("value="):
        value = _line(X86, "value: 384.0")
        return X86.replace("value: 384.0", f"value: {name[6:]}"), "target.invalid", value, \
            "devices.0.peak_gflops.float32.value"
    if name.startswith("tag="):  # a tagged value PyYAML's constructor cannot read (found by tests/fuzz)
        tag, _, value = name[4:].partition(" ")
        return X86.replace("cores: 4", f"cores: {name[4:]}"), "target.yaml", cores, f"'{value}' is not a valid {tag}"
    if name == "unknown-mcpu":
        return X86.replace("mcpu: haswell", "mcpu: znver99"), "target.invalid", codegen, \
            "llvm knows no x86_64 cpu 'znver99'"
    raise KeyError(name)


CASES = ["alias-bomb", "deep-lists", "deep-mappings", "recursive-alias", "many-values", "not-utf8", "nul-character",
         "duplicate-key", "duplicate-key-in-flow-mapping", "huge-integer", "huge-file", "cores=1e30",
         "cores=1.0e+30", "cores=1.0e+18", "cores=100000", "value=.inf", "value=-.inf", "value=.nan",
         "value=1.0e+12", "unknown-mcpu", "tag=!!bool maybe", "tag=!!float abc", "tag=!!timestamp 2020-13-45"]


def _write(tmp_path: Path, content: str | bytes) -> Path:
    p = tmp_path / "t.yaml"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    return p


def _refusal(path: Path) -> UsageError:
    with pytest.raises(UsageError) as e:
        load_target(path)
    assert e.value.exit_code == EXIT_USAGE
    return e.value


def _where(path: Path, line: int | None) -> str:
    return f"{path}:{line}: " if line else f"{path}: "


@pytest.mark.parametrize("name", CASES)
def test_hostile_file_is_a_usage_error_at_its_line(tmp_path, name):
    content, code, line, needle = _case(name)
    p = _write(tmp_path, content)
    err = _refusal(p)
    assert err.code == code
    assert err.hint
    report = "\n".join([err.message, *err.notes])
    if code == "target.invalid":  # a schema problem: the summary, then one note per problem
        assert len(err.notes) == 1 and err.notes[0].startswith(_where(p, line)), err.notes
    else:
        assert err.message.startswith(_where(p, line)), err.message
    assert needle in report, report


@pytest.mark.parametrize("name", CASES)
def test_cli_refuses_hostile_file_without_traceback(tmp_path, name):
    content, _, line, needle = _case(name)
    p = _write(tmp_path, content)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "sdk")}
    proc = subprocess.run([sys.executable, "-m", "edgesdk.cli", "targets", "validate", str(p)],
                          capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("error: ") and any(x.startswith("hint: ") for x in lines), proc.stderr
    assert "Traceback" not in proc.stderr
    assert _where(p, line) in proc.stderr and needle in proc.stderr, proc.stderr


def test_cli_validates_the_shipped_targets():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "sdk")}
    for path in builtin_targets().values():
        proc = subprocess.run([sys.executable, "-m", "edgesdk.cli", "targets", "validate", str(path)],
                              capture_output=True, text=True, env=env, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"{path}: ok")


def test_aliases_within_the_bounds_load(tmp_path):
    # one figure given once and repeated: an alias is fine when what it expands to is small
    text = X86.replace("    kernel_overhead:\n", "    kernel_overhead: &estimate\n")
    text = text.replace("    step_dispatch:\n", "    layer_overhead: *estimate\n    step_dispatch:\n")
    t, _ = load_target(_write(tmp_path, text))
    assert t.host.layer_overhead == t.host.kernel_overhead


def test_a_merge_key_is_not_a_duplicate(tmp_path):
    # a key given again after `<<:` overrides the merged one: what merge keys are for
    text = X86.replace(X86_CODEGEN, "codegen: {<<: {kind: llvm, mtriple: x86_64-linux-gnu, mcpu: haswell}, "
                                    "mcpu: znver4}")
    assert load_target(_write(tmp_path, text))[0].host.codegen["mcpu"] == "znver4"


def test_every_duplicate_key_is_reported(tmp_path):
    text = X86.replace("    cores: 4\n", "    cores: 4\n    cores: 8\n") + "description: again\n"
    p = _write(tmp_path, text)
    err = _refusal(p)
    assert err.code == "target.duplicate-key"
    assert err.message == f"{p}:{_line(text, 'cores: 8')}: duplicate key 'cores' (first given at line " \
                          f"{_line(text, 'cores: 4')})"
    assert err.notes == [f"{p}:{_line(text, 'description: again')}: duplicate key 'description' (first given at "
                         f"line {_line(text, 'description: x86-64')})"]


def test_many_problems_are_counted_and_listed_up_to_a_limit(tmp_path):
    text = X86.replace("    cores: 4\n", "    cores: 4\n" + "".join(f"    k{i}: 1\n" for i in range(3000)))
    err = _refusal(_write(tmp_path, text))
    assert err.message.endswith("3000 problems in the target file")
    assert len(err.notes) == 21 and err.notes[-1].endswith("and 2980 more")


def test_codegen_is_a_tvm_target_with_known_keys(tmp_path):
    def notes(text: str) -> list[str]:
        return _refusal(_write(tmp_path, text)).notes

    line = _line(X86, X86_CODEGEN)
    assert notes(X86.replace("mcpu: haswell}", "mcpu: haswell, cl-opt: [-O3]}")) == [
        f"{tmp_path / 't.yaml'}:{line}: unknown key 'devices.0.codegen.cl-opt'"]
    assert "but arch is x86_64" in notes(X86.replace("x86_64-linux-gnu", "aarch64-linux-gnu"))[0]
    # the pattern as the schema writes it, not lowercased
    assert "should match pattern '^(x86_64|amd64|aarch64|arm64)(-[A-Za-z0-9_.]{1,32}){1,3}$'" in notes(
        X86.replace("x86_64-linux-gnu", "riscv64-linux-gnu"))[0]
    assert "'cortex-a53' is an aarch64 cpu, not x86_64" in notes(X86.replace("mcpu: haswell", "mcpu: cortex-a53"))[0]
    assert "devices.0.codegen.mattr.0" in notes(X86.replace("mcpu: haswell}", "mcpu: haswell, mattr: [avx2]}"))[0]
    assert "at most 64 characters" in notes(X86.replace("mcpu: haswell", "mcpu: " + "x" * 100))[0]
    # a GPU's codegen: cuda with an sm_ arch, and a host CPU that LLVM knows
    assert "devices.1.codegen.arch" in notes(GPU.replace("arch: sm_86", "arch: compute_86"))[0]
    host = notes(GPU.replace("mcpu: haswell}}", "mcpu: hasswell}}"))
    assert host == [f"{tmp_path / 't.yaml'}:{_line(GPU, 'kind: cuda')}: field 'devices.1.codegen.host.mcpu': "
                    "llvm knows no x86_64 cpu 'hasswell'"]
    # the keys a build may set still load, and the codegen stays the dict the stages hand to TVM
    fine = X86.replace("mcpu: haswell}", "mcpu: native, mattr: [+avx2, -avx512f], num-cores: 4, opt-level: 3}")
    assert load_target(_write(tmp_path, fine))[0].host.codegen == {
        "kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "native", "mattr": ["+avx2", "-avx512f"],
        "num-cores": 4, "opt-level": 3}
    gpu = GPU.replace("arch: sm_86,", "arch: sm_90a, max_shared_memory_per_block: 49152,")
    assert load_target(_write(tmp_path, gpu))[0].accelerators[0].codegen["arch"] == "sm_90a"


def test_mcpu_line_in_a_block_mapping_and_close_names_in_the_hint(tmp_path):
    text = X86.replace(X86_CODEGEN, "codegen:\n      kind: llvm\n      mtriple: x86_64-linux-gnu\n"
                                    "      mcpu: skylake-avx521")
    p = _write(tmp_path, text)
    err = _refusal(p)
    assert err.notes == [f"{p}:{_line(text, 'mcpu: skylake-avx521')}: field 'devices.0.codegen.mcpu': "
                         "llvm knows no x86_64 cpu 'skylake-avx521'"]
    assert "skylake-avx512" in err.hint and "native" in err.hint
    # an aarch64 device is checked against aarch64's names
    arm = builtin_targets()["arm_2tpu"].read_text().replace("mcpu: cortex-a53", "mcpu: cortex-a35x")
    assert "cortex-a35" in _refusal(_write(tmp_path, arm)).hint


def test_shipped_cpus_and_native_are_in_the_table():
    assert {"haswell", "x86-64-v3", "skylake-avx512", "znver4", "sapphirerapids"} <= LLVM_CPUS["x86_64"]
    assert {"cortex-a53", "cortex-a72", "neoverse-n1"} <= LLVM_CPUS["aarch64"]
    for path in builtin_targets().values():
        t, _ = load_target(path)
        assert t.host.codegen["mcpu"] in LLVM_CPUS[t.host.arch]


def test_cpu_table_is_what_tvms_llvm_knows():
    """Every name in the table is one TVM's LLVM accepts for the architecture, and the build host's
    own CPU (what `mcpu: native` and the benchmarks' host targets resolve to) is in it."""
    tvm = pytest.importorskip("tvm")
    from tvm.target import codegen

    triples = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}
    for arch, names in LLVM_CPUS.items():
        known = {str(c) for c in codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm",
                                                                                 "mtriple": triples[arch]}))}
        assert names <= known, sorted(names - known)
    host = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}[os.uname().machine]
    assert str(codegen.llvm_get_system_cpu()) in LLVM_CPUS[host]


def test_limits_hold_for_a_target_near_them(tmp_path):
    # sixteen devices is the most a target may list; physical ids, counts and figures at their bounds load
    arm = builtin_targets()["arm_2tpu"].read_text()
    tpu = arm[arm.index("  - kind: edgetpu\n"):arm.index("legalize:")]
    many = arm.replace(tpu, tpu * 15)
    assert len(load_target(_write(tmp_path, many))[0].devices) == 16
    err = _refusal(_write(tmp_path, arm.replace(tpu, tpu * 16)))
    assert any("devices" in n and "at most 16" in n for n in err.notes), err.notes
