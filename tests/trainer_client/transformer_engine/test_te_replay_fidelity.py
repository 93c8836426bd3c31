"""The replay's attention (bench/gpu/replay, docs/gpu-replay.md) issues the same fused-attention
calls as Transformer Engine's CP attention does over real ranks.

Real ranks: four processes on the one GPU (the transport between them stood in by
tests/trainer_client/transformer_engine/staged_p2p.py), Megatron-Core's `TEDotProductAttention` on each rank's
DualChunkSwap share of a CP2 and a CP4 group's micro-batch (odd lengths, every sequence padded),
forward and backward. The replay: one process, each rank of each group in turn, its peers the
replay's in-process stand-in (bench/gpu/replay/in_process_peers.py), its inputs from
`bench.gpu.replay.kernels.attention_inputs`. Both record every call of Transformer Engine's
`fused_attn_fwd` and `fused_attn_bwd` (bench/gpu/replay/fused_calls.py): direction, q/k/v shapes,
mask, layout, maximum lengths and the four cu_seqlens. They must be equal, rank by rank.

Planted, and caught: the replay running the group's whole sequences on every rank
("whole_sequence"), and every rank told it is rank 0 (“rank_zero”: the ring steps where a rank
attends to half of a peer's keys and values are dropped)."""

from __future__ import annotations


import pytest
import torch

from tests.support.attention_ranks import run_attention_ranks
from tests.trainer_client.transformer_engine.support import DEADLINE_SECONDS, record_measurements, require_transformer_engine

pytestmark = [pytest.mark.attention, pytest.mark.timeout(2 * DEADLINE_SECONDS + 60)]

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
GROUPS = {"cp2": (2, [37, 100, 13]), "cp4": (4, [61, 200, 9])}  # name: (CP size, real lengths)
PLANTS = ("none", "whole_sequence", "rank_zero")


def _padded(real: list[int], cp: int) -> list[int]:
    from batch_planner.padding import padded_length
    from batch_planner.request import CpLayout

    return [padded_length(n, cp, 1, CpLayout.ZIGZAG) for n in real]


def _attention(context_parallel_size: int):
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from tests.support.attention_model import AttentionModelConfig, transformer_config

    config = transformer_config(AttentionModelConfig(engine="transformer-engine", hidden_size=HEADS * HEAD_DIM,
                                                     context_parallel_size=context_parallel_size,
                                                     transformer_overrides=(("num_query_groups", KV_HEADS),)))
    return TEDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _calls(attention, inputs) -> list[dict]:
    from bench.gpu.replay.fused_calls import record_fused_attention
    from bench.gpu.replay.kernels import core_attention_forward

    q, k, v, grad, params = inputs
    with record_fused_attention() as calls:
        core_attention_forward(attention, q, k, v, params).backward(grad)
        torch.cuda.synchronize()
    return [c.as_json() for c in calls]


def _real_rank(rank: int) -> dict:
    """One of four real ranks: its share of each group it belongs to, through the real ring."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from bench.gpu.replay.kernels import attention_inputs
    from tests.support.megatron_init import initialize_dpxcp_groups, parallel_state_cp_group

    initialize_dpxcp_groups(context_parallel_size=2)
    attention = _attention(2)
    out = {}
    for name, (cp, real) in GROUPS.items():
        if rank >= cp:
            continue
        padded = _padded(real, cp)
        q, k, v, grad, params = attention_inputs(HEADS, KV_HEADS, HEAD_DIM, real, padded, cp, rank)
        fields = {f: getattr(params, f) for f in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                                                  "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv", "cp_partition_mode")}
        real_params = PackedSeqParams(**fields, local_cp_size=cp, cp_group=parallel_state_cp_group(cp))  # the real group
        out[name] = _calls(attention, (q, k, v, grad, real_params))
    return out


def _replay_rank(rank: int) -> dict:
    """The replay's process: every rank of every group in turn, for each plant."""
    from bench.gpu.replay.in_process_peers import InProcessCpPeersStandIn
    from bench.gpu.replay.kernels import attention_inputs, init_world_of_one

    init_world_of_one()  # as the replay runs: one process, parallel_state without dynamic CP (it wants an even world)
    attention = _attention(1)
    out: dict = {}
    with InProcessCpPeersStandIn():
        for plant in PLANTS:
            for name, (cp, real) in GROUPS.items():
                for r in range(cp):
                    inputs = attention_inputs(HEADS, KV_HEADS, HEAD_DIM, real, _padded(real, cp), cp, r, plant)
                    out.setdefault(plant, {}).setdefault(name, []).append(_calls(attention, inputs))
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    require_transformer_engine()
    real = run_attention_ranks(_real_rank, 4, tmp_path_factory.mktemp("real"), DEADLINE_SECONDS, on_gpu=True)
    assert all("raised" not in r for r in real), real
    replay = run_attention_ranks(_replay_rank, 1, tmp_path_factory.mktemp("replay"), DEADLINE_SECONDS, on_gpu=True)[0]
    assert "raised" not in replay, replay
    result = {"real": real, "replay": replay}
    record_measurements("replay_fidelity_calls", result)
    return result


def test_the_replay_issues_the_fused_attention_calls_of_the_real_ring(recorded):
    for name, (cp, _) in GROUPS.items():
        for r in range(cp):
            want, got = recorded["real"][r][name], recorded["replay"]["none"][name][r]
            assert len(want) >= 2 * cp, (name, r, want)  # one forward and one backward call per ring step
            assert got == want, (name, r)


@pytest.mark.parametrize("plant", PLANTS[1:])
def test_a_planted_replay_issues_other_calls(recorded, plant):
    for name, (cp, _) in GROUPS.items():
        differing = [r for r in range(cp) if recorded["replay"][plant][name][r] != recorded["real"][r][name]]
        assert differing, (plant, name)
