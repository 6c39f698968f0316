"""Train Cantata's shared byte-level BPE tokenizer (with the chat template) and encode conversations.

    python -m specialists.train tokenizer --corpora data/corpora --chat data/chat --out data/tokenizer \
        [--vocab-size 4096] [--max-mb 60]

The training text is a deterministic sample of the four domains' train splits (documents picked by a hash
of their path, each capped in length) plus the rendered train conversations. The output directory loads with
`transformers.AutoTokenizer.from_pretrained(out)`; its `apply_chat_template` is `specialists.chat.render`.
"""

from __future__ import annotations

import argparse
import json
import logging
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from specialists.chat import CHAT_TEMPLATE, EOS_TOKEN, IM_START, PAD_TOKEN, SPECIAL_TOKENS, render
from specialists.train.domains import DOMAINS

log = logging.getLogger(__name__)

MAX_DOC_CHARS = 64_000  # longer documents contribute only their head to the sample
MODEL_MAX_LENGTH = 2048


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path, show_progress: bool = False) -> Path:
    """Train the byte-level BPE on `texts` and save a transformers-loadable tokenizer in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, f"special token {token} got id {tok.token_to_id(token)}"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": config["additional_special_tokens"],
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out_dir


def load_tokenizer(path: Path | str):  # noqa: ANN201 - transformers.PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def assistant_spans(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                    add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of the assistant turns' bodies (content, tool calls and
    the closing <|im_end|>; not the `<|im_start|>assistant\\n` header nor the newline after the turn)."""
    text = render(messages, tools, add_generation_prompt=add_generation_prompt)
    header = f"{IM_START}assistant\n"
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = len(render(messages[:i], tools)) if i else len(render([], tools))
        after = len(render(messages[: i + 1], tools))
        if text[before: before + len(header)] != header or text[after - 1 - len(EOS_TOKEN): after - 1] != EOS_TOKEN:
            raise ValueError("chat template is not prefix-stable around an assistant turn")
        spans.append((before + len(header), after - 1))
    return text, spans


def encode_conversation(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a loss mask that is 1 exactly on assistant-turn tokens.

    The ids equal `tokenizer(render(messages, tools), add_special_tokens=False)["input_ids"]`.
    """
    text, spans = assistant_spans(messages, tools)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    mask = [0] * len(ids)
    j = 0
    for k, (start, _end) in enumerate(enc["offset_mapping"]):
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        if j < len(spans) and spans[j][0] <= start < spans[j][1]:
            mask[k] = 1
    return ids, mask


# ----------------------------------------------------------------------------------------------- training data


def _sample_documents(corpora: Path, domain: str, budget_chars: int) -> Iterator[str]:
    """A deterministic sample of a domain's train documents of about `budget_chars` characters."""
    from specialists.train.corpus import iter_documents

    path = corpora / domain / "train.jsonl"
    size = path.stat().st_size if path.exists() else 0
    rate = 1.0 if size <= budget_chars else budget_chars / size
    used = 0
    for doc in iter_documents(corpora, domain, "train"):
        if used >= budget_chars:
            break
        if zlib.crc32(doc["path"].encode()) / 2**32 >= rate * 1.15:  # slight oversampling, capped by budget
            continue
        text = doc["text"][:MAX_DOC_CHARS]
        used += len(text)
        yield text


def _sample_conversations(chat_dir: Path, domain: str, budget_chars: int) -> Iterator[str]:
    path = chat_dir / domain / "train.jsonl"
    if not path.exists():
        log.warning("no conversations at %s", path)
        return
    used = 0
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            text = render(row["messages"], row.get("tools"))
            used += len(text)
            yield text
            if used >= budget_chars:
                break


def training_texts(corpora: Path, chat_dir: Path | None, max_mb: float, chat_share: float = 0.2) -> Iterator[str]:
    from tqdm import tqdm

    total = int(max_mb * 1_000_000)
    doc_budget = int(total * (1 - chat_share) / len(DOMAINS)) if chat_dir else total // len(DOMAINS)
    chat_budget = int(total * chat_share / len(DOMAINS))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizer sample")
    for domain in DOMAINS:
        for text in _sample_documents(corpora, domain, doc_budget):
            bar.update(len(text))
            yield text
        if chat_dir is not None:
            for text in _sample_conversations(chat_dir, domain, chat_budget):
                bar.update(len(text))
                yield text
    bar.close()


def compression_report(tokenizer: Any, corpora: Path, chat_dir: Path | None,
                       max_chars: int = 2_000_000) -> dict[str, dict[str, float]]:
    """Characters per token on each domain's validation documents (and conversations when present)."""
    from specialists.train.corpus import iter_documents

    report: dict[str, dict[str, float]] = {}
    for domain in DOMAINS:
        entry: dict[str, float] = {}
        chars = tokens = 0
        try:
            for doc in iter_documents(corpora, domain, "validation"):
                text = doc["text"][:MAX_DOC_CHARS]
                chars += len(text)
                tokens += len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
                if chars >= max_chars:
                    break
        except FileNotFoundError:
            pass
        if tokens:
            entry["docs_chars_per_token"] = round(chars / tokens, 3)
        path = (chat_dir / domain / "validation.jsonl") if chat_dir else None
        if path is not None and path.exists():
            with path.open() as f:
                texts = [render(row["messages"], row.get("tools")) for row in map(json.loads, f)]
            lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]
            if lengths:
                entry["chat_chars_per_token"] = round(sum(map(len, texts)) / sum(lengths), 3)
                entry["chat_tokens_mean"] = round(sum(lengths) / len(lengths), 1)
                entry["chat_tokens_max"] = max(lengths)
        report[domain] = entry
    return report


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m specialists.train tokenizer", description=__doc__.split("\n")[0])
    parser.add_argument("--corpora", type=Path, default=Path("data/corpora"))
    parser.add_argument("--chat", type=Path, default=Path("data/chat"), help="conversations dir (optional)")
    parser.add_argument("--out", type=Path, default=Path("data/tokenizer"))
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-mb", type=float, default=60.0, help="training sample size in MB of text")
    args = parser.parse_args(argv)

    chat_dir = args.chat if args.chat and args.chat.exists() else None
    if chat_dir is None:
        log.warning("conversations dir %s missing: training on corpora only", args.chat)
    log.info("training BPE vocab=%d on <= %.0f MB sampled from %s", args.vocab_size, args.max_mb, args.corpora)
    train_tokenizer(training_texts(args.corpora, chat_dir, args.max_mb), args.vocab_size, args.out)
    tok = load_tokenizer(args.out)
    probe = "int main() {\n\treturn 0; // ünïcode ✓\n}\n" + render(
        [{"role": "user", "content": "hi"}], None, add_generation_prompt=True)
    assert tok.decode(tok(probe, add_special_tokens=False)["input_ids"]) == probe, "round trip failed"
    report = compression_report(tok, args.corpora, chat_dir)
    stats = {"vocab_size": len(tok), "special_tokens": list(SPECIAL_TOKENS), "chars_per_token": report}
    (args.out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    for domain, entry in report.items():
        log.info("%-6s %s", domain, entry)
    log.info("wrote %s (vocab %d)", args.out, len(tok))
    return 0
