"""Text -> tokens -> batches: where the text comes from (text.py) and how it becomes batches (corpus.py)."""

from .corpus import CharTokenizer, Corpus, check_split_sizes, eval_windows, get_batch, inputs_and_targets, load_corpus
from .text import decode_utf8

__all__ = ["CharTokenizer", "Corpus", "check_split_sizes", "decode_utf8", "eval_windows", "get_batch",
           "inputs_and_targets", "load_corpus"]
