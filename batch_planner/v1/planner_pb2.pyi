from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Scheduler(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULER_UNSPECIFIED: _ClassVar[Scheduler]
    SCHEDULER_HYBRID_CP: _ClassVar[Scheduler]
    SCHEDULER_DYNAMIC_CP: _ClassVar[Scheduler]
    SCHEDULER_STATIC_PACKING: _ClassVar[Scheduler]
    SCHEDULER_AUTO: _ClassVar[Scheduler]

class CpLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CP_LAYOUT_UNSPECIFIED: _ClassVar[CpLayout]
    CP_LAYOUT_ZIGZAG: _ClassVar[CpLayout]
    CP_LAYOUT_CONTIGUOUS: _ClassVar[CpLayout]

class PaddingRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PADDING_RULE_UNSPECIFIED: _ClassVar[PaddingRule]
    PADDING_RULE_MEGATRON_CORE: _ClassVar[PaddingRule]
    PADDING_RULE_VERL: _ClassVar[PaddingRule]

class CapacityBound(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPACITY_BOUND_UNSPECIFIED: _ClassVar[CapacityBound]
    CAPACITY_BOUND_PER_SAMPLE: _ClassVar[CapacityBound]
    CAPACITY_BOUND_PER_RANK_SUM: _ClassVar[CapacityBound]

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECISION_UNSPECIFIED: _ClassVar[Precision]
    PRECISION_BF16: _ClassVar[Precision]
    PRECISION_FP8_DELAYED: _ClassVar[Precision]
    PRECISION_FP8_CURRENT: _ClassVar[Precision]
    PRECISION_FP8_BLOCK: _ClassVar[Precision]
    PRECISION_MXFP8: _ClassVar[Precision]

class PlanForm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLAN_FORM_MICRO_BATCHES: _ClassVar[PlanForm]
    PLAN_FORM_COLUMNS: _ClassVar[PlanForm]

class SubstituteReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SUBSTITUTE_REASON_UNSPECIFIED: _ClassVar[SubstituteReason]
    SUBSTITUTE_REASON_UPSTREAM_ERROR: _ClassVar[SubstituteReason]
    SUBSTITUTE_REASON_UPSTREAM_LOOP: _ClassVar[SubstituteReason]
    SUBSTITUTE_REASON_UNBUILDABLE_CP_GROUP: _ClassVar[SubstituteReason]
SCHEDULER_UNSPECIFIED: Scheduler
SCHEDULER_HYBRID_CP: Scheduler
SCHEDULER_DYNAMIC_CP: Scheduler
SCHEDULER_STATIC_PACKING: Scheduler
SCHEDULER_AUTO: Scheduler
CP_LAYOUT_UNSPECIFIED: CpLayout
CP_LAYOUT_ZIGZAG: CpLayout
CP_LAYOUT_CONTIGUOUS: CpLayout
PADDING_RULE_UNSPECIFIED: PaddingRule
PADDING_RULE_MEGATRON_CORE: PaddingRule
PADDING_RULE_VERL: PaddingRule
CAPACITY_BOUND_UNSPECIFIED: CapacityBound
CAPACITY_BOUND_PER_SAMPLE: CapacityBound
CAPACITY_BOUND_PER_RANK_SUM: CapacityBound
PRECISION_UNSPECIFIED: Precision
PRECISION_BF16: Precision
PRECISION_FP8_DELAYED: Precision
PRECISION_FP8_CURRENT: Precision
PRECISION_FP8_BLOCK: Precision
PRECISION_MXFP8: Precision
PLAN_FORM_MICRO_BATCHES: PlanForm
PLAN_FORM_COLUMNS: PlanForm
SUBSTITUTE_REASON_UNSPECIFIED: SubstituteReason
SUBSTITUTE_REASON_UPSTREAM_ERROR: SubstituteReason
SUBSTITUTE_REASON_UPSTREAM_LOOP: SubstituteReason
SUBSTITUTE_REASON_UNBUILDABLE_CP_GROUP: SubstituteReason

class ParallelLayout(_message.Message):
    __slots__ = ("data_parallel_size", "context_parallel_size", "tensor_parallel_size")
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    data_parallel_size: int
    context_parallel_size: int
    tensor_parallel_size: int
    def __init__(self, data_parallel_size: _Optional[int] = ..., context_parallel_size: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("sequence_lengths", "layout", "max_seqlen_per_dp_cp_rank", "scheduler", "cp_layout", "min_cp_size", "max_seqs_per_micro_batch", "micro_batch_group_size", "job", "cost_model", "auto_schedulers", "plan_form", "padding", "min_local_rows", "precision", "sequence_parallel")
    SEQUENCE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQLEN_PER_DP_CP_RANK_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    CP_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MIN_CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQS_PER_MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    COST_MODEL_FIELD_NUMBER: _ClassVar[int]
    AUTO_SCHEDULERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FORM_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    MIN_LOCAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    sequence_lengths: _containers.RepeatedScalarFieldContainer[int]
    layout: ParallelLayout
    max_seqlen_per_dp_cp_rank: int
    scheduler: Scheduler
    cp_layout: CpLayout
    min_cp_size: int
    max_seqs_per_micro_batch: int
    micro_batch_group_size: int
    job: str
    cost_model: CostModelSpec
    auto_schedulers: _containers.RepeatedScalarFieldContainer[Scheduler]
    plan_form: PlanForm
    padding: PaddingRule
    min_local_rows: int
    precision: Precision
    sequence_parallel: bool
    def __init__(self, sequence_lengths: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[ParallelLayout, _Mapping]] = ..., max_seqlen_per_dp_cp_rank: _Optional[int] = ..., scheduler: _Optional[_Union[Scheduler, str]] = ..., cp_layout: _Optional[_Union[CpLayout, str]] = ..., min_cp_size: _Optional[int] = ..., max_seqs_per_micro_batch: _Optional[int] = ..., micro_batch_group_size: _Optional[int] = ..., job: _Optional[str] = ..., cost_model: _Optional[_Union[CostModelSpec, _Mapping]] = ..., auto_schedulers: _Optional[_Iterable[_Union[Scheduler, str]]] = ..., plan_form: _Optional[_Union[PlanForm, str]] = ..., padding: _Optional[_Union[PaddingRule, str]] = ..., min_local_rows: _Optional[int] = ..., precision: _Optional[_Union[Precision, str]] = ..., sequence_parallel: _Optional[bool] = ...) -> None: ...

class CostModelSpec(_message.Message):
    __slots__ = ("preset", "coefficients", "model", "hardware")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    preset: str
    coefficients: CostModelCoefficients
    model: ModelProfile
    hardware: HardwareProfile
    def __init__(self, preset: _Optional[str] = ..., coefficients: _Optional[_Union[CostModelCoefficients, _Mapping]] = ..., model: _Optional[_Union[ModelProfile, _Mapping]] = ..., hardware: _Optional[_Union[HardwareProfile, _Mapping]] = ...) -> None: ...

class ModelProfile(_message.Message):
    __slots__ = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "ffn_hidden_size", "vocab_size", "gated_mlp", "num_experts", "moe_top_k", "moe_ffn_hidden_size", "bytes_per_value")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    FFN_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    GATED_MLP_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    MOE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    MOE_FFN_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_VALUE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    gated_mlp: int
    num_experts: int
    moe_top_k: int
    moe_ffn_hidden_size: int
    bytes_per_value: int
    def __init__(self, num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., ffn_hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., gated_mlp: _Optional[int] = ..., num_experts: _Optional[int] = ..., moe_top_k: _Optional[int] = ..., moe_ffn_hidden_size: _Optional[int] = ..., bytes_per_value: _Optional[int] = ...) -> None: ...

class HardwareProfile(_message.Message):
    __slots__ = ("peak_bf16_flops", "sustained_fraction", "attention_sustained_fraction", "cp_bandwidth_bytes_per_second", "cp_exposed_fraction", "seconds_per_layer_pass", "seconds_per_pass_base", "cp_seconds_per_layer_pass")
    PEAK_BF16_FLOPS_FIELD_NUMBER: _ClassVar[int]
    SUSTAINED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_SUSTAINED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    CP_BANDWIDTH_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CP_EXPOSED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_LAYER_PASS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_PASS_BASE_FIELD_NUMBER: _ClassVar[int]
    CP_SECONDS_PER_LAYER_PASS_FIELD_NUMBER: _ClassVar[int]
    peak_bf16_flops: float
    sustained_fraction: float
    attention_sustained_fraction: float
    cp_bandwidth_bytes_per_second: float
    cp_exposed_fraction: float
    seconds_per_layer_pass: float
    seconds_per_pass_base: float
    cp_seconds_per_layer_pass: float
    def __init__(self, peak_bf16_flops: _Optional[float] = ..., sustained_fraction: _Optional[float] = ..., attention_sustained_fraction: _Optional[float] = ..., cp_bandwidth_bytes_per_second: _Optional[float] = ..., cp_exposed_fraction: _Optional[float] = ..., seconds_per_layer_pass: _Optional[float] = ..., seconds_per_pass_base: _Optional[float] = ..., cp_seconds_per_layer_pass: _Optional[float] = ...) -> None: ...

class CpGroup(_message.Message):
    __slots__ = ("first_rank", "size", "sample_ids", "real_tokens", "padded_tokens")
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    REAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_rank: int
    size: int
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    real_tokens: int
    padded_tokens: int
    def __init__(self, first_rank: _Optional[int] = ..., size: _Optional[int] = ..., sample_ids: _Optional[_Iterable[int]] = ..., real_tokens: _Optional[int] = ..., padded_tokens: _Optional[int] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("cp_groups",)
    CP_GROUPS_FIELD_NUMBER: _ClassVar[int]
    cp_groups: _containers.RepeatedCompositeFieldContainer[CpGroup]
    def __init__(self, cp_groups: _Optional[_Iterable[_Union[CpGroup, _Mapping]]] = ...) -> None: ...

class PlanColumns(_message.Message):
    __slots__ = ("groups_per_micro_batch", "first_ranks", "sizes", "sample_counts", "sample_ids", "real_tokens", "padded_tokens")
    GROUPS_PER_MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANKS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    REAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    groups_per_micro_batch: _containers.RepeatedScalarFieldContainer[int]
    first_ranks: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    sample_counts: _containers.RepeatedScalarFieldContainer[int]
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    real_tokens: _containers.RepeatedScalarFieldContainer[int]
    padded_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, groups_per_micro_batch: _Optional[_Iterable[int]] = ..., first_ranks: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., sample_counts: _Optional[_Iterable[int]] = ..., sample_ids: _Optional[_Iterable[int]] = ..., real_tokens: _Optional[_Iterable[int]] = ..., padded_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class CpSizeCount(_message.Message):
    __slots__ = ("cp_size", "samples", "real_tokens")
    CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cp_size: int
    samples: int
    real_tokens: int
    def __init__(self, cp_size: _Optional[int] = ..., samples: _Optional[int] = ..., real_tokens: _Optional[int] = ...) -> None: ...

class PlanStatistics(_message.Message):
    __slots__ = ("real_tokens", "padded_tokens", "padding_ratio", "micro_batch_count", "cp_size_mix", "predicted_step_cost", "lower_bound_cost", "balance_efficiency", "static_cp_step_cost", "predicted_speedup_over_static_cp", "alignment_padding_tokens")
    REAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDING_RATIO_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_COUNT_FIELD_NUMBER: _ClassVar[int]
    CP_SIZE_MIX_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_COST_FIELD_NUMBER: _ClassVar[int]
    LOWER_BOUND_COST_FIELD_NUMBER: _ClassVar[int]
    BALANCE_EFFICIENCY_FIELD_NUMBER: _ClassVar[int]
    STATIC_CP_STEP_COST_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SPEEDUP_OVER_STATIC_CP_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_PADDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    real_tokens: int
    padded_tokens: int
    padding_ratio: float
    micro_batch_count: int
    cp_size_mix: _containers.RepeatedCompositeFieldContainer[CpSizeCount]
    predicted_step_cost: float
    lower_bound_cost: float
    balance_efficiency: float
    static_cp_step_cost: float
    predicted_speedup_over_static_cp: float
    alignment_padding_tokens: int
    def __init__(self, real_tokens: _Optional[int] = ..., padded_tokens: _Optional[int] = ..., padding_ratio: _Optional[float] = ..., micro_batch_count: _Optional[int] = ..., cp_size_mix: _Optional[_Iterable[_Union[CpSizeCount, _Mapping]]] = ..., predicted_step_cost: _Optional[float] = ..., lower_bound_cost: _Optional[float] = ..., balance_efficiency: _Optional[float] = ..., static_cp_step_cost: _Optional[float] = ..., predicted_speedup_over_static_cp: _Optional[float] = ..., alignment_padding_tokens: _Optional[int] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("plan_id", "scheduler", "scheduler_class", "megatron_core_version", "micro_batches", "statistics", "capacity_bound", "dp_cp_size", "cp_layout", "tensor_parallel_size", "candidates", "columns", "substitution", "padding", "min_local_rows", "precision", "sequence_parallel")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_CLASS_FIELD_NUMBER: _ClassVar[int]
    MEGATRON_CORE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BOUND_FIELD_NUMBER: _ClassVar[int]
    DP_CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CP_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    SUBSTITUTION_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    MIN_LOCAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    scheduler: Scheduler
    scheduler_class: str
    megatron_core_version: str
    micro_batches: _containers.RepeatedCompositeFieldContainer[MicroBatch]
    statistics: PlanStatistics
    capacity_bound: CapacityBound
    dp_cp_size: int
    cp_layout: CpLayout
    tensor_parallel_size: int
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    columns: PlanColumns
    substitution: Substitution
    padding: PaddingRule
    min_local_rows: int
    precision: Precision
    sequence_parallel: bool
    def __init__(self, plan_id: _Optional[str] = ..., scheduler: _Optional[_Union[Scheduler, str]] = ..., scheduler_class: _Optional[str] = ..., megatron_core_version: _Optional[str] = ..., micro_batches: _Optional[_Iterable[_Union[MicroBatch, _Mapping]]] = ..., statistics: _Optional[_Union[PlanStatistics, _Mapping]] = ..., capacity_bound: _Optional[_Union[CapacityBound, str]] = ..., dp_cp_size: _Optional[int] = ..., cp_layout: _Optional[_Union[CpLayout, str]] = ..., tensor_parallel_size: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., columns: _Optional[_Union[PlanColumns, _Mapping]] = ..., substitution: _Optional[_Union[Substitution, _Mapping]] = ..., padding: _Optional[_Union[PaddingRule, str]] = ..., min_local_rows: _Optional[int] = ..., precision: _Optional[_Union[Precision, str]] = ..., sequence_parallel: _Optional[bool] = ...) -> None: ...

class Substitution(_message.Message):
    __slots__ = ("requested", "reason", "detail")
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    requested: Scheduler
    reason: SubstituteReason
    detail: str
    def __init__(self, requested: _Optional[_Union[Scheduler, str]] = ..., reason: _Optional[_Union[SubstituteReason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("name", "scheduler", "max_seqlen_per_dp_cp_rank", "min_cp_size", "context_parallel_size", "planned", "predicted_step_cost", "served", "not_planned_reason", "skipped", "lower_bound_cost")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQLEN_PER_DP_CP_RANK_FIELD_NUMBER: _ClassVar[int]
    MIN_CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_COST_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    NOT_PLANNED_REASON_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    LOWER_BOUND_COST_FIELD_NUMBER: _ClassVar[int]
    name: str
    scheduler: Scheduler
    max_seqlen_per_dp_cp_rank: int
    min_cp_size: int
    context_parallel_size: int
    planned: bool
    predicted_step_cost: float
    served: bool
    not_planned_reason: str
    skipped: bool
    lower_bound_cost: float
    def __init__(self, name: _Optional[str] = ..., scheduler: _Optional[_Union[Scheduler, str]] = ..., max_seqlen_per_dp_cp_rank: _Optional[int] = ..., min_cp_size: _Optional[int] = ..., context_parallel_size: _Optional[int] = ..., planned: _Optional[bool] = ..., predicted_step_cost: _Optional[float] = ..., served: _Optional[bool] = ..., not_planned_reason: _Optional[str] = ..., skipped: _Optional[bool] = ..., lower_bound_cost: _Optional[float] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerInfo(_message.Message):
    __slots__ = ("scheduler", "available", "megatron_core_class", "unavailable_reason", "implementation", "implementation_reason")
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    MEGATRON_CORE_CLASS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    IMPLEMENTATION_FIELD_NUMBER: _ClassVar[int]
    IMPLEMENTATION_REASON_FIELD_NUMBER: _ClassVar[int]
    scheduler: Scheduler
    available: bool
    megatron_core_class: str
    unavailable_reason: str
    implementation: str
    implementation_reason: str
    def __init__(self, scheduler: _Optional[_Union[Scheduler, str]] = ..., available: _Optional[bool] = ..., megatron_core_class: _Optional[str] = ..., unavailable_reason: _Optional[str] = ..., implementation: _Optional[str] = ..., implementation_reason: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_samples_per_request", "max_dp_cp_size", "max_sequence_length", "max_receive_message_bytes", "max_tensor_parallel_size", "max_micro_batch_group_size")
    MAX_SAMPLES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_DP_CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_RECEIVE_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MICRO_BATCH_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_samples_per_request: int
    max_dp_cp_size: int
    max_sequence_length: int
    max_receive_message_bytes: int
    max_tensor_parallel_size: int
    max_micro_batch_group_size: int
    def __init__(self, max_samples_per_request: _Optional[int] = ..., max_dp_cp_size: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., max_receive_message_bytes: _Optional[int] = ..., max_tensor_parallel_size: _Optional[int] = ..., max_micro_batch_group_size: _Optional[int] = ...) -> None: ...

class CostModelCoefficients(_message.Message):
    __slots__ = ("seconds_per_token", "seconds_per_attention_token_pair", "cp_seconds_per_micro_batch", "cp_seconds_per_token", "seconds_per_pass")
    SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_ATTENTION_TOKEN_PAIR_FIELD_NUMBER: _ClassVar[int]
    CP_SECONDS_PER_MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    CP_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_PASS_FIELD_NUMBER: _ClassVar[int]
    seconds_per_token: float
    seconds_per_attention_token_pair: float
    cp_seconds_per_micro_batch: float
    cp_seconds_per_token: float
    seconds_per_pass: float
    def __init__(self, seconds_per_token: _Optional[float] = ..., seconds_per_attention_token_pair: _Optional[float] = ..., cp_seconds_per_micro_batch: _Optional[float] = ..., cp_seconds_per_token: _Optional[float] = ..., seconds_per_pass: _Optional[float] = ...) -> None: ...

class PlanRate(_message.Message):
    __slots__ = ("scheduler", "samples", "dp_cp_size", "plans_measured", "seconds_per_plan", "plans_per_second")
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DP_CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PLANS_MEASURED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_PLAN_FIELD_NUMBER: _ClassVar[int]
    PLANS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    scheduler: Scheduler
    samples: int
    dp_cp_size: int
    plans_measured: int
    seconds_per_plan: float
    plans_per_second: float
    def __init__(self, scheduler: _Optional[_Union[Scheduler, str]] = ..., samples: _Optional[int] = ..., dp_cp_size: _Optional[int] = ..., plans_measured: _Optional[int] = ..., seconds_per_plan: _Optional[float] = ..., plans_per_second: _Optional[float] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("server_version", "megatron_core_version", "schedulers", "limits", "cost_model", "cost_model_presets", "plan_rates", "planning_workers")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEGATRON_CORE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULERS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    COST_MODEL_FIELD_NUMBER: _ClassVar[int]
    COST_MODEL_PRESETS_FIELD_NUMBER: _ClassVar[int]
    PLAN_RATES_FIELD_NUMBER: _ClassVar[int]
    PLANNING_WORKERS_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    megatron_core_version: str
    schedulers: _containers.RepeatedCompositeFieldContainer[SchedulerInfo]
    limits: Limits
    cost_model: CostModelCoefficients
    cost_model_presets: _containers.RepeatedScalarFieldContainer[str]
    plan_rates: _containers.RepeatedCompositeFieldContainer[PlanRate]
    planning_workers: int
    def __init__(self, server_version: _Optional[str] = ..., megatron_core_version: _Optional[str] = ..., schedulers: _Optional[_Iterable[_Union[SchedulerInfo, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., cost_model: _Optional[_Union[CostModelCoefficients, _Mapping]] = ..., cost_model_presets: _Optional[_Iterable[str]] = ..., plan_rates: _Optional[_Iterable[_Union[PlanRate, _Mapping]]] = ..., planning_workers: _Optional[int] = ...) -> None: ...
