"""`layerwise-hf assets tiny DIR`: a tiny random Llama with its tokenizer and a small dataset in the formats axolotl
and LLaMA-Factory read, so a first layer-wise run in either framework needs no network and trains in seconds on a CPU
(the configs `examples/frameworks/*-tiny.yaml` point at `out/tiny`).

What DIR holds afterwards:

- `model/`: a 2-layer Llama (0.4M parameters, random init from a config, float32) and a byte-level tokenizer (any
  text encodes, so the frameworks' own prompt formats work), loadable with `from_pretrained`;
- `alpaca.jsonl`: instruction / input / output rows (axolotl's `type: alpaca`, LLaMA-Factory's default format);
- `text.jsonl`: the same rows as plain `text` (axolotl's `type: completion`, LLaMA-Factory's `stage: pt`);
- `dataset_info.json`: LLaMA-Factory's index of the two (`dataset: tiny_alpaca` or `tiny_text`, `dataset_dir: DIR`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

KINDS = ("tiny",)
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "forest", "rocket", "silver")
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
MAX_LENGTH = 512
DATASET_INFO = {
    "tiny_alpaca": {"file_name": "alpaca.jsonl"},
    "tiny_text": {"file_name": "text.jsonl", "columns": {"prompt": "text"}},
}


def tiny_rows(num_rows: int = 256, seed: int = 0) -> list[dict[str, str]]:
    """
    Instruction rows with one right answer each (counting, spelling backwards, repeating, adding), so the loss of a
    few dozen steps visibly falls.

    Example:

    ```python
    >>> from layerwise_hf.integrations.assets import tiny_rows
    >>> sorted(tiny_rows(1)[0])
    ['input', 'instruction', 'output']
    ```
    """
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        word = rng.choice(WORDS)
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        task = i % 4
        if task == 0:
            instruction, output = f"Count from {a} to {a + b % 8 + 2}.", " ".join(map(str, range(a, a + b % 8 + 3)))
        elif task == 1:
            instruction, output = f"Spell the word {word} backwards.", word[::-1]
        elif task == 2:
            n = b % 4 + 2
            instruction, output = f"Repeat the word {word} {n} times.", " ".join([word] * n)
        else:
            instruction, output = f"Add {a} and {b}.", str(a + b)
        rows.append({"instruction": instruction, "input": "", "output": output})
    return rows


def byte_level_tokenizer():
    """A byte-level tokenizer with no merges: every text encodes, one token per byte, plus pad / bos / eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    pad, bos, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=pad, bos_token=bos, eos_token=eos, model_max_length=MAX_LENGTH
    )


def make_tiny_assets(folder: str | Path, seed: int = 0, overwrite: bool = False) -> Path:
    """
    Write a tiny random Llama with its tokenizer and a dataset for axolotl and LLaMA-Factory into `folder` (the module
    docstring lists the files); returns the model's folder. Nothing is downloaded.

    Args:
        folder (`str` or `Path`):
            Where to write; created if missing.
        seed (`int`, *optional*, defaults to 0):
            Seeds the model's initialisation and the rows: the same seed writes the same files.
        overwrite (`bool`, *optional*, defaults to `False`):
            Replace files a previous call wrote; otherwise a folder that already holds them is refused.

    Example:

    ```python
    >>> from transformers import AutoModelForCausalLM
    >>> from layerwise_hf.integrations.assets import make_tiny_assets
    >>> model_dir = make_tiny_assets("out/tiny")
    >>> AutoModelForCausalLM.from_pretrained(model_dir).config.num_hidden_layers
    2
    ```
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file; give a folder for the tiny assets.")
    written = [folder / name for name in ("model", "alpaca.jsonl", "text.jsonl", "dataset_info.json")]
    existing = [str(p) for p in written if p.exists()]
    if existing and not overwrite:
        raise ValueError(
            f"{folder} already holds tiny assets ({', '.join(existing)}); use them as they are, choose another "
            "folder, or pass --overwrite to write them again."
        )
    model_dir = folder / "model"
    tokenizer = byte_level_tokenizer()
    tokenizer.save_pretrained(model_dir)
    # NOTE: transformers 5 saves its own class name, "TokenizersBackend", which transformers 4 cannot load; the
    # frameworks pin either, and both load "PreTrainedTokenizerFast".
    tokenizer_config = model_dir / "tokenizer_config.json"
    saved = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**saved, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LENGTH,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # NOTE: fork_rng keeps the caller's global torch seed as it was: the assets are a side product of a run.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(model_dir)
    rows = tiny_rows(seed=seed)
    (folder / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = [{"text": f"{r['instruction']} {r['output']}"} for r in rows]
    (folder / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in texts))
    (folder / "dataset_info.json").write_text(json.dumps(DATASET_INFO, indent=2) + "\n")
    return model_dir


def register(subparsers) -> None:
    """
    Add the `assets` subcommand to the `layerwise-hf` command line.

    Example:

    ```python
    >>> from layerwise_hf.cli import build_parser  # registers this subcommand with the others
    >>> build_parser().parse_args(["assets", "tiny", "out/tiny"]).folder
    'out/tiny'
    ```
    """
    parser = subparsers.add_parser(
        "assets",
        help="write a tiny local model and dataset for a first run (no network)",
        description="Write a tiny random Llama with a byte-level tokenizer, and a dataset in axolotl's and "
        "LLaMA-Factory's formats (with LLaMA-Factory's dataset_info.json), into FOLDER: what "
        "examples/frameworks/*-tiny.yaml train on, offline, in seconds on a CPU.",
    )
    parser.add_argument("kind", choices=KINDS, help="which assets: 'tiny' (0.4M-parameter Llama, 256 rows)")
    parser.add_argument("folder", help="where to write them (the example configs read out/tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model's initialisation and the rows")
    parser.add_argument("--overwrite", action="store_true", help="replace assets a previous call wrote there")
    parser.set_defaults(func=_run_assets)


def _run_assets(args: argparse.Namespace) -> int:
    try:
        model_dir = make_tiny_assets(args.folder, seed=args.seed, overwrite=args.overwrite)
    except ValueError as err:
        raise SystemExit(f"layerwise-hf assets: {err}") from None
    folder = Path(args.folder)
    print(f"model and tokenizer: {model_dir}")
    print(f"data: {folder / 'alpaca.jsonl'}, {folder / 'text.jsonl'}")
    print(f"LLaMA-Factory's index: {folder / 'dataset_info.json'} (dataset: tiny_alpaca or tiny_text)")
    return 0
