"""launch/pretrain.py plus one line per rank, ``[zero3] rank R holds n/N of NAME``, for each
shared projection: what tests/test_train.py checks of ZeRO-3's partitioning."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from linformer_ds import train  # noqa: E402


class HoldingsTrainer(train.Trainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        for name, p in self.model.named_parameters():
            if name.startswith("encoder.shared_"):
                held = f"{p.ds_tensor.numel()}/{p.ds_numel}"
                print(f"[zero3] rank {self.rank} holds {held} of {name}", flush=True)


if __name__ == "__main__":
    train.Trainer = HoldingsTrainer  # type: ignore[misc]
    train.run_and_exit()
