"""Weights and the KV pool on transparent huge pages (``tandem.models.huge_pages``). Oracles: the
kernel's own view of each mapping (``/proc/self/smaps``: the ``hg`` flag madvise(MADV_HUGEPAGE)
sets), the tensors' values before the move, and tandem's output with huge pages turned off.

The rest of the suite runs with them off (tests/conftest.py); every test here turns them on."""
from __future__ import annotations

import gc

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.models import huge_pages
from tandem.models.cpu_linear import BucketedLinear, PackedLinear, pack_cpu_linears
from tandem.models.huge_pages import HugePageArena, move_weights
from tests.helpers.tiny_models import load_tiny_model, tiny_model_dir

needs_thp = pytest.mark.skipif(not huge_pages.system_supports(), reason="no transparent huge pages on this system")


@pytest.fixture(autouse=True)
def _huge_pages_on(monkeypatch):
    """tandem's default (``TANDEM_CPU_HUGE_PAGES`` unset), which tests/conftest.py changes."""
    monkeypatch.delenv("TANDEM_CPU_HUGE_PAGES", raising=False)
    huge_pages.available.cache_clear()
    yield
    monkeypatch.undo()
    huge_pages.available.cache_clear()


def mapping_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (kernel's smaps)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def is_an_arena_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view into a larger buffer (an arena's mapping), not memory of its own
    from torch's allocator. (Whether malloc's memory shows ``hg`` depends on the process's history:
    the NIXL transport advises KV pools it registers, and malloc reuses such heap pages.)"""
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


@needs_thp
def test_arena_tensors_are_zeroed_aligned_apart_and_advised():
    arena = HugePageArena(chunk_bytes=4 << 20)
    shapes = [((3, 5), torch.float32), ((1000,), torch.bfloat16), ((1100, 1024), torch.float32), ((7,), torch.int64)]
    tensors = [arena.empty(shape, dtype) for shape, dtype in shapes]
    spans = []
    for t, (shape, dtype) in zip(tensors, shapes):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any() and t.data_ptr() % 64 == 0
        assert "hg" in mapping_flags(t.data_ptr())
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # no overlap
    # the third (4.3 MiB) does not fit the first 4 MiB chunk: a mapping of its own, 2 MiB aligned
    assert tensors[2].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert arena.bytes_handed_out == sum(t.numel() * t.element_size() for t in tensors)


@needs_thp
def test_a_tensor_keeps_its_mapping_after_the_arena_is_gone():
    arena = HugePageArena()
    source = torch.randn(300, 257)
    copy = arena.copy(source)
    del arena
    gc.collect()
    torch.testing.assert_close(copy, source, rtol=0, atol=0)
    copy.add_(1)  # still writable memory
    torch.testing.assert_close(copy, source + 1, rtol=0, atol=0)


@needs_thp
def test_move_weights_moves_parameters_and_packed_weights_once_each():
    model, _ = load_tiny_model(tiny_model_dir("llama"))
    pack_cpu_linears(model, "tandem", torch.device("cpu"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    packed = [m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), (PackedLinear, BucketedLinear))]
    packed_before = [p.weight.clone() for p in packed]
    distinct_before = len({p.data_ptr() for p in model.parameters()})
    moved = move_weights(model, min_bytes=0)
    assert moved > 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)
        assert "hg" in mapping_flags(p.data_ptr()), name
    for p, was in zip(packed, packed_before):
        torch.testing.assert_close(p.weight, was, rtol=0, atol=0)
        assert "hg" in mapping_flags(p.weight.data_ptr())
    assert len({p.data_ptr() for p in model.parameters()}) == distinct_before  # a shared tensor stays shared
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers(), *(p.weight for p in packed)]}
    assert moved == sum(t.numel() * t.element_size() for t in tensors.values())


def test_turned_off_nothing_moves(monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_HUGE_PAGES", "0")
    huge_pages.available.cache_clear()
    assert not huge_pages.available()
    model, _ = load_tiny_model(tiny_model_dir("llama"))
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert move_weights(model, min_bytes=0) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    t = HugePageArena().empty((4, 4), torch.float32)
    assert not t.any() and not is_an_arena_view(t)


@needs_thp
def test_an_engine_on_huge_pages_answers_as_one_without(monkeypatch):
    path = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    prompts = ["def main():", "import os\nimport sys"]
    llm = LLM(path, num_kv_blocks=64)
    worker = llm.engine.executor.worker
    assert "hg" in mapping_flags(worker.kv_cache.data_ptr())
    got = llm.generate(prompts, params)
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    plain = LLM(path, num_kv_blocks=64)
    assert is_an_arena_view(worker.kv_cache)
    assert not is_an_arena_view(plain.engine.executor.worker.kv_cache)
    want = plain.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
