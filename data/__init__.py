"""Text -> tokens -> batches: sources in text.py, batching in corpus.py."""

from .corpus import CharTokenizer, Corpus, check_split_sizes, eval_windows, get_batch, inputs_and_targets, load_corpus
from .text import DOCUMENTS, SEPARATOR, decode_utf8

__all__ = ["DOCUMENTS", "SEPARATOR", "CharTokenizer", "Corpus", "check_split_sizes", "decode_utf8", "eval_windows",
           "get_batch", "inputs_and_targets", "load_corpus"]
