"""``model.dtype = "auto"`` and ``engine.device = "auto"`` against the table of tandem.device."""
from __future__ import annotations

import pytest
import torch

from tandem import device as tdevice
from tandem.device import cpu_flags, cpu_has_native_bf16, resolve_device, resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def native_bf16(monkeypatch):
    def set_native(value: bool) -> None:
        monkeypatch.setattr(tdevice, "cpu_has_native_bf16", lambda: value)
    return set_native


@pytest.mark.parametrize("device, checkpoint, native, expected", [
    (CUDA, "bfloat16", False, torch.bfloat16),
    (CUDA, "float16", False, torch.bfloat16),
    (CUDA, "float32", False, torch.bfloat16),
    (CUDA, None, False, torch.bfloat16),
    (CPU, "torch.bfloat16", True, torch.bfloat16),
    (CPU, "bfloat16", True, torch.bfloat16),
    (CPU, "bfloat16", False, torch.float32),
    (CPU, "float16", True, torch.bfloat16),
    (CPU, "float16", False, torch.float32),
    (CPU, "float32", True, torch.float32),
    (CPU, None, True, torch.float32),
])
def test_auto_dtype(device, checkpoint, native, expected, native_bf16):
    native_bf16(native)
    assert resolve_dtype("auto", device, checkpoint) == expected


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_explicit_dtype_wins(name, native_bf16):
    native_bf16(True)
    for device in (CPU, CUDA):
        assert resolve_dtype(name, device, "bfloat16") == getattr(torch, name)


def test_native_bf16_from_cpu_flags(tmp_path):
    def flags(line: str):
        path = tmp_path / f"cpuinfo{len(list(tmp_path.iterdir()))}"
        path.write_text(f"processor\t: 0\nmodel name\t: x\n{line}\n\nprocessor\t: 1\n{line}\n")
        return cpu_has_native_bf16(path)

    assert flags("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni")
    assert flags("flags\t\t: fpu avx2 amx_tile amx_bf16 amx_int8")
    assert not flags("flags\t\t: fpu sse2 avx2 avx512f avx512bw")  # AVX-512 without BF16
    assert not cpu_has_native_bf16(tmp_path / "missing")


def test_cpu_flags_are_the_first_flags_or_features_line(tmp_path):
    x86, arm, missing = tmp_path / "x86", tmp_path / "arm", tmp_path / "missing"
    x86.write_text("processor\t: 0\nmodel name\t: x\nflags\t\t: fpu avx2 avx512_vnni\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512_vnni"}
    assert cpu_flags(arm) == {"fp", "asimd", "sve"}
    assert cpu_flags(missing) == frozenset()


def test_auto_device():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_available_memory_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   1000 kB\nSwapFree:  2 kB\n")
    assert tdevice.available_memory_bytes(CPU, meminfo) == (1000 * 1024, 2 * 1024)
    assert tdevice.available_memory_bytes(CPU, tmp_path / "missing") is None


@pytest.mark.parametrize("available, pageable, outcome", [
    (10 << 30, 0, "fits"), (4 << 30, 8 << 30, "warns"), (4 << 30, 1 << 30, "refused"),
])
def test_weights_that_cannot_fit_are_refused(available, pageable, outcome, monkeypatch, caplog):
    monkeypatch.setattr(tdevice, "available_memory_bytes", lambda device: (available, pageable))
    need = 8 << 30
    if outcome == "refused":
        with pytest.raises(ValueError, match=r"need 8.0 GiB in float32 but cpu has 4.0 GiB.*--dtype bfloat16"):
            tdevice.check_weights_fit(need, CPU, torch.float32)
        return
    tdevice.check_weights_fit(need, CPU, torch.float32)
    assert ("swap" in caplog.text) == (outcome == "warns")
