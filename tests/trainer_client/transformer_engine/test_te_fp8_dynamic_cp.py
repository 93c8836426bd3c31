"""FP8 under dynamic CP through Transformer Engine on a GPU: the Megatron-LM drop-in
(`trainer_client.megatron_lm.wrap_data_iterator`, planned in process) derives the precision from
Megatron-Core's `fp8`/`fp8_recipe`, the planner pads each pass until every rank's rows are a
multiple of 16 (batch_planner/precision.py), and the drop-in packs each sample at the plan's length.
The model and the ranks are test_te_megatron_lm_dropin.py's: Megatron-Core's GPTModel on its
Transformer Engine layer spec, two layers 128 wide (QKV 384, MLP 512: every GEMM dimension but the
rows a multiple of 16), DP2 x CP2 on one GPU over gloo, each micro-batch read by Megatron-Core's
`get_batch_on_this_rank_for_sequence_packing` and run by its `forward_backward_no_pipelining`.

FP8: `fp8="hybrid"` (E4M3 forward, E5M2 gradients) with `fp8_recipe` "tensorwise" (current scaling)
or "delayed" (delayed scaling; amax history 1024, its max, as Transformer Engine's own default).
Megatron-Core's TransformerBlock enters Transformer Engine's FP8 autocast itself
(`megatron.core.fp8_utils.get_fp8_context`: around each layer for current scaling, around the whole
block for delayed), with the amax reduction group of DP x CP; the test records each TE linear
layer's `fp8` flag and recipe after the steps, and the runs below without the alignment show
Transformer Engine's FP8 checks refusing the rows, which no bf16 GEMM asks for.

- With the alignment (runs "aligned-current", "aligned-delayed"): two steps per recipe; the loss
  summed over the ranks equals the same model's, same recipe, over each whole sample alone at CP1
  (padded to 16 rows, loss mask 0: FP8 takes no other) within FP8_LOSS_TOLERANCE; and the
  gradients summed over DP x CP are no further from the same whole samples run in bf16 (the FP8
  context left out) than FP8_ERROR_RATIO times the whole samples' FP8 gradients are, plus
  FP8_ERROR_FLOOR (support.py says why FP8's own error is the yardstick). The precondition, from each step's plan (batch_planner.padding): the layout's
  padding alone would leave some rank's rows not a multiple of 16, the plan's leaves none, and the
  micro-batches the drop-in hands out hold the plan's rows.
- Without it (runs "bf16-plan-current", "bf16-plan-delayed"): the same step planned for bf16 (the
  drop-in's `megatron_precision` answering bf16 while the model runs FP8): Transformer Engine
  raises its FP8 dimension error (ValueError from `assert_dim_for_fp8_exec` for rows not a
  multiple of 8, RuntimeError from cuBLASLt's "Leading dimension requirement on A for FP8 GEMM"
  for 8 mod 16) in the first pass whose rows are not a multiple of 16, and in no earlier one;
  recorded with the message.
- Planted, and caught: the row rule off by one multiple (`ROW_RULES` giving 8 for current scaling,
  half of what the H100 needs): the plan's rows are multiples of 8, Transformer Engine's Python
  check passes, and cuBLASLt refuses the weight-gradient GEMM; and TE's partitioned indices asked
  for the next rank of the CP group (every shard rotated by one rank): the gradients miss that
  bound.

A pass that fails stops every rank after it (each pass runs alone, then the ranks agree whether any
failed; each run in ranks of its own): the failing pass's rows are the same on every rank of its
CP group, so its ranks fail at the same GEMM before any exchange of that pass; delayed scaling also
reduces amax over every rank in every pass, so its run without the alignment asks that the first
failing pass hold the same rows on every rank (tests/support/rank_rows.first_failure_is_shared),
and reports it otherwise.

    GPU_REPORT_DIR=$OUT scripts/gpu/run-tests tests/trainer_client/transformer_engine/test_te_fp8_dynamic_cp.py -q
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests.support.attention_ranks import run_attention_ranks
from tests.support.rank_rows import RECIPES
from tests.trainer_client.transformer_engine.support import (DEADLINE_SECONDS, FP8_ERROR_FLOOR, FP8_ERROR_RATIO, FP8_LOSS_TOLERANCE,
                                                             record_measurements, require_transformer_engine)

pytestmark = [pytest.mark.attention, pytest.mark.timeout(DEADLINE_SECONDS + 60)]  # a test starts one run of ranks at most

RANKS = 4  # DP2 x CP2
STEPS = 2
FP8_ROWS = 16  # rank_row_multiple(fp8, TP1): what the H100 takes (docs/gpu-benchmark-data/fp8-rows-h100.json)
TE_FP8_ERRORS = (
    "FP8 execution requires the product of all dimensions except the last to be divisible by 8",  # ValueError, rows % 8
    "Leading dimension requirement on A for FP8 GEMM",  # RuntimeError from cuBLASLt, rows % 16
)
CUBLAS_ERROR = TE_FP8_ERRORS[1]


def _model(engine: str, recipe: str):
    """The drop-in test's model (two layers, 128 wide on Transformer Engine, bf16 parameters) in
    FP8 with Megatron-Core's `recipe` (on the CPU stand-in, whose layers Transformer Engine does not
    run, the same config, in fp32)."""
    from tests.support.attention_model import AttentionModelConfig, attention_gpt_model
    from tests.support.rank_rows import FP8_FORMAT

    overrides = (("variable_seq_lengths", True), ("calculate_per_token_loss", True), ("fp8", FP8_FORMAT), ("fp8_recipe", recipe),
                 ("fp8_amax_history_len", 1024), ("fp8_amax_compute_algo", "max"))
    cfg = AttentionModelConfig(engine=engine, hidden_size=128 if engine == "transformer-engine" else 32, num_layers=2,
                               context_parallel_size=2, transformer_overrides=overrides)
    return [attention_gpt_model(cfg)]


def fp8_rank(jobs: list[str], engine: str, steps: int, rank: int) -> dict:
    """One rank: each of `jobs` on a model of its own ("current", "delayed": `steps` aligned steps;
    "rotated": one step with every CP shard rotated, current scaling; "bf16-plan:<recipe>",
    "half:current": one step's plan without the alignment, run pass by pass until one fails)."""
    from megatron.core import parallel_state

    from tests.support.attention_pipeline import stand_in_for_pipeline_calls_on_cpu
    from tests.support.dropin_attention import stand_in_for_te_partitioning_on_cpu

    stand_in_for_pipeline_calls_on_cpu()  # each a no-op where CUDA is (the GPU tests)
    stand_in_for_te_partitioning_on_cpu()
    parallel_state.initialize_model_parallel(context_parallel_size=2, dynamic_context_parallel=True)
    out: dict = {"rank": rank, "dp_cp_rank": parallel_state.get_data_parallel_rank(with_context_parallel=True), **_versions()}
    for job in jobs:
        how, _, recipe = job.partition(":")
        if how in RECIPES or how == "rotated":
            recipe = RECIPES["current" if how == "rotated" else how]
            out[job] = _aligned_steps(_model(engine, recipe), "rotated" if how == "rotated" else "none", 1 if how == "rotated" else steps)
        else:
            out[job] = _unaligned_step(_model(engine, RECIPES[recipe]), how)
    return out


def _versions() -> dict:
    """What ran: the GPU and Transformer Engine's version (None on the CPU)."""
    try:
        import transformer_engine
    except Exception:  # noqa: BLE001 - none here (the CPU), or one that cannot load: nothing to record
        return {"device": None, "transformer_engine": None}
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "transformer_engine": getattr(transformer_engine, "__version__", None)}


