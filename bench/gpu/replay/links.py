"""The links between GPUs, the one home of their figures: `LinkSpec` (docs/gpu-replay.md, "The links").

One GPU times every kernel a rank runs; what it cannot time is the wire between GPUs. The replay
models each transfer as bytes / bandwidth + latency, on the intra-node link (NVLink through
NVSwitch) when both GPUs share a node and on the inter-node link (one NIC per GPU) otherwise:

- a CP ring step's transfer (`ring_step_seconds`): what Transformer Engine sends to the next rank of
  the ring while it computes the step (`simulate.py` overlaps the two as Transformer Engine does);
  a step lasts as long as its slowest hop, so one hop across nodes makes the whole ring's steps
  inter-node;
- a TP collective (`tp_collective_seconds`): an all-gather or reduce-scatter of a layer's
  activations within the TP group (a ring algorithm: (t - 1) / t of the gathered bytes over the
  link), not overlapped with compute.

Placement: Megatron-Core orders ranks TP first, then CP and DP, so DPxCP rank g holds GPUs
g*t .. g*t + t - 1, and node = (g * t) // gpus_per_node. The figures are assumptions, not
measurements (no machine with several GPUs was lent): settable here and on the command line, and
printed with every result.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields, replace
from typing import Sequence


@dataclass(frozen=True)
class LinkSpec:
    gpus_per_node: int = 8
    """GPUs in one node (an HGX H100 board: 8)."""
    intra_node_bytes_per_second: float = 360e9
    """One direction of one GPU's NVLink 4 through NVSwitch, as NCCL's point-to-point reaches it
    (nominal 450 GB/s; about 80% achieved)."""
    intra_node_latency_seconds: float = 10e-6
    """Per transfer within a node: NCCL's launch and handshake."""
    inter_node_bytes_per_second: float = 45e9
    """One 400 Gb/s NIC per GPU (InfiniBand NDR or RoCE), one direction, about 90% achieved."""
    inter_node_latency_seconds: float = 20e-6
    """Per transfer across nodes."""
    tp_bytes_per_second: float = 360e9
    """Bus bandwidth of an all-gather or reduce-scatter within one node."""

    def transfer_seconds(self, nbytes: float, crosses_node: bool) -> float:
        if nbytes <= 0:
            return 0.0
        if crosses_node:
            return nbytes / self.inter_node_bytes_per_second + self.inter_node_latency_seconds
        return nbytes / self.intra_node_bytes_per_second + self.intra_node_latency_seconds

    def node_of(self, dp_cp_rank: int, tensor_parallel_size: int) -> int:
        return dp_cp_rank * tensor_parallel_size // self.gpus_per_node

    def ring_crosses_node(self, ranks: Sequence[int], tensor_parallel_size: int) -> bool:
        """Whether any hop of the ring over `ranks` (DPxCP ranks, in ring order) leaves its node."""
        nodes = [self.node_of(r, tensor_parallel_size) for r in ranks]
        return len(set(nodes)) > 1

    def ring_step_seconds(self, nbytes: float, ranks: Sequence[int], tensor_parallel_size: int) -> float:
        """One ring step's transfer of `nbytes` per rank over the group `ranks` (its slowest hop)."""
        if len(ranks) < 2:
            return 0.0
        return self.transfer_seconds(nbytes, self.ring_crosses_node(ranks, tensor_parallel_size))

    def tp_collective_seconds(self, gathered_bytes: float, tensor_parallel_size: int) -> float:
        """An all-gather (or reduce-scatter) whose gathered tensor has `gathered_bytes`, over a TP
        group within one node."""
        t = tensor_parallel_size
        if t <= 1 or gathered_bytes <= 0:
            return 0.0
        if t > self.gpus_per_node:
            raise ValueError(f"tensor_parallel_size {t} spans nodes ({self.gpus_per_node} GPUs a node): not modeled")
        return (t - 1) / t * gathered_bytes / self.tp_bytes_per_second + self.intra_node_latency_seconds

    def describe(self) -> str:
        return (f"links: {self.gpus_per_node} GPUs a node; intra-node {self.intra_node_bytes_per_second / 1e9:g} GB/s + "
                f"{self.intra_node_latency_seconds * 1e6:g} us; inter-node {self.inter_node_bytes_per_second / 1e9:g} GB/s + "
                f"{self.inter_node_latency_seconds * 1e6:g} us; TP collectives {self.tp_bytes_per_second / 1e9:g} GB/s (assumed, not measured)")

    def as_json(self) -> dict:
        return asdict(self)


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per LinkSpec field (--intra-node-bytes-per-second ...), defaulting to LinkSpec's."""
    default = LinkSpec()
    for f in fields(LinkSpec):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(default, f.name)), default=getattr(default, f.name),
                            help=f"link model: {f.name} (default %(default)s)")


def links_from_arguments(args: argparse.Namespace) -> LinkSpec:
    return replace(LinkSpec(), **{f.name: getattr(args, f.name) for f in fields(LinkSpec)})
