"""The Bridge drop-in through Transformer Engine on a GPU: Megatron-Bridge's own `train_step` (its
GPT forward step and loss, Megatron-Core's DistributedDataParallel and `finalize_model_grads`, the
mixed-precision optimizer), with `trainer_client.megatron_bridge.enable(cfg)`, four ranks on one GPU
(DP2 x CP2, gloo; point-to-point staged through the CPU: tests/trainer_client/transformer_engine/staged_p2p.py), a
GPTModel on Megatron-Core's Transformer Engine layer spec in bf16 (tests/trainer_client/megatron_bridge/dropin_ranks.py's
model and data: packed micro-batches of long and short samples, lengths that are not multiples of
2 x CP). Plans are made in-process by the drop-in (Megatron-Core's own scheduler code).

Per step: the loss Bridge reports equals the whole samples' (each alone, CP1, on the same weights),
and every gradient after `finalize_model_grads` (DDP's main_grad, reduced over DP x CP and divided by
the step's tokens) equals the whole samples' gradient over their tokens, within the bf16 tolerance
(support.py). Needs Megatron-Bridge (scripts/gpu/bundle --bridge); skipped, saying so, without it."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from tests.support.attention_ranks import run_attention_ranks
from tests.trainer_client.transformer_engine.support import DEADLINE_SECONDS, TOLERANCE, record_measurements, require_transformer_engine

pytestmark = [pytest.mark.attention, pytest.mark.timeout(DEADLINE_SECONDS + 60)]

WORLD = 4
STEPS = 2
PLANNER = {"scheduler_implementation": "upstream"}  # in-process, Megatron-Core's own code (no compile per rank)
BF16 = {"bf16": True, "params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16, "use_cpu_initialization": False,
        "hidden_size": 128, "num_attention_heads": 4}


def _reference(module, samples, device) -> tuple[float, float, dict[str, torch.Tensor]]:
    """Each whole sample alone at CP1 on the model inside DDP, forward and backward: the loss sum,
    the tokens, and the summed gradient (DDP's hooks sum each pass into main_grad, in fp32)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from tests.trainer_client.megatron_bridge.dropin_ranks import solo_group

    loss, tokens = 0.0, 0.0
    for s in samples:
        n = int(s["tokens"].shape[0])
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                                 max_seqlen_q=n, max_seqlen_kv=n, local_cp_size=1, cp_group=solo_group())
        per_token = module(input_ids=s["tokens"][None].to(device), position_ids=s["position_ids"][None].to(device), attention_mask=None,
                           labels=s["labels"][None].to(device), packed_seq_params=params)
        mask = s["loss_mask"].to(device)
        sample_loss = (per_token.reshape(-1).float() * mask).sum()
        sample_loss.backward()
        loss += float(sample_loss.detach())
        tokens += float(mask.sum())
    return loss, tokens, {name: p.main_grad.detach().float().clone() for name, p in module.named_parameters()}


def bridge_rank(engine: str, rank: int) -> dict:
    """One rank's steps. `engine` "cpu-standin" (fp32, the attention stand-in; run inside
    CudaDeviceRequestsOnCpu with tests/trainer_client/megatron_bridge's import stand-in for Transformer Engine): a dry run
    of this harness on a machine without a GPU."""
    from megatron.bridge.training import train as bridge_train
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.rerun_state_machine import RerunDataIterator

    from tests.support.attention_parity import relative_l2
    from tests.trainer_client.megatron_bridge import dropin_ranks as ranks
    from trainer_client.megatron_bridge import active, disable, enable

    on_gpu = engine == "transformer-engine"
    overrides = dict(model=BF16, optimizer={"bf16": True}, ddp={"grad_reduce_in_fp32": True}) if on_gpu else {}
    cfg, state, model, optimizer, scheduler, pgs, p2p = ranks.start_rank(rank, WORLD, "", 1, 2, engine=engine, **overrides)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    snapshots: list[dict[str, torch.Tensor]] = []

    def finalize_and_keep(*args, **kwargs):  # the grads as the optimizer will read them
        finalize_model_grads(*args, **{"pg_collection": pgs, **kwargs})
        snapshots.append({n: p.main_grad.detach().float().clone() for n, p in model[0].module.named_parameters()})

    cfg.model.finalize_model_grads_func = finalize_and_keep
    assert enable(cfg, planner=PLANNER)
    dp_rank, dp = pgs.dp.rank(), pgs.dp.size()
    data = RerunDataIterator(ranks.CountingIterator(dp_rank, STEPS + 2))
    module = model[0].module
    fbf = bridge_train.get_forward_backward_func(pp_size=1, vp_size=None)
    steps = []
    for step in range(STEPS):
        # As train_step starts: the optimizer's step left each param.grad aliasing its main_grad.
        optimizer.zero_grad()
        for chunk in model:
            chunk.zero_grad_buffer()
        want_loss, want_tokens, want = _reference(module, ranks.global_samples(step, dp), device)
        for chunk in model:
            chunk.zero_grad_buffer()
        snapshots.clear()
        losses, *_ = bridge_train.train_step(ranks.forward_step(state), data, model, optimizer, scheduler, state,
                                             pgs, fbf, p2p)
        got = snapshots[-1]
        worst = max((relative_l2(got[name], want[name] / want_tokens), name) for name in want)
        plan = active().planned_iterator(data, ranks.MICRO_BATCHES, pgs).last_step.plan
        steps.append({
            "loss": float(losses["lm loss"]), "reference": want_loss / want_tokens,
            "loss_difference": abs(float(losses["lm loss"]) - want_loss / want_tokens) / abs(want_loss / want_tokens),
            "gradients": worst[0], "worst_gradient": worst[1], "params": len(want),
            "cp_sizes": sorted({g.size for mb in plan.micro_batches for g in mb.cp_groups}),
        })
    disable()
    return {"steps": steps, "dp_cp_ranks": dist.get_process_group_ranks(pgs.dp_cp)}


def test_bridge_train_step_through_transformer_engine_trains_as_whole_samples(tmp_path):
    require_transformer_engine()
    pytest.importorskip("megatron.bridge", reason="needs Megatron-Bridge 0.6.2 (scripts/gpu/bundle --bridge)")
    per_rank = run_attention_ranks(partial(bridge_rank, "transformer-engine"), WORLD, tmp_path, DEADLINE_SECONDS, on_gpu=True)
    record_measurements("bridge_train_step", per_rank)
    assert all("raised" not in r for r in per_rank), [r.get("raised") for r in per_rank]
    for r in per_rank:
        assert len(r["steps"]) == STEPS, r
        assert any(size > 1 for step in r["steps"] for size in step["cp_sizes"]), r
        for step in r["steps"]:
            assert step["loss_difference"] <= TOLERANCE and step["gradients"] <= TOLERANCE and step["params"] > 0, step