def _reference(samples, solo_group, device) -> list:
    """Each whole sample alone at CP1, padded to FP8_ROWS rows (token 0, loss mask 0, after the
    sample's real rows, outside its cu_seqlens): what an FP8 GEMM takes."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    from tests.support.attention_parity import RankShard

    extra = {"cp_partition_mode": "zigzag"} if any(f.name == "cp_partition_mode" for f in dataclasses.fields(PackedSeqParams)) else {}
    out = []
    for s in samples:
        n = len(s)
        p = -(-n // FP8_ROWS) * FP8_ROWS
        cu, cu_padded = torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, p], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                                 cu_seqlens_kv_padded=cu_padded, max_seqlen_q=p, max_seqlen_kv=p, local_cp_size=1, cp_group=solo_group, **extra)
        pad = p - n
        shard = RankShard(torch.cat([s.tokens, s.tokens.new_zeros(pad)]), torch.cat([s.labels, s.labels.new_zeros(pad)]),
                          torch.cat([s.loss_mask, s.loss_mask.new_zeros(pad)]), torch.arange(p), params)
        out.append(shard.to(device))
    return out


def _fed_rows(micro_batch: dict) -> int:
    """The rows this rank's linear layers take in a micro-batch the drop-in handed out: its packed
    buffer's padded tokens over its CP group's size (read before the forward step consumes it)."""
    return int(micro_batch["cu_seqlens_padded"][-1]) // int(micro_batch.get("local_cp_size", 1))


def _fp8_flags(models) -> dict:
    """Each Transformer Engine linear layer's FP8 state after a step: its `fp8` flag and recipe."""
    out = {}
    for name, module in models[0].named_modules():
        if "linear" in name and hasattr(module, "fp8_meta") and hasattr(module, "fp8"):
            meta = module.fp8_meta if isinstance(module.fp8_meta, dict) else {}
            out[name] = {"fp8": bool(module.fp8), "recipe": type(meta.get("recipe")).__name__ if meta.get("recipe") is not None else None}
    return out


