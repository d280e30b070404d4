"""Export a Hugging Face model directory (launch/export.py's output) to ONNX and check it.

python launch/onnx_export.py exported/tiny exported/tiny.onnx
python launch/onnx_export.py exported/tiny-clf exported/tiny-clf.onnx --no-check
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from linformer_ds import entry  # noqa: E402  (standard library only)

entry.arm("onnx_export")  # Ctrl-C while torch imports: one line, exit 130 (docs/reliability.md)

from linformer_ds.onnx_export import main  # noqa: E402

if __name__ == "__main__":
    entry.run(main)
