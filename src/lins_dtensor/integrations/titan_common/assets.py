"""Offline assets: a small BPE tokenizer and a text corpus built from Python's own files.

No machine here reaches a model or data hub, so the debug job trains its tokenizer
(``tokenizers``) and reads its corpus from the standard library's ``.py`` sources,
which every Python installation ships. Both are written once, on first use, into the
folder given by the tokenizer path (``hf_assets_path``; the debug configs put it under the run
folder); a folder that already holds a ``tokenizer.json`` is used as is, so real
tokenizers and torchtitan's own datasets keep working.
"""

from __future__ import annotations

import fcntl
import json
import os
import sysconfig
from pathlib import Path

from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

DATASET_NAME = "python_stdlib"
CORPUS_FILE = "corpus.jsonl"
_MAX_CORPUS_BYTES = 3_000_000  # ~3 MB of text: ~1M tokens, plenty for debug runs
_MAX_FILE_BYTES = 60_000
_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")


def _stdlib_texts() -> list[tuple[str, str]]:
    """(relative path, text) of stdlib sources, in a fixed order (same on every rank)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "test/", "idlelib/", "lib2to3/tests/")):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = text[:_MAX_FILE_BYTES]
        if len(text) < 200:
            continue
        out.append((rel, text))
        total += len(text)
        if total >= _MAX_CORPUS_BYTES:
            break
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def ensure_offline_assets(folder: str | os.PathLike, vocab_size: int) -> Path:
    """Make ``folder`` hold tokenizer.json, tokenizer_config.json and corpus.jsonl.

    Safe to call from every rank at once: the first takes a file lock and builds,
    the others wait for it and find the files there.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lins_assets.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (folder / CORPUS_FILE).exists():
                lines = (json.dumps({"text": text, "source": rel}) for rel, text in _stdlib_texts())
                _write_atomic(folder / CORPUS_FILE, "\n".join(lines) + "\n")
            if not (folder / "tokenizer.json").exists():
                _train_tokenizer(folder, vocab_size)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def _train_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        with open(folder / CORPUS_FILE, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tokenizer.train_from_iterator(texts(), trainer=trainer)
    _write_atomic(folder / "tokenizer.json", tokenizer.to_str())
    config = {
        "bos_token": _SPECIALS[0],
        "eos_token": _SPECIALS[1],
        "pad_token": _SPECIALS[2],
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1 << 20,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_atomic(folder / "tokenizer_config.json", json.dumps(config, indent=1))


def _load_corpus(path: str):
    """torchtitan dataset loader: ``path`` is a corpus.jsonl file or the folder holding it."""
    from datasets import Dataset

    file = Path(path)
    if file.is_dir():
        file = file / CORPUS_FILE
    if not file.exists():
        raise FileNotFoundError(
            f"lins: dataset '{DATASET_NAME}': {file} does not exist; it is written on first run when "
            "the Lins setting offline_assets is true and the dataset path (or the tokenizer's hf_assets_path) names its folder"
        )
    rows = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return Dataset.from_dict({"text": [r["text"] for r in rows]})


def register_dataset() -> None:
    """Add ``python_stdlib`` to torchtitan's dataset registry (idempotent)."""
    if DATASET_NAME not in DATASETS:
        DATASETS[DATASET_NAME] = DatasetConfig(path="", loader=_load_corpus, sample_processor=lambda s: s["text"])


def prepare(lins, assets_folder: str, vocab_size: int) -> None:
    """Write the offline tokenizer and corpus into ``assets_folder`` when the Lins
    settings ask for them and the folder has no ``tokenizer.json`` yet."""
    if lins is not None and lins.offline_assets and assets_folder and not Path(assets_folder, "tokenizer.json").exists():
        ensure_offline_assets(assets_folder, vocab_size)
