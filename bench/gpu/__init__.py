"""GPU benchmark: execute the planner's plans on real ranks and calibrate the cost model.

See docs/gpu-benchmark.md for the command and the results.
"""
