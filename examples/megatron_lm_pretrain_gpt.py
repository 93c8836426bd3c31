"""The one-line change that puts the batch planner behind Megatron-LM's own training loop.

Megatron-LM's `pretrain_gpt.py` calls `megatron.training.pretrain(...)`, and `training.py` wraps
the data iterator itself:

    # 0.19.x, --hybrid-context-parallel (megatron/training/training.py)
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper
    ...
    train_data_iterator = iter(HybridCPDataLoaderWrapper(train_data_iterator, config))

    # dev branch, --sequence-packing-scheduler default_dynamic_cp | dp_balanced
    from megatron.core.datasets.data_schedule import wrap_data_iterator
    ...
    (packed_data_iterator, num_microbatches, seqlen_sum_this_global_batch,
     seqlen_squared_sum_this_global_batch) = wrap_data_iterator(data_iterator, config, get_num_microbatches())

The change is the import line in training.py:

    from trainer_client.megatron_lm import HybridCPDataLoaderWrapper   # 0.19.x
    from trainer_client.megatron_lm import wrap_data_iterator          # dev branch

or, without editing Megatron-LM, what this script does: `trainer_client.megatron_lm.enabled()` around
`pretrain`, which replaces those names in `megatron.training.training` (on a Megatron-Core build the
drop-in was checked against; on another it warns and changes nothing) and puts Megatron-LM's own back
at the end.

The planner's own settings (endpoint, TLS, deadlines, fallback) come from the YAML file named by
$BATCH_PLANNER_CONFIG (section `batch_planner`); sizes and the scheduler come from Megatron's
flags. Run it as you run pretrain_gpt.py, e.g.

    BATCH_PLANNER_CONFIG=planner.yaml torchrun --nproc-per-node 8 examples/megatron_lm_pretrain_gpt.py \
        /path/to/Megatron-LM/pretrain_gpt.py \
        --hybrid-context-parallel --max-seqlen-per-dp-cp-rank 16384 ...   # every other flag as before

with planner.yaml:

    batch_planner:
      planner_endpoint: dns:///batch-planner.training.svc.cluster.local:50051
      tls_ca_file: /etc/batch-planner/ca.pem

`--check` only shows what would be swapped (and swaps it back), without Megatron-LM's pretrain_gpt.py
on the path.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this repository, for trainer_client


def main() -> None:
    from trainer_client.megatron_lm import enabled

    if "--check" in sys.argv:
        with enabled() as swapped:
            print("swapped in megatron.training.training:", ", ".join(swapped) or "nothing")
        return
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} path/to/pretrain_gpt.py [Megatron-LM flags...]  (or --check)")
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))  # Megatron-LM's own imports
    with enabled():  # the one line
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