def _plan_rows(planned) -> dict:
    """The step's plan, rows per rank per pass: with the layout's padding alone, with the plan's."""
    from batch_planner.padding import row_multiple_of

    from tests.support.rank_rows import rank_rows

    lengths = list(planned.layout.padded)
    return {"precision": planned.plan.precision.value, "row_multiple": row_multiple_of(planned.plan),
            "layout_only": rank_rows(planned.plan, lengths, 1), "planned": rank_rows(planned.plan, lengths, row_multiple_of(planned.plan))}


def _relative(got: dict, want: dict) -> tuple[float, float, str | None]:
    """`got` against `want` (full gradients, by parameter): the relative L2 over every parameter
    together, the worst parameter's and its name."""
    from tests.support.attention_parity import relative_l2

    difference = sum(float((got[n].double() - w.double()).norm()) ** 2 for n, w in want.items()) ** 0.5
    scale = sum(float(w.double().norm()) ** 2 for w in want.values()) ** 0.5
    worst = max(want, key=lambda n: relative_l2(got[n], want[n]))
    return (difference / scale if scale else difference), relative_l2(got[worst], want[worst]), worst


def fp8_errors(got: dict, want_fp8: dict, want_bf16: dict, group) -> dict:
    """The plan's FP8 gradients (this rank's share: summed over `group` here) and the whole samples'
    FP8 gradients, each against the whole samples' bf16 gradients (support.py, the FP8 tolerance)."""
    summed = {}
    for name in want_bf16:
        summed[name] = got[name].clone()
        dist.all_reduce(summed[name], group=group)
    plan, plan_worst, plan_worst_name = _relative(summed, want_bf16)
    whole, whole_worst, whole_worst_name = _relative(want_fp8, want_bf16)
    return {"dynamic_cp": plan, "whole_samples": whole, "bound": FP8_ERROR_RATIO * whole + FP8_ERROR_FLOOR,
            "dynamic_cp_worst": plan_worst, "dynamic_cp_worst_parameter": plan_worst_name,
            "whole_samples_worst": whole_worst, "whole_samples_worst_parameter": whole_worst_name}


