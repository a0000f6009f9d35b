"""The demo model's tokenizer: byte-level BPE whose merges make each integer one token.

Built with the `tokenizers` library and saved as a normal `tokenizer.json`, so it loads through
the same code as any Hugging Face tokenizer. The base vocabulary is the 256 byte symbols, so any
UTF-8 text encodes (a multi-byte character spans several tokens, which the streaming detokenizer
must handle). Merges turn every integer from -599 to 599 into a single token, a minus sign
included: `85-12=73.` is `85`, `-12`, `=`, `73`, `.`. One token per signed number is what lets
a 2M-parameter model learn multi-step arithmetic in minutes on a CPU: each chain-of-thought
step becomes one lookup (`acc`, `±x`) -> `result` instead of digit alignment and carries.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MAX_NUMBER_TOKEN = 599
VOCAB_SIZE = 1464  # specials + 256 bytes + 1199 number tokens + 2 think markers, padded to a multiple of 8


def number_tokens() -> dict[str, int]:
    """Every number token's text and its integer value."""
    return {str(v): v for v in range(-MAX_NUMBER_TOKEN, MAX_NUMBER_TOKEN + 1)}


def _merges() -> list[tuple[str, str]]:
    merges = [(str(v)[0], str(v)[1]) for v in range(10, 100)]
    merges += [(str(v)[:2], str(v)[2]) for v in range(100, MAX_NUMBER_TOKEN + 1)]
    merges += [(str(v)[0], str(v)[1:]) for v in range(100, MAX_NUMBER_TOKEN + 1) if str(v)[1] != "0"]
    merges += [("-", str(v)) for v in range(0, MAX_NUMBER_TOKEN + 1)]
    return merges


def build_tokenizer() -> Tokenizer:
    vocab = {BOS: 0, EOS: 1, PAD: 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = _merges()
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_OPEN, THINK_CLOSE)])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    assert tok.get_vocab_size() <= VOCAB_SIZE, tok.get_vocab_size()
    return tok
