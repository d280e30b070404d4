"""Fine-tune an exported Linformer model for sequence classification (see linformer_ds.finetune).

    python launch/finetune.py --model exported/tiny --train train.csv --validation valid.csv \
        --out finetuned/tiny --epochs 3 --lr 1e-4
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from linformer_ds import entry  # noqa: E402  (standard library only)

entry.arm("finetune")  # Ctrl-C while torch imports: one line, exit 130 (docs/reliability.md)

from linformer_ds.finetune import main  # noqa: E402

if __name__ == "__main__":
    entry.run(main)
