"""The fixed special tokens of every data_prep tokenizer: one table that data_prep (which trains
the tokenizer) and the export (which writes the Hugging Face tokenizer files) both import.
Standard library only."""

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_IDS = {"pad": PAD_ID, "unk": UNK_ID, "cls": CLS_ID, "sep": SEP_ID, "mask": MASK_ID}
SPECIAL_PIECES = {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"}
