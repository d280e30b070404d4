"""Check a Hugging Face BERT or RoBERTa directory for a warm start and write the job config that
starts from it (``checkpoint.init_from: hf:PATH`` and the matching ``model:`` section).

python launch/convert.py --from hf:models/bert-base --config configs/base_4096.yaml \
    --out warm.yaml model.max_seq_len=4096 model.k=256 model.projection_init=pooling
python launch/pretrain.py --config warm.yaml data.path=DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from linformer_ds import entry  # noqa: E402  (standard library only)

entry.arm("convert")  # Ctrl-C while torch imports: one line, exit 130 (docs/reliability.md)

from linformer_ds.warm_start import main  # noqa: E402

if __name__ == "__main__":
    entry.run(main)
