"""Fill-mask on fixed English probe sentences: the top 5 predictions for one masked word each.

    python scripts/probe_fill_mask.py runs/english_cpu/checkpoints   # a checkpoint directory
    python scripts/probe_fill_mask.py exported/english_cpu          # or an export

A checkpoint directory (``checkpoint.dir``, or one tag in it) is exported first with
``launch/export.py`` into a temporary directory. Each probe marks one word ``[like this]``: the
sentence is tokenized whole, that word's pieces are replaced by one ``<mask>``, and the model's
five most likely pieces at it are printed beside the word's first piece. The summary counts the
probes whose top 1 is a content word (letters, 3+ characters, not a stop word) and those whose
top 5 hold the word's first piece. The sentences suit the English recipe's corpus (the Linux
kernel and Python documentation; configs/english_cpu.yaml) and general English.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBES = [
    "The kernel allocates [memory] for each new process.",
    "Python is a high-level programming [language] that is easy to learn.",
    "Please send your patches to the mailing [list] for review.",
    "This option is disabled by [default] and must be enabled explicitly.",
    "The file is opened in read-only [mode] unless another mode is given.",
    "An exception is raised if the [file] does not exist.",
    "The interrupt handler must not [sleep] while holding a spinlock.",
    "See the documentation for more [information] about these functions.",
    "The method returns a new [list] containing the items in sorted order.",
    "The device driver reads the data from the [hardware] registers.",
]
STOP = {
    "the", "and", "for", "that", "this", "with", "are", "was", "not", "but", "you", "can",
    "has", "have", "its", "from", "all", "any", "one", "which", "there", "will", "into",
}  # fmt: skip


def is_content(piece: str) -> bool:
    """A word piece that carries meaning: letters only, 3+ characters, not a stop word."""
    word = piece.lstrip("\u2581")
    return len(word) >= 3 and word.isalpha() and word.lower() not in STOP


def masked_input(tok, probe: str) -> tuple[list[int], int, int]:
    """``(ids with one <mask>, its position, the target's first piece id)`` of a probe."""
    m = re.search(r"\[([^\]]+)\]", probe)
    if m is None:
        raise ValueError(f"probe without a [word]: {probe!r}")
    text = probe[: m.start()] + m.group(1) + probe[m.end() :]
    start, end = m.start(), m.start() + len(m.group(1))
    enc = tok(text, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    span = [i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > start]
    if not span:
        raise ValueError(f"{probe!r}: the word maps to no token")
    target = ids[span[0]]
    ids = ids[: span[0]] + [tok.mask_token_id] + ids[span[-1] + 1 :]
    return ids, span[0], target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="an exported model directory or a checkpoint directory")
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if not os.path.isfile(os.path.join(path, "config.json")):  # a checkpoint: export it
            tag = None
            if os.path.isfile(os.path.join(path, "linformer_meta.json")):  # one tag
                path, tag = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
            cmd = [
                sys.executable,
                os.path.join(REPO, "launch", "export.py"),
                "--checkpoint",
                path,
                "--out",
                os.path.join(tmp, "export"),
            ] + (["--tag", tag] if tag else [])
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
            path = os.path.join(tmp, "export")
        return probe(path, args.top)


def probe(path: str, top: int) -> int:
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    model = AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True).eval()
    content = hits = 0
    for text in PROBES:
        ids, pos, target = masked_input(tok, text)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, pos].float()
        best = logits.topk(top).indices.tolist()
        pieces = tok.convert_ids_to_tokens(best)
        want = tok.convert_ids_to_tokens([target])[0]
        content += is_content(pieces[0])
        hits += target in best
        shown = "  ".join(repr(p.replace("\u2581", " ").strip() or p) for p in pieces)
        print(f"{text}\n    target {want!r} {'in' if target in best else 'not in'} top {top}: "
              f"{shown}")  # fmt: skip
    print(f"[probe] {len(PROBES)} probes: top 1 a content word in {content}, target in top "
          f"{top} in {hits}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