def _aligned_steps(models, plant: str, steps: int) -> list[dict]:
    from contextlib import nullcontext

    from megatron.core import parallel_state
    from megatron.core.datasets import data_schedule_utils
    from megatron.core.transformer import transformer_block

    from tests.support.attention_parity import Fp32Grads, model_device
    from tests.support.attention_pipeline import _forward_step, run_pipeline
    from tests.support.dropin_attention import SAMPLES_PER_DP_RANK, dp_rank_items, packed_forward_step, packing_config, step_samples
    from tests.support.megatron_init import parallel_state_cp_group
    from tests.support.rank_rows import PLANNER
    from tests.trainer_client.transformer_engine.test_te_megatron_lm_dropin import _worst_gradient
    from trainer_client.megatron_lm import closing_wrapped, last_planned_step, wrap_data_iterator

    config = packing_config(models[0].config)
    grads = Fp32Grads(models)
    device = model_device(models[0])
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    data = iter(dp_rank_items(steps, dp_rank, dp_size))
    partition = data_schedule_utils.get_thd_partitioned_indices
    rotated = (lambda cu, total, cp, r: partition(cu, total, cp, (r + 1) % cp)) if plant == "rotated" else partition
    records = []
    with closing_wrapped():
        for step in range(steps):
            iterator, count, _, _ = wrap_data_iterator(data, config, SAMPLES_PER_DP_RANK, planner=PLANNER)
            planned = last_planned_step(data)
            micro_batches = [next(iterator) for _ in range(count)]
            fed = [_fed_rows(mb) for mb in micro_batches]
            grads.reset()
            with mock.patch.object(data_schedule_utils, "get_thd_partitioned_indices", rotated):
                loss, tokens, _ = run_pipeline(models, [iter(micro_batches)], count, packed_forward_step(config, None))
            got = grads.read()
            reference = _reference(step_samples(step, dp_size), parallel_state_cp_group(1), device)
            grads.reset()
            want_loss, want_tokens, _ = run_pipeline(models, [iter(reference)], len(reference), _forward_step)
            want = grads.read()
            grads.reset()  # the same whole samples in bf16: Megatron-Core's FP8 context left out
            with mock.patch.object(transformer_block, "get_fp8_context", lambda *args, **kwargs: nullcontext()):
                run_pipeline(models, [iter(reference)], len(reference), _forward_step)
            exact = grads.read()
            summed = torch.tensor([loss, tokens], device=device)
            dist.all_reduce(summed, group=dp_cp)
            worst, worst_name, largest_entry = _worst_gradient(got, want, dp_cp)
            records.append({
                "loss": float(summed[0]), "tokens": float(summed[1]), "reference": want_loss, "reference_tokens": want_tokens,
                "loss_difference": abs(float(summed[0]) - want_loss) / abs(want_loss),
                "gradients": worst, "worst_gradient": worst_name, "gradients_largest_entry": largest_entry, "params": len(want),
                "cp_sizes": sorted({g.size for mb in planned.plan.micro_batches for g in mb.cp_groups}),
                "micro_batches": count, "source": planned.source, "fed_rows": fed, **_plan_rows(planned),
                "fp8_layers": _fp8_flags(models), "fp8_error": fp8_errors(got, want, exact, dp_cp),
            })
    return records


