"""The replay: every rank's work in a plan, timed through Transformer Engine's kernels on one GPU,
with the links between GPUs modeled (docs/gpu-replay.md).

Rooms, one concern each:

- `shapes.py`: the model a replay prices, as one tensor-parallel rank runs it (`RankShape`).
- `links.py`: the links between GPUs, the one home of their figures (`LinkSpec`), and what a CP
  ring step's transfer and a TP collective cost on them.
- `passes.py`: a plan as each CP group's passes, with every member rank's local tokens.
- `clock.py`: what a rank's kernels cost (`KernelClock`): the fitted clock from measurements, and
  the fake one the CPU tests use.
- `simulate.py`: a pass's time on a group from its members' kernel times and the links, and a step's
  time from an event simulation of every rank's timeline (beside the cost model's barrier
  arithmetic).
- `in_process_peers.py` (stand-in, named as such): a CP group's other ranks inside one process, so
  that one rank's Transformer Engine ring runs alone on the GPU.
- `fused_calls.py`: a recorder of Transformer Engine's fused-attention calls (the fidelity check).
- `measure.py` (GPU): times the kernels; `report.py` (CPU): replays plans, fits the cost model,
  writes docs/gpu-benchmark-data/replay/.
"""
