"""Chat and tool-calling evaluation of one specialist checkpoint.

    python -m bench.chat_eval --model DIR [--data bench/data/<domain>] [--limit N] [--max-new-tokens 256]
                              [--batch-size 16]

Loads DIR with transformers (float32, CPU) and greedily generates (batched, left padding, stopping at
<|im_end|>) replies to:

* tool_convs.jsonl    a call is expected: the fraction of replies whose first tool call parses, names an offered
                      tool and carries arguments valid against that tool's schema (tool_call_valid), and the
                      fraction naming the expected tool (tool_name_match);
* chat_prompts.jsonl  with tools null: the fraction of replies containing a <tool_call> (no_tools_call_rate);
                      all of them: the fraction ending with <|im_end|> within --max-new-tokens (end_of_turn_rate).

The last line of stdout is one JSON object with those figures. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from bench.common import checkpoint_id, device_name, git_commit, read_jsonl, record
from specialists.chat import TOOL_CALL_OPEN, parse_tool_calls, render, tool_name, validate_arguments
from specialists.train.hf_generate import Reply, generate

log = logging.getLogger("bench.chat_eval")


def model_domain(model_dir: Path) -> str:
    meta = model_dir / "cantata.json"
    if meta.exists():
        try:
            domain = json.loads(meta.read_text()).get("domain")
            if domain:
                return str(domain)
        except (ValueError, AttributeError):
            log.warning("unreadable %s", meta)
    return model_dir.resolve().name


def score_tool_call(reply: str, tools: list[dict[str, Any]], expected: dict[str, Any]) -> tuple[bool, bool]:
    """(valid, name matches) for the first tool call of a reply."""
    _, calls = parse_tool_calls(reply)
    if not calls or calls[0].error:
        return False, False
    call = calls[0]
    offered = {tool_name(t): t for t in tools}
    name_match = call.name == expected.get("name")
    if call.name not in offered:
        return False, name_match
    return validate_arguments(call.arguments, offered[call.name]) is None, name_match


def evaluate(model: Any, tokenizer: Any, data: Path, limit: int | None, max_new_tokens: int,
             batch_size: int) -> dict[str, Any]:
    tool_rows = read_jsonl(data / "tool_convs.jsonl", limit)
    chat_rows = read_jsonl(data / "chat_prompts.jsonl", limit)

    tool_replies = generate(model, tokenizer, [render(r["messages"], r["tools"], add_generation_prompt=True)
                                               for r in tool_rows], max_new_tokens, batch_size, "tool_convs")
    valid = match = 0
    for row, reply in zip(tool_rows, tool_replies):
        ok, same = score_tool_call(reply.text, row["tools"], row["expected"])
        valid += ok
        match += same
    chat_replies = generate(model, tokenizer, [render(r["messages"], r.get("tools"), add_generation_prompt=True)
                                               for r in chat_rows], max_new_tokens, batch_size, "chat_prompts")
    no_tools = [rep for row, rep in zip(chat_rows, chat_replies) if not row.get("tools")]
    return {
        "tool_convs": len(tool_rows),
        "tool_call_valid": round(valid / len(tool_rows), 4) if tool_rows else None,
        "tool_name_match": round(match / len(tool_rows), 4) if tool_rows else None,
        "no_tools_prompts": len(no_tools),
        "no_tools_call_rate": round(sum(TOOL_CALL_OPEN in r.text for r in no_tools) / len(no_tools), 4) if no_tools else None,
        "chat_prompts": len(chat_rows),
        "end_of_turn_rate": round(sum(r.ended for r in chat_replies) / len(chat_replies), 4) if chat_replies else None,
        "end_of_turn_by_kind": end_of_turn_by_kind(chat_rows, chat_replies),
    }


def end_of_turn_by_kind(rows: list[dict[str, Any]], replies: list[Reply]) -> dict[str, float]:
    kinds: dict[str, list[bool]] = {}
    for row, reply in zip(rows, replies):
        kinds.setdefault(row.get("kind", "?"), []).append(reply.ended)
    return {kind: round(sum(v) / len(v), 4) for kind, v in sorted(kinds.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chat_eval", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory (model.safetensors)")
    parser.add_argument("--data", type=Path, default=None, help="default: bench/data/<domain of the model>")
    parser.add_argument("--limit", type=int, default=None, help="rows per file")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--results", type=Path, default=None, help="append the result as a JSONL row here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)

    weights = args.model / "model.safetensors"
    if not weights.is_file():
        print(f"error: {args.model} has no model.safetensors; train or download the checkpoint first",
              file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    domain = model_domain(args.model)
    data = args.data or Path("bench/data") / domain
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    log.info("loaded checkpoint %s (%s, %.2fM parameters, domain %s), data %s",
             weights, type(model).__name__, n_params / 1e6, domain, data)
    torch.manual_seed(0)
    result = {"model": str(args.model), "domain": domain,
              **evaluate(model, tokenizer, data, args.limit, args.max_new_tokens, args.batch_size)}
    record(args.results, {"bench": "chat_eval", **result, "max_new_tokens": args.max_new_tokens,
                          "checkpoint": checkpoint_id(args.model), "device": device_name("cpu"), "commit": git_commit()})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