def _unaligned_step(models, how: str) -> dict:
    """The first step planned without the alignment (`how`: "bf16-plan", planned for bf16; "half",
    the row rule at 8), run one pass at a time until a rank's pass raises; then every rank stops."""
    from megatron.core import parallel_state

    import batch_planner.precision as precision
    import trainer_client.dropin.settings as settings
    from batch_planner.precision import Precision, RowRule
    from tests.support.attention_pipeline import run_pipeline
    from tests.support.dropin_attention import SAMPLES_PER_DP_RANK, dp_rank_items, packed_forward_step, packing_config
    from tests.support.rank_rows import PLANNER, first_failure_is_shared
    from trainer_client.megatron_lm import closing_wrapped, last_planned_step, wrap_data_iterator

    config = packing_config(models[0].config)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    data = iter(dp_rank_items(1, dp_rank, dp_size))
    with ExitStack() as patches:
        if how == "bf16-plan":  # the model runs FP8; the drop-in plans as if it ran bf16
            patches.enter_context(mock.patch.object(settings, "megatron_precision", lambda config: Precision.BF16))
            # The refusal table refuses such a plan before the first step (its precision rows,
            # tests/trainer_client/test_precision_refusals.py); lifted here to show what Transformer
            # Engine itself does with it.
            import trainer_client.refusals.compatibility as compatibility

            patches.enter_context(mock.patch.object(compatibility, "_precision_differs", lambda value, inputs: False))
        else:  # planted: half the multiple the H100 needs
            planted = {p: RowRule(shard=8, gemm=8) for p in (Precision.FP8_CURRENT, Precision.FP8_DELAYED)}
            patches.enter_context(mock.patch.dict(precision.ROW_RULES, planted))
        with closing_wrapped():
            iterator, count, _, _ = wrap_data_iterator(data, config, SAMPLES_PER_DP_RANK, planner=PLANNER)
            planned = last_planned_step(data)
            micro_batches = [next(iterator) for _ in range(count)]
        plan = _plan_rows(planned)
    record = {**plan, "fed_rows": [_fed_rows(mb) for mb in micro_batches], "passes": [], "source": planned.source}
    delayed = str(getattr(config.fp8_recipe, "value", config.fp8_recipe)) == "delayed"
    if delayed and not first_failure_is_shared(plan["planned"], FP8_ROWS):
        record["skipped"] = "the first pass of rows not a multiple of 16 differs between ranks: delayed scaling's amax reduction would hang"
        return record
    forward_step = packed_forward_step(config, None)
    for index, micro_batch in enumerate(micro_batches):
        error = None
        try:
            run_pipeline(models, [iter([micro_batch])], 1, forward_step)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except Exception as raised:  # noqa: BLE001 - what Transformer Engine raises is the measurement
            error = f"{type(raised).__name__}: {raised}"
        record["passes"].append({"micro_batch": index, "rows": record["fed_rows"][index], "error": error})
        failed = torch.tensor([0.0 if error is None else 1.0])
        dist.all_reduce(failed)  # every rank stops after the pass in which any failed
        if float(failed) > 0:
            break
    record["fp8_layers"] = _fp8_flags(models)
    return record


