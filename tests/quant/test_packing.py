"""tandem.quant.packing against hand-computed words, the tests' own packer, and compressed-tensors'
``pack_to_int32`` (the published packer: same low-bits-first order; it takes signed values)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.quant.awq import natural_columns
from tandem.quant.packing import awq_interleave, pack_int32, unpack_int32, unpack_int32_planes
from tests.quant.formats import AWQ_ORDER, pack_words, unpack_words


def _published_packer():
    """compressed-tensors (the test extra installs it; a bare GPU machine may lack it)."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    return helpers.pack_to_int32


def _as_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def test_gptq_packs_eight_inputs_low_bits_first():
    values = torch.arange(1, 9, dtype=torch.int32).reshape(8, 1)       # inputs 0..7 of one output
    assert pack_int32(values, 4, dim=0).item() == _as_int32(0x87654321)
    assert torch.equal(unpack_int32(pack_int32(values, 4, dim=0), 4, dim=0).int(), values)


def test_eight_bit_words_hold_four_values():
    values = torch.tensor([[0x12, 0x34, 0x56, 0xF8]], dtype=torch.int32)
    assert pack_int32(values, 8, dim=1).item() == _as_int32(0xF8563412)


def test_awq_interleaves_columns_0_2_4_6_1_3_5_7():
    columns = torch.arange(1, 9, dtype=torch.int32).reshape(1, 8)      # outputs 0..7 of one input
    word = pack_int32(awq_interleave(columns), 4, dim=1)
    assert word.item() == _as_int32(0x86427531)
    assert torch.equal(unpack_int32_planes(word, 4).flatten(-2).int(), torch.tensor([[1, 3, 5, 7, 2, 4, 6, 8]]))
    assert torch.equal(natural_columns(unpack_int32_planes(word, 4).flatten(-2)).int(), columns)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_agrees_with_the_tests_packer(bits, dim):
    rng = np.random.default_rng(bits + dim)
    values = rng.integers(0, 2**bits, size=(32, 24))
    ours = pack_int32(torch.from_numpy(values), bits, dim)
    assert np.array_equal(ours.numpy(), pack_words(values, bits, axis=dim))
    assert np.array_equal(unpack_int32(ours, bits, dim).numpy(), values)


def test_awq_agrees_with_the_tests_packer():
    values = np.random.default_rng(0).integers(0, 16, size=(16, 32))
    ours = pack_int32(awq_interleave(torch.from_numpy(values)), 4, dim=1)
    assert np.array_equal(ours.numpy(), pack_words(values, 4, axis=1, order=AWQ_ORDER))
    assert np.array_equal(unpack_words(ours.numpy(), 4, axis=1, order=AWQ_ORDER), values)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_qweight_is_compressed_tensors_packing_along_the_input_dimension(bits):
    pack_to_int32 = _published_packer()
    q = torch.randint(0, 2**bits, (64, 40), generator=torch.Generator().manual_seed(bits))
    signed = (q - 2 ** (bits - 1)).to(torch.int8)
    assert torch.equal(pack_int32(q, bits, dim=0), pack_to_int32(signed, bits, packed_dim=0))


def test_awq_qweight_is_compressed_tensors_packing_of_the_interleaved_columns():
    pack_to_int32 = _published_packer()
    q = torch.randint(0, 16, (24, 64), generator=torch.Generator().manual_seed(3))
    interleaved = q[:, [8 * c + AWQ_ORDER[j] for c in range(8) for j in range(8)]]
    expected = pack_to_int32((interleaved - 8).to(torch.int8), 4, packed_dim=1)
    assert torch.equal(pack_int32(awq_interleave(q), 4, dim=1), expected)


def test_out_of_range_values_and_ragged_lengths_are_refused():
    with pytest.raises(ValueError, match="4-bit range"):
        pack_int32(torch.tensor([[16] * 8]), 4, dim=1)
    with pytest.raises(ValueError, match="cannot pack 6 values"):
        pack_int32(torch.zeros(1, 6, dtype=torch.int32), 4, dim=1)
    with pytest.raises(ValueError, match="3-bit"):
        pack_int32(torch.zeros(1, 32, dtype=torch.int32), 3, dim=1)
