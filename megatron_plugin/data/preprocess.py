"""`megatron-plugin preprocess-data`: tokenize text into a Megatron indexed dataset (.bin/.idx) with an HF
tokenizer and megatron-core's writer, as Megatron-LM's tools/preprocess_data.py does (that script is not
part of the megatron-core package).

Input: JSON lines (one document per line, its text under `json_key`) or plain text (one document per
non-empty line). Output: <output_prefix>_<json_key>_document.bin/.idx; that prefix is what
`MegatronLMDummyDataLoader(data_path=...)` takes."""

from __future__ import annotations

import json
import os
from typing import Iterator

from ..errors import MegatronPluginConfigError
from ..fs import check_writable


def _documents(path: str, json_key: str) -> Iterator[str]:
    as_json = path.endswith((".jsonl", ".json"))
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not as_json:
                yield line.rstrip("\n")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise MegatronPluginConfigError("input", f"{path} line {n}",
                                                f"is not JSON ({err.msg}): pass JSON lines, or a .txt file") from None
            if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                raise MegatronPluginConfigError(
                    "json_key", json_key, f"{path} line {n} has no text under {json_key!r}: name the key that holds it",
                )
            yield record[json_key]


def preprocess_data(input_path: str, tokenizer, output_prefix: str, json_key: str = "text", append_eod: bool = True,
                    add_special_tokens: bool = True, batch_size: int = 1000) -> str:
    """Write the dataset; returns its prefix (<output_prefix>_<json_key>_document). `tokenizer` is an HF
    tokenizer or a local folder holding one. Each document gets the tokenizer's eos token appended
    (`append_eod`): GPTDataset concatenates documents, and the end-of-document id is what tells them apart."""
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    if not os.path.isfile(input_path):
        raise MegatronPluginConfigError("input", input_path, "no such file: pass a .jsonl or .txt file")
    if isinstance(tokenizer, (str, os.PathLike)):
        if not os.path.isdir(tokenizer):
            raise MegatronPluginConfigError("tokenizer", tokenizer, "pass a local folder with an HF tokenizer "
                                                                    "(tokenizer.save_pretrained writes one)")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise MegatronPluginConfigError("tokenizer", type(tokenizer).__name__, "pass an HF tokenizer or its folder")
    eod = tokenizer.eos_token_id
    if append_eod and eod is None:
        raise MegatronPluginConfigError("append_eod", True, "the tokenizer has no eos token to end documents with: "
                                                           "give it one (tokenizer.eos_token = ...) or turn append_eod off")
    check_writable(os.path.dirname(os.path.abspath(output_prefix)), "output_prefix")

    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = f"{output_prefix}_{json_key}_document"
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=DType.optimal_dtype(len(tokenizer)))
    docs = tokens = 0

    def write(texts):
        nonlocal docs, tokens
        for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]:
            ids = list(ids) + ([eod] if append_eod else [])
            if ids:
                builder.add_document(torch.tensor(ids), [len(ids)])
                docs, tokens = docs + 1, tokens + len(ids)

    try:
        batch = []
        for text in _documents(input_path, json_key):
            batch.append(text)
            if len(batch) == batch_size:
                write(batch)
                batch = []
        if batch:
            write(batch)
        builder.finalize(tmp + ".idx")
        if docs == 0:
            raise MegatronPluginConfigError("input", input_path, "holds no document with tokens")
        # the .idx last: a reader finds a pair only once both are whole
        os.replace(tmp + ".bin", prefix + ".bin")
        os.replace(tmp + ".idx", prefix + ".idx")
    finally:
        for ext in (".bin", ".idx"):
            if os.path.exists(tmp + ext):
                os.remove(tmp + ext)
    print(f"wrote {docs} documents, {tokens} tokens: {prefix}.bin/.idx (data_path={prefix!r})")
    return prefix
