"""What the tests share, none of it a test: the rank launcher, gloo start-up, rank results and free
ports (launch.py), the trainer-side batches (batches.py), the real planner process
(planner_process.py), Megatron-Core's parallel_state set-up (megatron_init.py), and the stand-ins,
each named as such (cp_attention_standin.py: the CPU stand-in for Transformer Engine's THD/CP
attention; cuda_requests_on_cpu.py, moe_on_cpu.py). The session's `planner` and `stub` fixtures are
in tests/conftest.py."""
