"""The stateless gRPC planner service around Megatron-Core's schedulers."""

__version__ = "0.1.0"
