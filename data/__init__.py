"""Text -> tokens -> batches: sources, the character tokenizer, the cached corpus and batching."""

from .corpus import Corpus, check_split_sizes, encode_corpus, eval_windows, get_batch, inputs_and_targets, load_corpus
from .files import atomic_file, write_atomic
from .sources import load_source
from .tokenizer import CharTokenizer

__all__ = [
    "atomic_file",
    "CharTokenizer",
    "Corpus",
    "check_split_sizes",
    "encode_corpus",
    "eval_windows",
    "get_batch",
    "inputs_and_targets",
    "load_corpus",
    "load_source",
    "write_atomic",
]
