"""A target's entries by kind: `Target.device(kind)`, `Target.devices_of(kind)` and the host."""

from __future__ import annotations

import pytest

from edgesdk.config import HOST, load_target
from edgesdk.errors import EXIT_USAGE, UsageError


def test_device_is_the_entry_of_its_kind():
    arm, _ = load_target("arm_2tpu")
    assert arm.device("edgetpu") is arm.devices[1]
    assert arm.device(HOST) is arm.host is arm.devices[0]
    assert arm.devices_of("edgetpu") == [arm.devices[1]]
    assert arm.devices_of("gpu") == []
    assert [d.kind for d in arm.accelerators] == ["edgetpu"]


def test_a_missing_kind_is_named():
    x86, _ = load_target("x86")
    with pytest.raises(UsageError) as e:
        x86.device("edgetpu")
    assert e.value.code == "target.no-device" and e.value.exit_code == EXIT_USAGE
    assert e.value.message == "target 'x86' has no edgetpu device"
    assert "its devices: cpu" in e.value.hint
