"""examples/titan_style_dropin.py, a drop-in that hooks a method of a loop that is not Megatron's: a
minimal torchtitan-style `Trainer` (below) whose `train_step(data_iterator)` pulls one list of samples
a step and trains each whole, normalising the loss over the step's loss tokens of every rank and
all-reducing the gradients over every rank. Four gloo ranks DP2 x CP2 (the seam's dpxcp_groups), a
real planner on loopback, lengths that are not multiples of 2 x CP (tests/support/dropin_attention),
the attention model with the CPU stand-in for Transformer Engine's THD/CP attention
(tests/support/attention_model.py).

With the drop-in enabled, each step, in both CP layouts: the trainer's loss and every gradient (as
it all-reduces them, before its optimizer steps) equal the same model over each whole sample alone
(no CP) with the parameters the step started from; every real token is trained exactly once; the
step has CP groups of more than one size, and CP groups that pad; the end of the data ends the loop
on every rank; `disable` gives the trainer its own train_step back. The example is 60 code lines or
fewer."""

from __future__ import annotations

import ast
import io
import tokenize
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.attention_ranks import require_dynamic_build, run_attention_ranks
from tests.support.dropin_attention import assert_planned_step

WORLD, CP, STEPS = 4, 2, 3
LAYOUTS = ("zigzag", "contiguous")
LEARNING_RATE = 0.05  # the steps after the first start from parameters the planned steps trained
TOLERANCE = 1e-4  # fp32 on the CPU: only the order of additions differs
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "titan_style_dropin.py"
MAX_CODE_LINES = 60


class Trainer:
    """torchtitan's shape, reduced: the loop calls `train_step(data_iterator)` once a step, and the
    step pulls its samples from the iterator. `forward(sample)` gives a sample's per-token losses."""

    def __init__(self, model: torch.nn.Module, forward) -> None:
        self.model, self.forward = model, forward
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        self.records: list[dict] = []  # per step: its loss, the gradients it stepped with, its loss tokens

    def train_step(self, data_iterator) -> float:
        samples = next(data_iterator)
        loss_tokens = torch.tensor([sum(float(s["loss_mask"].sum()) for s in samples)])
        dist.all_reduce(loss_tokens)  # the step's loss tokens, over every rank
        self.optimizer.zero_grad()
        loss = torch.zeros(1)
        for sample in samples:
            sample_loss = (self.forward(sample) * sample["loss_mask"].reshape(-1)).sum() / loss_tokens
            sample_loss.backward()
            loss += sample_loss.detach()
        dist.all_reduce(loss)
        grads = {}
        for name, p in self.model.named_parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            dist.all_reduce(p.grad)
            grads[name] = p.grad.clone()
        self.records.append({"loss": float(loss), "grads": grads, "loss_tokens": float(loss_tokens)})
        self.optimizer.step()
        return float(loss)


def sample_forward(model, solo_group):
    """The trainer's forward: a planned unit as the drop-in hands it (a Megatron-Core model's
    arguments), or one whole sample at CP1 on a group of this rank alone."""
    from megatron.core.packed_seq_params import PackedSeqParams

    def forward(sample: dict) -> torch.Tensor:
        if "packed_seq_params" in sample:
            return model(**sample).reshape(-1)
        n = len(sample["tokens"])
        cu = torch.tensor([0, n], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                                 max_seqlen_q=n, max_seqlen_kv=n, local_cp_size=1, cp_group=solo_group)
        return model(input_ids=sample["tokens"][None], position_ids=torch.arange(n)[None], attention_mask=None,
                     labels=sample["labels"][None], loss_mask=sample["loss_mask"][None], packed_seq_params=params).reshape(-1)

    return forward


def titan_rank(endpoint: str, rank: int) -> dict:
    """One rank: the seam's groups, then each layout's trainer with the drop-in enabled; records by layout."""
    from tests.support.megatron_init import initialize_dpxcp_groups
    from trainer_client.dropin import dpxcp_groups

    initialize_dpxcp_groups(context_parallel_size=CP)  # Megatron-Core's parallel_state, for the model alone
    groups, cp_group_for = dpxcp_groups(CP)
    return {layout: _train(endpoint, groups, cp_group_for, layout) for layout in LAYOUTS}


