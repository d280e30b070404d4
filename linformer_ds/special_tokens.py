"""The fixed special tokens of every data_prep tokenizer: one table that data_prep (which trains
the tokenizer) and the export (which writes the Hugging Face tokenizer files) both import.
Standard library only."""

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_IDS = {"pad": PAD_ID, "unk": UNK_ID, "cls": CLS_ID, "sep": SEP_ID, "mask": MASK_ID}
SPECIAL_PIECES = {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"}

# A Hugging Face tokenizer's special tokens by our names: its attributes, first present wins
# (BERT names cls/sep, RoBERTa also bos/eos). data_prep records them in the manifest; the export
# checks the tokenizer it writes against them.
HF_ATTRS = {
    "pad": ("pad_token",),
    "unk": ("unk_token",),
    "cls": ("cls_token", "bos_token"),
    "sep": ("sep_token", "eos_token"),
    "mask": ("mask_token",),
}


def hf_special_tokens(tok: object) -> tuple:
    """``(ids, pieces, missing)`` of a transformers tokenizer ``tok``: ``{name: id}``,
    ``{name: token}`` for the names of :data:`HF_ATTRS` it has, and the attribute alternatives
    (``"cls_token or bos_token"``) of those it lacks."""
    ids, pieces, missing = {}, {}, []
    for key, attrs in HF_ATTRS.items():
        for attr in attrs:
            piece, token_id = getattr(tok, attr, None), getattr(tok, attr + "_id", None)
            if piece is not None and token_id is not None:
                ids[key], pieces[key] = int(token_id), str(piece)
                break
        else:
            missing.append(" or ".join(attrs))
    return ids, pieces, missing


# What save_pretrained writes for a tokenizer (any of them): a tokenizer is loaded from a copy
# of these alone, so that a model directory's config.json (an export's auto_map: remote code)
# is never read and AutoTokenizer never asks whether to run it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json")  # fmt: skip


def copy_tokenizer_files(src: str, dest: str) -> None:
    """Copy the :data:`TOKENIZER_FILES` that directory ``src`` holds into directory ``dest``."""
    import os
    import shutil

    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dest, name))
