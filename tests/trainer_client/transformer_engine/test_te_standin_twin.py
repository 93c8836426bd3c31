"""The CPU stand-in for Transformer Engine's THD/CP attention (tests/support/cp_attention_standin.py) against
the kernel it stands for, on a GPU: the same shards, cut as Transformer Engine documents them
(tests/support/attention_parity.te_zigzag_rows), through Megatron-Core's `TEDotProductAttention` (Transformer
Engine's THD kernels, its ring over the CP group) and through the stand-in, with the same
constructor and forward arguments Megatron-Core's `SelfAttention` gives core attention. Four ranks on
one GPU (the dev build's dynamic-CP groups), micro-batches of CP4, CP2 and CP1 groups over sequences
padded to 2 x CP (tests/trainer_client/attention/test_cp_attention_standin.py's "mixed" case).

Per shard: the outputs on real rows and the gradients of q, k and v agree within the bf16
tolerance (Transformer Engine computes in bf16, the stand-in in fp32 on the same bf16 values);
padding rows' outputs are 0 in both. A stand-in that reads the wrong chunks (planted: each rank's
chunks read as the next rank's) misses the tolerance: the twin catches a stand-in that has drifted
from the kernel."""

from __future__ import annotations

from functools import partial
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests.support.attention_parity import EXAMPLE_LENGTHS
from tests.support.attention_ranks import run_attention_ranks
from tests.trainer_client.transformer_engine.support import DEADLINE_SECONDS, TOLERANCE, record_measurements, require_transformer_engine

pytestmark = [pytest.mark.attention, pytest.mark.timeout(2 * DEADLINE_SECONDS + 60)]  # the fixture runs the ranks twice

WORLD = 4
HEADS, HEAD_DIM = 4, 32
# Micro-batches: {CP group's ranks: sample ids of EXAMPLE_LENGTHS}.
MICRO_BATCHES = [{(0, 1, 2, 3): [4, 0]}, {(0, 1): [2, 1], (2,): [0, 3], (3,): [5]}, {(2, 3): [6, 7]}]


def _global_inputs(sample_ids: list[int], cp_size: int, device) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """q, k, v and the output's gradient of the unsharded THD batch (each sample's values drawn from
    its own seed; padding rows zero), its cu_seqlens (real, padded), and each row's reality."""
    from tests.support.attention_parity import padded_to

    parts: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": [], "grad": []}
    real, padded, is_real = [0], [0], []
    for i in sample_ids:
        n = EXAMPLE_LENGTHS[i]
        p = padded_to(n, cp_size)
        g = torch.Generator().manual_seed(500 + i)
        for name in parts:
            width = (HEADS, HEAD_DIM) if name != "grad" else (HEADS * HEAD_DIM,)
            values = torch.randn(n, *width, generator=g)
            parts[name].append(torch.cat([values, values.new_zeros(p - n, *width)]))
        real.append(real[-1] + n)
        padded.append(padded[-1] + p)
        is_real.append(torch.arange(p) < n)
    tensors = {name: torch.cat(values).to(device=device, dtype=torch.bfloat16) for name, values in parts.items()}
    cu = torch.tensor(real, dtype=torch.int32, device=device), torch.tensor(padded, dtype=torch.int32, device=device)
    return tensors, cu, torch.cat(is_real)


