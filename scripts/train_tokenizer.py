"""Train a small byte-level BPE tokenizer with the DeepSeek V4 special tokens.

Usage: python scripts/train_tokenizer.py OUT_DIR [VOCAB_SIZE]
"""

import json
import re
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv4cli.tokenizer import DEFAULT_BOS, DEFAULT_EOS, SPECIAL_TOKENS


def train_tokenizer(texts, out_dir, vocab_size: int = 1024, model_max_length: int = 1048576) -> Tokenizer:
    """Train on `texts` and write tokenizer.json + tokenizer_config.json into `out_dir`.

    Special tokens take the first ids in `SPECIAL_TOKENS` order, so BOS = 0, EOS = 1, pad = 2 as in
    the official vocab; every byte is in the base alphabet, so any text can be encoded.
    """
    tokenizer = Tokenizer(models.BPE())
    # Every digit is its own token (no merges across digits), so numbers are spelt digit by digit and
    # sums of unseen operands share the digit patterns of seen ones.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Special tokens are split off before BPE at encode time, so learn merges only from the text
    # between them (the trainer itself would spend merges on their bytes).
    special = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))
    pieces = (piece for text in texts for piece in special.split(text) if piece)
    tokenizer.train_from_iterator(pieces, trainer=trainer)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    # Same fields as the official DeepSeek V4 tokenizer_config.json (docs §5): pad is EOS, no auto BOS/EOS.
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": DEFAULT_BOS,
        "eos_token": DEFAULT_EOS,
        "pad_token": DEFAULT_EOS,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return tokenizer


def main(argv):
    if len(argv) not in (1, 2):
        sys.exit(__doc__.strip())
    # Run as a file, so make the repository root importable for `scripts.corpus`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts.corpus import build_corpus

    vocab_size = int(argv[1]) if len(argv) == 2 else 1024
    tokenizer = train_tokenizer(build_corpus(), argv[0], vocab_size=vocab_size)
    print(f"wrote {argv[0]}/tokenizer.json ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main(sys.argv[1:])