def _train(endpoint: str, groups, cp_group_for, layout: str) -> dict:
    from examples import titan_style_dropin
    from tests.support.attention_model import AttentionModelConfig, attention_gpt_model
    from tests.support.attention_parity import LossAndGrads, reference_loss_and_grads, worst_differences
    from tests.support.dropin_attention import MAX_SEQLEN_PER_RANK, dp_rank_batches, step_samples, units_record
    from tests.support.megatron_init import parallel_state_cp_group
    from trainer_client.dropin import rank_units

    model = attention_gpt_model(AttentionModelConfig(cp_partition_mode=layout, context_parallel_size=CP if layout == "zigzag" else 1))
    trainer = Trainer(model, sample_forward(model, parallel_state_cp_group(1)))
    own = Trainer.__dict__["train_step"]
    planner = {"planner_endpoint": endpoint, "deadline_seconds": 30.0, "fallback": False, "job": f"titan-style-{layout}"}
    enabled = titan_style_dropin.enable(Trainer, groups, cp_group_for, max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_RANK,
                                        cp_layout=layout, planner=planner)
    data_iterator = dp_rank_batches(STEPS, groups.dp.rank(), groups.dp.size())
    steps = []
    try:
        for step in range(STEPS):
            samples = step_samples(step, groups.dp.size())
            before = {name: p.detach().clone() for name, p in model.named_parameters()}
            want = reference_loss_and_grads(model, samples, parallel_state_cp_group(1))  # the same parameters, whole samples
            trainer.train_step(data_iterator)
            got = trainer.records[-1]
            units = rank_units(enabled.last_step, groups.dp_cp.rank(), cp_group_for)  # what the step trained, to check
            steps.append({
                **units_record(units, samples), "source": enabled.last_step.source, "loss_tokens": got["loss_tokens"],
                "worst": worst_differences(LossAndGrads(got["loss"], got["grads"], None), want, samples),
                "moved": any(not torch.equal(p, before[n]) for n, p in model.named_parameters()),
            })
        try:
            trainer.train_step(data_iterator)
            end = "no error"
        except StopIteration:
            end = "StopIteration"
    finally:
        titan_style_dropin.disable()
    return {"steps": steps, "end": end, "restored": Trainer.__dict__["train_step"] is own}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, planner) -> dict[str, list[dict]]:
    """Each layout's record per rank (one run of the ranks)."""
    require_dynamic_build()
    per_rank = run_attention_ranks(partial(titan_rank, planner.address), WORLD, tmp_path_factory.mktemp("ranks"))
    assert all("raised" not in r for r in per_rank), [r.get("raised") for r in per_rank]
    return {layout: [r[layout] for r in per_rank] for layout in LAYOUTS}


@pytest.mark.attention
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_hooked_trainer_trains_the_planned_units_as_whole_samples(runs, layout):
    per_rank = runs[layout]
    for rank, record in enumerate(per_rank):
        assert len(record["steps"]) == STEPS and record["end"] == "StopIteration" and record["restored"], (rank, record)
    for step in range(STEPS):
        records = [r["steps"][step] for r in per_rank]
        assert_planned_step(records, TOLERANCE, (layout, step))
        assert all(r["moved"] for r in records), "the optimizer did not step: later steps test nothing new"


def code_lines(source: str) -> list[int]:
    """The numbers of the lines that hold code: not blank, not only a comment, not in a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            lines.update(range(token.start[0], token.end[0] + 1))
    return sorted(lines - docstrings)


def test_the_example_is_sixty_code_lines_or_fewer():
    lines = code_lines(EXAMPLE.read_text())
    assert len(lines) <= MAX_CODE_LINES, f"{EXAMPLE.name} has {len(lines)} code lines; at most {MAX_CODE_LINES}"


def test_code_lines_leave_out_blanks_comments_and_docstrings():
    source = ('"""Module doc,\nover two lines."""\n\n# a comment\nx = 1  # code with a comment\n\n\n'
              'def f():\n    """Its doc."""\n    return (1,\n            2)\n')
    assert code_lines(source) == [5, 8, 10, 11]


def test_the_example_uses_the_seam_and_the_client_only():
    imported = set()
    for node in ast.walk(ast.parse(EXAMPLE.read_text())):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    outside = sorted(m for m in imported if m.startswith(("trainer_client.megatron_lm", "trainer_client.megatron_bridge", "trainer_client.verl")))
    assert outside == [] and "trainer_client.dropin" in imported, imported


def test_the_example_registers_itself_and_the_table_checks_its_source():
    """The review's sketch failed at `check({"titan": ...})`: the example's own source is registered by
    its own module, the core untouched, and the table checks it (its settings pass; a bad scheduler
    in the planner settings is still refused by the core rows)."""
    from examples import titan_style_dropin
    from trainer_client.refusals.compatibility import CORE_SOURCES, check, known_sources
    from trainer_client.dropin import dropin, register_dropin
    from trainer_client.errors import UsageError

    assert "titan_style" in known_sources() and "titan_style" not in CORE_SOURCES
    assert dropin("titan_style") is titan_style_dropin.TITAN_STYLE
    check({"titan_style": {}})
    with pytest.raises(UsageError, match="'titan_style' is registered already, by examples.titan_style_dropin"):
        register_dropin(titan_style_dropin.TITAN_STYLE)