# Each run of ranks, its jobs (fp8_rank) and its deadline: each recipe's aligned steps, then each run
# without the alignment, each in ranks of its own (a failed pass or run leaves nothing behind for the
# next); the runs without the alignment import Transformer Engine and run a pass or a few.
RUNS = {
    "aligned-current": (["current", "rotated"], DEADLINE_SECONDS),
    "aligned-delayed": (["delayed"], DEADLINE_SECONDS),  # its own ranks: delayed scaling reduces amax over gloo
    "bf16-plan-current": (["bf16-plan:current"], 150),
    "bf16-plan-delayed": (["bf16-plan:delayed"], 150),
    "half-current": (["half:current"], 150),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`runs(name)`: that run's ranks' records, run once when a test first asks (a run that failed
    fails every test that asks for it, without running again)."""
    require_transformer_engine()
    done: dict[str, object] = {}

    def run(name: str) -> list[dict]:
        if name not in done:
            jobs, deadline = RUNS[name]
            try:
                done[name] = run_attention_ranks(partial(fp8_rank, jobs, "transformer-engine", STEPS), RANKS,
                                                 tmp_path_factory.mktemp(name), deadline, on_gpu=True)
            except BaseException as error:
                done[name] = error
                raise
            record_measurements(f"fp8_dynamic_cp-{name}", done[name])
        if isinstance(done[name], BaseException):
            pytest.fail(f"the run {name!r} failed earlier in this module: {done[name]}")
        return done[name]

    return run


def _no_raise(per_rank: list[dict]) -> None:
    assert all("raised" not in r for r in per_rank), [r.get("raised") for r in per_rank]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fp8_steps_of_aligned_plans_train_as_whole_samples(runs, recipe):
    per_rank = runs(f"aligned-{recipe}")
    _no_raise(per_rank)
    for r in per_rank:
        assert len(r[recipe]) == STEPS, r
        for step in r[recipe]:
            assert step["precision"] == {"current": "fp8_current", "delayed": "fp8_delayed"}[recipe], step
            # The precondition: the layout's padding alone leaves rows FP8 refuses; the plan's none;
            # the drop-in hands out the plan's rows.
            assert any(n % FP8_ROWS for per_pass in step["layout_only"] for n in per_pass), step
            assert all(n % FP8_ROWS == 0 for per_pass in step["planned"] for n in per_pass), step
            assert step["fed_rows"] == [per_pass[r["dp_cp_rank"]] for per_pass in step["planned"]], step
            assert step["fp8_layers"] and all(layer["fp8"] for layer in step["fp8_layers"].values()), step["fp8_layers"]
            error = step["fp8_error"]
            assert step["params"] > 0 and error["dynamic_cp"] <= error["bound"], (r["dp_cp_rank"], recipe, error)
            assert step["tokens"] == step["reference_tokens"] > 0, step
            assert step["loss_difference"] <= FP8_LOSS_TOLERANCE, step


def _assert_refused(per_rank: list[dict], job: str, precision: str, only: str | None = None) -> None:
    """Every rank stopped after the same pass, the first whose rows are not a multiple of 16 on
    some rank; each pass that raised raised Transformer Engine's FP8 dimension error (`only`: that
    one) at rows not a multiple of 16, and every pass that ran held multiples of 16."""
    _no_raise(per_rank)
    records = [r[job] for r in per_rank]
    assert all("skipped" not in x for x in records), [x.get("skipped") for x in records]
    assert {x["precision"] for x in records} == {precision}, [x["precision"] for x in records]
    # The precondition: the plan leaves rows FP8 refuses, and the drop-in hands out the plan's rows.
    assert any(n % FP8_ROWS for per_pass in records[0]["planned"] for n in per_pass), records[0]["planned"]
    for r, x in zip(per_rank, records):
        assert x["fed_rows"] == [per_pass[r["dp_cp_rank"]] for per_pass in x["planned"]], (r["dp_cp_rank"], x)
    assert any(p["error"] is not None for x in records for p in x["passes"]), "no pass raised: the model ran no FP8 GEMM on rows FP8 refuses"
    for r, x in zip(per_rank, records):
        # The layers a failed pass reached ran under FP8 (those after it never ran: their flag is unset).
        assert any(layer["fp8"] for layer in x["fp8_layers"].values()), x["fp8_layers"]
        for p in x["passes"]:
            if p["error"] is None:
                assert p["rows"] % FP8_ROWS == 0, (r["dp_cp_rank"], p)  # Transformer Engine took rows FP8 refuses?
            else:
                assert p["rows"] % FP8_ROWS, (r["dp_cp_rank"], p)
                assert any(text in p["error"] for text in ((only,) if only else TE_FP8_ERRORS)), (r["dp_cp_rank"], p)
    stopped = {len(x["passes"]) for x in records}
    assert len(stopped) == 1, [x["passes"] for x in records]
    first_unaligned = next(m for m, per_pass in enumerate(records[0]["planned"]) if any(n % FP8_ROWS for n in per_pass))
    assert stopped == {first_unaligned + 1}, (first_unaligned, [x["passes"] for x in records])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_without_the_alignment_transformer_engine_refuses_the_rows(runs, recipe):
    _assert_refused(runs(f"bf16-plan-{recipe}"), f"bf16-plan:{recipe}", "bf16")


def test_planted_half_the_row_multiple_is_refused_by_cublaslt(runs):
    _assert_refused(runs("half-current"), "half:current", "fp8_current", only=CUBLAS_ERROR)
    assert {r["half:current"]["row_multiple"] for r in runs("half-current")} == {8}


def test_cp_shards_rotated_by_one_rank_miss_the_fp8_tolerance(runs):
    per_rank = runs("aligned-current")
    _no_raise(per_rank)
    for r in per_rank:  # the step's loss sums hundreds of tokens' errors, which partly cancel: the gradients tell
        assert all(step["fp8_error"]["dynamic_cp"] > step["fp8_error"]["bound"] for step in r["rotated"]), r["rotated"]
