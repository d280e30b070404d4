"""Export a DeepSpeed checkpoint to a self-contained Hugging Face model directory.

python launch/export.py --checkpoint runs/tiny/checkpoints --out exported/tiny
python launch/export.py --checkpoint CKPT --tag step_00000200 --out OUT --dtype bfloat16
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from linformer_ds import entry  # noqa: E402  (standard library only)

entry.arm("export")  # Ctrl-C while torch imports: one line, exit 130 (docs/reliability.md)

from linformer_ds.export import main  # noqa: E402

if __name__ == "__main__":
    entry.run(main)
