"""The gRPC-free planning core shared by the planner server and the trainer client.

Data flows one way: request -> validation -> Megatron-Core scheduler -> plan + invariants ->
statistics. Nothing here imports grpc, so a trainer can plan in-process when the service is away.
"""