def _run(attention, inputs: dict, rows: torch.Tensor, params, dtype) -> dict[str, torch.Tensor]:
    from megatron.core.transformer.enums import AttnMaskType

    q, k, v = (inputs[name][rows].to(dtype).detach().requires_grad_() for name in ("q", "k", "v"))
    out = attention(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    out.backward(inputs["grad"][rows].to(out.dtype))
    return {"out": out.detach().float(), "dq": q.grad.float(), "dk": k.grad.float(), "dv": v.grad.float()}


def _twin_rank(plant: str, kernel_engine: str, rank: int) -> dict:
    """One rank's shards through the kernel and the stand-in. `kernel_engine` "cpu-standin" puts a
    second stand-in in the kernel's place: a dry run of this harness on a machine without a GPU."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    import tests.support.cp_attention_standin as standin_module
    from tests.support.attention_model import AttentionModelConfig, transformer_config
    from tests.support.attention_parity import te_zigzag_rows
    from tests.support.megatron_init import initialize_dpxcp_groups, parallel_state_cp_group

    initialize_dpxcp_groups(context_parallel_size=2)
    if kernel_engine == "transformer-engine":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    config = transformer_config(AttentionModelConfig(engine=kernel_engine, hidden_size=HEADS * HEAD_DIM, context_parallel_size=2))
    standin = standin_module.TeThdCpAttentionStandIn(config, 1, AttnMaskType.causal, "self")
    if kernel_engine == "transformer-engine":
        kernel = TEDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        kernel, device = standin_module.TeThdCpAttentionStandIn(config, 1, AttnMaskType.causal, "self"), torch.device("cpu")
    original = standin_module._chunk_positions
    misread = (lambda padded, c, r: original(padded, c, (r + 1) % c)) if plant == "misread" else original
    shards = []
    for index, micro_batch in enumerate(MICRO_BATCHES):
        for ranks, sample_ids in micro_batch.items():
            if rank not in ranks:
                continue
            group = parallel_state_cp_group(len(ranks))
            cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
            inputs, (cu, cu_padded), is_real = _global_inputs(sample_ids, cp_size, device)
            rows = te_zigzag_rows(cu_padded.cpu(), cp_size, cp_rank).to(device) if cp_size > 1 else torch.arange(int(cu_padded[-1]), device=device)
            longest = int((cu_padded[1:] - cu_padded[:-1]).max())
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                                     cu_seqlens_kv_padded=cu_padded, max_seqlen_q=longest, max_seqlen_kv=longest,
                                     local_cp_size=cp_size, cp_group=group, cp_partition_mode="zigzag")
            got = _run(kernel, inputs, rows, params, torch.bfloat16)
            with mock.patch.object(standin_module, "_chunk_positions", misread):
                want = _run(standin, inputs, rows, params, torch.float32)
            real = is_real.to(device)[rows]
            record = {"micro_batch": index, "cp_size": cp_size, "rows": int(rows.numel()), "padding_rows": int((~real).sum()),
                      "padding_output": {"transformer_engine": float(got["out"][~real].abs().max()) if (~real).any() else 0.0,
                                         "standin": float(want["out"][~real].abs().max()) if (~real).any() else 0.0}}
            for name in ("out", "dq", "dk", "dv"):
                scale = float(want[name][real].abs().max())
                record[name] = float((got[name][real] - want[name][real]).abs().max()) / scale
            shards.append(record)
    return {"shards": shards}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, list[dict]]:
    """Every shard's comparison, by plant ("none", "misread"), over all ranks."""
    require_transformer_engine()
    out = {}
    for plant in ("none", "misread"):
        per_rank = run_attention_ranks(partial(_twin_rank, plant, "transformer-engine"), WORLD, tmp_path_factory.mktemp(plant),
                                       DEADLINE_SECONDS, on_gpu=True)
        record_measurements(f"standin_twin-{plant}", per_rank)
        assert all("raised" not in r for r in per_rank), per_rank
        out[plant] = [s for r in per_rank for s in r["shards"]]
    return out


def test_the_standin_and_transformer_engine_give_the_same_outputs_and_gradients(shards):
    compared = shards["none"]
    assert {s["cp_size"] for s in compared} == {1, 2, 4} and sum(s["padding_rows"] for s in compared) > 0, compared
    for s in compared:
        assert max(s[name] for name in ("out", "dq", "dk", "dv")) <= TOLERANCE, s
        assert s["padding_output"] == {"transformer_engine": 0.0, "standin": 0.0}, s


def test_a_standin_that_reads_the_wrong_chunks_misses(shards):
    misread = [s for s in shards["misread"] if s["cp_size"] > 1]
    assert misread and all(max(s[name] for name in ("out", "dq", "dk", "dv")) > TOLERANCE for s in misread), misread
