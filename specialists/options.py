"""The engine's options, asked for once and resolved once.

  opts = EngineOptions(device="cuda", max_num_seqs=8)          # what a caller asks for (None: default)
  cfg = opts.resolve(model_max_len=4096)                       # what the engine runs with: no None left
  engine = Engine.from_pretrained(path, opts)                  # or Engine.from_pretrained(path, device="cuda", ...)

`resolve` picks the per-device defaults and reads the environment variables, here and nowhere else:
CANTATA_CUDA_GRAPHS=0 turns CUDA graphs off, CANTATA_STATIC_BATCHES=1 runs static batches eagerly where
there are no graphs (the CPU tests of the graph path). The runner, the drafter and the scheduler get the
resolved `EngineConfig` (or the few fields they need), never the raw options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_DECODE_STEPS = 4  # with CUDA graphs: a step's host work (~0.4 ms at 1B on an H100) paid once per 4 tokens
DEFAULT_PREFILL_GRAPH_TOKENS = 2048  # a fresh prompt's prefill graphs: 128, 256, ..., 2048 tokens (prefill_graph.py)


class OptionsError(ValueError):
    """Options that cannot be served (an unknown name, or a combination that contradicts itself)."""


@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_num_seqs: int = 16
    max_model_len: int | None = None  # None: 2048; always capped by the model's max_position_embeddings
    block_size: int = 16
    num_blocks: int | None = None  # None: room for max_num_seqs full-length sequences
    enable_prefix_cache: bool = True  # hybrids too: with Mamba state snapshots at block boundaries
    ssm_snapshots: int | None = None  # hybrids: snapshot pool size (None: 256 MiB worth; 0: no prefix cache for hybrids)
    # hybrids: tokens between two snapshots, a multiple of block_size (None: state.ssm_snapshots.default_stride,
    # the block size for small states, coarser where a snapshot is large: 256 tokens at bamba-1b's 24 MiB)
    ssm_snapshot_stride: int | None = None
    max_num_batched_tokens: int = 4096
    check_invariants: bool = True  # assert KV pointer == committed length for every sequence, every step
    load_mtp: bool = True  # load the checkpoint's MTP drafter (when the policy may speculate)
    draft_vocab_size: int | None = None  # draft over the first N tokens of mtp_vocab (None: all of it; 0: whole vocab)
    draft_min_confidence: float | None = None  # stop a chain below this drafter probability (None: off)
    pad_batches: bool | None = None  # pad decode / verify batches to buckets (None: on CUDA or static batches)
    cuda_graphs: bool | None = None  # static steps as CUDA graphs (None: on CUDA unless CANTATA_CUDA_GRAPHS=0)
    static_batches: bool | None = None  # static batches without graphs (None: CANTATA_STATIC_BATCHES=1)
    fused_drafter: bool | None = None  # static chains / rebuilds as Triton kernels (None: on CUDA with Triton)
    decode_steps: int | None = None  # greedy plain decodes per static step, one sync (None: 4 with CUDA graphs, else 1)
    decode_ahead: bool | None = None  # launch the next plain multi-step decode before reading this one (None: with CUDA graphs)
    verify_ahead: bool | None = None  # launch the next greedy verify before reading this one (None: with CUDA graphs; not hybrids)
    # prompts' prefills that are their step's only rows (fresh, or after prefix hits) padded to a length of
    # specialists/prefill_graph.PREFILL_LENGTHS, up to this many tokens in all, a CUDA graph per (rows, length, width)
    # (None: 2048 where CUDA graphs run in half precision, else 0, off; on a CPU it only pads: for tests)
    prefill_graph_tokens: int | None = None
    # hybrids: MiB each role of the static steps' per-token Mamba states may take (specialists/staged_states.py);
    # K and decode_steps shrink at batch sizes whose steps would stage more (None: on CUDA 5% of the device's memory)
    staged_state_mib: float | None = None
    # what constrained decoding adds where a schema leaves strings, arrays or numbers unbounded
    # (specialists/grammar.Bounds' fields: max_string, max_items, number_range); None: the checkpoint's
    # cantata.json "serving": {"grammar_bounds": ...} if any, else none (integers stay in JSON's safe range)
    grammar_bounds: dict | None = None
    # the target's products on the CPU (specialists/quantize.py): "none" (fp32 / the checkpoint's dtype),
    # "int8" (weight-only int8 per output row; a verify's rows give a plain decode's products bit for bit),
    # "q4" (the 4-bit blocks of the GGUF the checkpoint was imported from, as llama.cpp reads them) or
    # "auto" (None): on a CPU with the native kernels, for an attention-only checkpoint of >= 50M
    # parameters q4 where it has GGUF blocks, else int8; else none (a GPU; the embedded toys, the
    # exactness test bed against transformers)
    quantization: str | None = None

    @classmethod
    def from_keywords(cls, base: EngineOptions | None = None, **kw) -> EngineOptions:
        """`base` (default options if None) with the named fields replaced; unknown names raise."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise OptionsError(f"unknown engine options {unknown}; known: {sorted(known)}")
        base = base or cls()
        return cls(**{**{f.name: getattr(base, f.name) for f in fields(cls)}, **kw})

    def resolve(self, model_max_len: int | None = None, hidden_size: int | None = None) -> EngineConfig:
        """hidden_size: the model's width (picks the drafter's kernels when fused_drafter is None)."""
        dev = torch.device(self.device)
        graphs = dev.type == "cuda" and self.cuda_graphs is not False and os.environ.get("CANTATA_CUDA_GRAPHS", "1") != "0"
        static = graphs or bool(self.static_batches if self.static_batches is not None
                                else os.environ.get("CANTATA_STATIC_BATCHES") == "1")
        pad = (dev.type == "cuda" or static) if self.pad_batches is None else self.pad_batches
        static = static and pad  # static batches are padded ones: pad_batches=False turns them (and graphs) off
        limit = self.max_model_len or DEFAULT_MAX_MODEL_LEN
        if model_max_len is not None:
            limit = min(limit, model_max_len)
        num_blocks = self.num_blocks or self.max_num_seqs * -(-limit // self.block_size)
        if self.quantization not in (None, "auto", "none", "int8", "q4"):
            raise OptionsError(f"quantization must be 'auto', 'none', 'int8' or 'q4', got {self.quantization!r}")
        if self.staged_state_mib is not None and self.staged_state_mib <= 0:
            raise OptionsError(f"staged_state_mib must be > 0, got {self.staged_state_mib}")
        if self.ssm_snapshots is not None and self.ssm_snapshots < 0:
            raise OptionsError(f"ssm_snapshots must be >= 0, got {self.ssm_snapshots}")
        stride = self.ssm_snapshot_stride
        if stride is not None and (stride <= 0 or stride % self.block_size):
            raise OptionsError(f"ssm_snapshot_stride must be a positive multiple of block_size {self.block_size}, got {stride}")
        if self.prefill_graph_tokens is not None and self.prefill_graph_tokens < 0:
            raise OptionsError(f"prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens}")
        return EngineConfig(
            device=dev, dtype=self.dtype, max_num_seqs=self.max_num_seqs, max_model_len=limit,
            block_size=self.block_size, num_blocks=num_blocks, enable_prefix_cache=self.enable_prefix_cache,
            ssm_snapshots=self.ssm_snapshots, ssm_snapshot_stride=stride,
            max_num_batched_tokens=self.max_num_batched_tokens, check_invariants=self.check_invariants,
            draft_min_confidence=self.draft_min_confidence or 0.0, pad_batches=pad, static_batches=static,
            cuda_graphs=graphs and static, fused_drafter=_fused_default(dev, self.fused_drafter, hidden_size),
            decode_steps=_decode_steps(self.decode_steps, graphs and static, self.block_size),
            decode_ahead=static and (graphs if self.decode_ahead is None else self.decode_ahead),
            verify_ahead=static and (graphs if self.verify_ahead is None else self.verify_ahead),
            quantization=self.quantization or "auto", staged_state_mib=self.staged_state_mib,
            prefill_graph_tokens=self.prefill_graph_tokens if self.prefill_graph_tokens is not None else
            (DEFAULT_PREFILL_GRAPH_TOKENS if graphs and static and self.dtype in (torch.bfloat16, torch.float16) else 0),
        )


@dataclass(frozen=True)
class EngineConfig:
    """Resolved options: concrete values only (see EngineOptions for their meaning)."""

    device: torch.device
    dtype: torch.dtype
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_cache: bool
    ssm_snapshots: int | None  # None: state.ssm_snapshots.default_capacity (the model's state size decides)
    ssm_snapshot_stride: int | None  # None: state.ssm_snapshots.default_stride (the engine resolves it)
    max_num_batched_tokens: int
    check_invariants: bool
    draft_min_confidence: float  # 0.0: off
    pad_batches: bool
    static_batches: bool  # decode / verify steps of one shape run static (graphs when cuda_graphs)
    cuda_graphs: bool
    fused_drafter: bool
    decode_steps: int
    decode_ahead: bool  # spec/decode_ahead.py: static multi-step decodes (hybrids too)
    verify_ahead: bool = False  # spec/verify_ahead.py: greedy static verifies (attention-only models)
    quantization: str = "auto"  # the engine resolves "auto" against its model (quantize.resolve)
    staged_state_mib: float | None = None  # None: on CUDA a share of the device's memory, else no bound (staged_states.py)
    prefill_graph_tokens: int = 0  # 0: every prefill eager


def _decode_steps(asked: int | None, graphs: bool, block_size: int) -> int:
    """Greedy plain decodes per static step: asked, or 4 where CUDA graphs run (1 elsewhere: the
    host's share of a CPU step is small). At most block_size (one step reserves that many slots)."""
    steps = asked if asked is not None else (DEFAULT_DECODE_STEPS if graphs else 1)
    if not 1 <= steps <= block_size:
        raise OptionsError(f"decode_steps must be in [1, {block_size}] (the block size), got {steps}")
    return steps


FUSED_MAX_HIDDEN = 1024  # the fused drafter pays at small widths (smollm2-135m, d 576: 0.029 of a target step per draft)


def _fused_default(device: torch.device, fused: bool | None, hidden_size: int | None = None) -> bool:
    """True asks for the fused kernels (CPU tensors need TRITON_INTERPRET=1); None: on CUDA where
    Triton imports, for models at most FUSED_MAX_HIDDEN wide. They fuse a drafter layer of the toys
    (d 256) into 8 kernels; at real widths their products are 1.5-4x slower than cuBLAS's (H100, bf16,
    bench/results/fused_tune.jsonl: d 2048, down [2048 x 8192] at 4 rows 72 us against 23 us), and
    the drafter's chain cost 1.8 ms a step at the Llama-3.2-1B shape."""
    if fused is not None:
        return fused
    if device.type != "cuda" or (hidden_size is not None and hidden_size > FUSED_MAX_HIDDEN):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
