"""An offline tokenizer: a small BPE trained here on the task text, saved as a standard
Hugging Face tokenizer directory with a chat template.

Nothing can be downloaded at run time, so the tiny presets need a tokenizer built locally.
It is saved and loaded through `transformers.AutoTokenizer`, so every code path (chat
template, eos/pad ids, decode) uses the same API as a real model's tokenizer. Digits are
always single tokens so that arithmetic stays learnable for a tiny model; the vocabulary
is kept small (sampling over a large vocabulary dominates a CPU decode step).

    python -m periodic_async tokenizer artifacts/tokenizer
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from periodic_async.config import DataConfig
from periodic_async.data.prompts import INSTRUCTION
from periodic_async.data.tasks import make_synthetic

PAD, EOS, USER, ASSISTANT = "<|pad|>", "<|endoftext|>", "<|user|>", "<|assistant|>"

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS +
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train a BPE tokenizer on synthetic task text (+ ASCII) and save it to `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFKC()
    # ByteLevel keeps every string encodable; Digits(individual) keeps numbers digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, USER, ASSISTANT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=None,
        additional_special_tokens=[USER, ASSISTANT], clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return load_tokenizer(out)


def synthetic_corpus(seed: int = 0, n: int = 3000) -> Iterator[str]:
    """Text the tokenizer tokenizer is trained on: problems, solutions and the instruction."""
    cfg = DataConfig(min_steps=1, max_steps=4, max_operand=99)
    for ex in make_synthetic(n, cfg, seed):
        yield f"{ex.question}\n{INSTRUCTION}\n{ex.solution}"


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer directory (ours or any HF model's) and check it can serve RL."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(p)!r} does not exist "
                                f"(build one with `python -m periodic_async tokenizer {p}`)")
    tok = AutoTokenizer.from_pretrained(str(p))
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer at {str(p)!r} has no eos token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if not tok.chat_template:
        raise ValueError(f"tokenizer at {str(p)!r} has no chat template")
    return tok


def ensure_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load the tokenizer at `path`, building our BPE there first if the directory is absent."""
    p = Path(path)
    if not (p / "tokenizer_config.json").is_file():
        build_tokenizer(p)
    return load_tokenizer(p)


def main(argv: list[str] | None = None) -> None:
    """`python -m periodic_async tokenizer [DIR]`: build the tokenizer in DIR (default artifacts/tokenizer)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m periodic_async tokenizer", description=main.__doc__)
    parser.add_argument("directory", nargs="?", default="artifacts/tokenizer")
    args = parser.parse_args(argv)
    t = build_tokenizer(args.directory)
    print(f"saved tokenizer with {len(t)} tokens to {args.directory}")

