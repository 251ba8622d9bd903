"""The arithmetic of parallelism, by hand-computed cases: which layers a stage holds, which KV
heads a tensor rank holds (replicated when there are fewer than ranks), how a step is cut into
micro-batches, and how a quantized tensor is cut — or refused — at its group boundaries."""
from __future__ import annotations

import pytest
import torch

from tandem.distributed import ParallelContext, check_tensor_parallel, stage_layers
from tandem.interfaces import TensorSplit
from tandem.sched.output import ForkedRequestData, SchedulerOutput
from tandem.worker.input_batch import split_microbatches


def test_stages_are_contiguous_and_the_earlier_ones_take_the_remainder():
    assert [list(stage_layers(10, 3, r)) for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [list(stage_layers(4, 2, r)) for r in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        stage_layers(2, 3, 0)


def test_kv_heads_split_or_replicate():
    # 8 KV heads over 4 ranks: 2 each
    assert [ParallelContext(tp_size=4, tp_rank=r).kv_head_split(8) for r in range(4)] == [(4, r) for r in range(4)]
    # 1 KV head over 2 ranks: both hold head 0; 2 heads over 4 ranks: ranks 0,1 → 0 and 2,3 → 1
    assert [ParallelContext(tp_size=2, tp_rank=r).kv_head_split(1) for r in range(2)] == [(1, 0), (1, 0)]
    assert [ParallelContext(tp_size=4, tp_rank=r).kv_head_split(2) for r in range(4)] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert ParallelContext(tp_size=4, tp_rank=3).num_local_kv_heads(2) == 1


@pytest.mark.parametrize("heads,kv,tp,match", [
    (6, 2, 4, "does not divide the model's 6 attention heads"),
    (8, 6, 4, "does not divide the model's 6 KV heads"),
    (12, 3, 6, None),
    (8, 3, 4, "cannot be replicated evenly"),
])
def test_head_counts_that_cannot_be_shared_are_refused(heads, kv, tp, match):
    if match is None:
        check_tensor_parallel(heads, kv, tp)
    else:
        with pytest.raises(ValueError, match=match):
            check_tensor_parallel(heads, kv, tp)


def test_the_driver_is_tensor_rank_0_of_the_last_stage():
    ranks = [ParallelContext(tp_size=2, tp_rank=r % 2, pp_size=2, pp_rank=r // 2) for r in range(4)]
    assert [c.rank for c in ranks] == [0, 1, 2, 3]
    assert [c.is_driver for c in ranks] == [False, False, True, False]
    assert ranks[0].driver_rank == 2


def test_microbatches_balance_tokens_and_keep_forks_and_drafts_with_their_request():
    out = SchedulerOutput(num_scheduled_tokens={"a": 30, "b": 2, "c": 1, "d": 29},
                          total_num_scheduled_tokens=62, spec_token_ids={"c": []},
                          forked_requests=[ForkedRequestData("d-1", "d", 1)])
    parts = split_microbatches(out, 2)
    assert [list(p.num_scheduled_tokens) for p in parts] == [["a", "b"], ["c", "d"]]
    assert [p.total_num_scheduled_tokens for p in parts] == [32, 30]
    assert parts[1].spec_token_ids == {"c": []} and parts[0].spec_token_ids == {}
    assert [f.request_id for f in parts[1].forked_requests] == ["d-1"] and not parts[0].forked_requests
    # never more parts than requests, never an empty one
    one = SchedulerOutput(num_scheduled_tokens={"a": 5}, total_num_scheduled_tokens=5)
    assert len(split_microbatches(one, 4)) == 1
    many = SchedulerOutput(num_scheduled_tokens={str(i): 1 for i in range(5)}, total_num_scheduled_tokens=5)
    assert [len(p.num_scheduled_tokens) for p in split_microbatches(many, 4)] == [2, 1, 1, 1]


def test_quantized_tensors_are_cut_at_group_and_word_boundaries():
    from tandem.quant.awq import AWQLinearMethod
    from tandem.quant.gptq import GPTQLinearMethod

    gptq = GPTQLinearMethod.from_config({"bits": 4, "group_size": 32, "sym": True})
    qweight = torch.arange(16 * 6).view(16, 6)         # [128 inputs / 8, 6 outputs]
    part = gptq.split_tensor("qweight", qweight, TensorSplit("input", 2, 1), 128)
    assert torch.equal(part, qweight[8:])
    scales = torch.arange(4 * 6).view(4, 6)            # [128 / 32 groups, 6 outputs]
    assert torch.equal(gptq.split_tensor("scales", scales, TensorSplit("input", 2, 1), 128), scales[2:])
    assert torch.equal(gptq.split_tensor("scales", scales, TensorSplit("output", 3, 2), 6), scales[:, 4:])
    g_idx = torch.arange(128) // 32
    assert torch.equal(gptq.split_tensor("g_idx", g_idx, TensorSplit("input", 2, 1), 128), torch.arange(64) // 32)
    with pytest.raises(ValueError, match=r"scales of shape \(4, 6\): 128 inputs do not split into 8 parts of whole 32-input"):
        gptq.split_tensor("scales", scales, TensorSplit("input", 8, 0), 128)

    awq = AWQLinearMethod.from_config({"bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"})
    qzeros = torch.arange(4 * 2).view(4, 2)             # [groups, 16 outputs / 8]
    assert torch.equal(awq.split_tensor("qzeros", qzeros, TensorSplit("output", 2, 1), 16), qzeros[:, 1:])
    with pytest.raises(ValueError, match="8 outputs do not split into 2 parts of whole 8-output"):
        awq.split_tensor("qzeros", qzeros[:, :1], TensorSplit("output", 2, 0), 8)
