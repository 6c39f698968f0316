"""Backbone and MTP-drafter training.

  python -m specialists.train backbone --domain cpp --data data/packed --tokenizer data/tokenizer \
      --out runs/cpp [--preset bamba-small] [--steps 4000] [--time-budget-s 300] [--device cuda]
  python -m specialists.train mtp --domain cpp --data data/packed --out runs/cpp [--k 3] [--steps 2000]

Both: AdamW, cosine schedule with a floor (schedule.py), deterministic batches in (seed, step),
bf16 autocast on CUDA, tqdm progress, a resumable state (safetensors + JSON) every --save-every steps;
rerunning the same command resumes. The backbone is saved as a standard transformers checkpoint in
<out>/backbone; the drafter is trained with the backbone frozen and saved beside it
(<out>/backbone/mtp.safetensors + mtp_config.json). Each writes <out>/<kind>_result.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specialists.models.configs import DEFAULT_PRESET, PRESETS, backbone_config
from specialists.ops.mamba_ssm_triton import load_triton_ssd
from specialists.models.mtp import MTPConfig, MTPDrafter, depth_weights, load_drafter, save_drafter
from specialists.train.data import Batch, TokenStreams, sample_batch
from specialists.train.domains import DOMAINS
from specialists.train.schedule import CosineWithFloor

log = logging.getLogger(__name__)


@dataclass
class RunArgs:
    kind: str  # "backbone" | "mtp"
    domain: str
    data: Path
    out: Path
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    floor_ratio: float
    time_budget_s: float | None
    seed: int
    device: str
    chat_fraction: float
    eval_every: int
    eval_batches: int
    save_every: int


def autocast(device: str) -> contextlib.AbstractContextManager:
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def masked_ce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [B, S, V], labels [B, S], mask [B, S] -> mean CE over masked tokens."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return (ce * mask.flatten()).sum() / mask.sum().clamp_min(1.0)


# ---- resumable state -------------------------------------------------------------------------


def save_state(folder: Path, module: torch.nn.Module, opt: torch.optim.Optimizer, scalars: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"param.{n}": p.detach().cpu().contiguous() for n, p in module.named_parameters() if p.requires_grad}
    for i, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            tensors[f"opt.{i}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    tmp = folder / "state.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(folder / "state.safetensors")
    (folder / "state.json").write_text(json.dumps(scalars, indent=2) + "\n")


def load_state(folder: Path, module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict | None:
    if not (folder / "state.json").is_file():
        return None
    tensors = load_file(str(folder / "state.safetensors"))
    with torch.no_grad():
        for n, p in module.named_parameters():
            if p.requires_grad:
                p.copy_(tensors[f"param.{n}"])
    opt_state = opt.state_dict()
    for i in opt_state["param_groups"][0]["params"]:
        prefix = f"opt.{i}."
        opt_state["state"][i] = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    opt.load_state_dict(opt_state)
    return json.loads((folder / "state.json").read_text())


# ---- the shared loop -------------------------------------------------------------------------


def run_loop(args: RunArgs, module: torch.nn.Module, params: list[torch.nn.Parameter], loss_fn, eval_fn, state_dir: Path, check=None) -> dict:
    """Optimize `params` with loss_fn(batch) -> (loss, metrics); returns the final record.
    `check(step)` runs after every step and may raise to stop a run that is going nowhere."""
    train = TokenStreams.load(args.data / args.domain / "train")
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=args.device.startswith("cuda"))
    sched = CosineWithFloor(args.lr, args.steps, args.warmup, args.floor_ratio, args.time_budget_s)
    resumed = load_state(state_dir, module, opt) or {}
    step, elapsed, tokens_seen = resumed.get("step", 0), resumed.get("elapsed_s", 0.0), resumed.get("tokens_seen", 0)
    ema: float | None = resumed.get("train_loss")
    if step:
        log.info("resumed %s/%s at step %d (%.0f s, %d tokens)", args.domain, args.kind, step, elapsed, tokens_seen)
    history: list[dict] = []
    bar = tqdm(total=args.steps, initial=step, desc=f"{args.domain}/{args.kind}", unit="step", mininterval=5)
    started = time.monotonic() - elapsed
    while not sched.done(step, time.monotonic() - started):
        lr = sched.lr(step, time.monotonic() - started)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = sample_batch(train, args.batch_size, args.seq_len, args.chat_fraction, args.seed, step).to(args.device)
        with autocast(args.device):
            loss, _ = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens_seen += batch.inputs.numel()
        if step % 10 == 0 or step == 1:  # one host sync per 10 steps for the progress line
            value = float(loss.detach())
            ema = value if ema is None else 0.8 * ema + 0.2 * value  # ~50-step window
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}")
        bar.update(1)
        if check is not None:
            check(step)
        if step % args.eval_every == 0:
            record = {"step": step, "train_loss": ema, **eval_fn()}
            history.append(record)
            log.info("%s/%s %s", args.domain, args.kind, record)
        if step % args.save_every == 0:
            save_state(state_dir, module, opt, {"step": step, "elapsed_s": time.monotonic() - started, "tokens_seen": tokens_seen, "train_loss": ema})
    bar.close()
    final = {"step": step, "train_loss": ema, **eval_fn()}
    return {"steps": step, "tokens_seen": tokens_seen, "seconds": round(time.monotonic() - started, 1), "history": history, "final": final}


def fixed_batches(args: RunArgs) -> list[Batch]:
    val = TokenStreams.load(args.data / args.domain / "validation")
    out = []
    for i in range(args.eval_batches):
        for frac, tag in ((0.0, "text"), (1.0, "chat")):
            out.append((tag, sample_batch(val, min(args.batch_size, 16), args.seq_len, frac, 10_000 + args.seed, i)))
    return out


# ---- backbone --------------------------------------------------------------------------------


def train_backbone(args: RunArgs, tokenizer_dir: Path, preset_name: str, init_from: Path | None = None) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    preset = PRESETS[preset_name]
    torch.manual_seed(args.seed)
    if init_from is not None:  # continue training a shipped checkpoint (fresh optimizer and schedule)
        model = AutoModelForCausalLM.from_pretrained(str(init_from), dtype=torch.float32).to(args.device)
    else:
        config = backbone_config(preset, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
        model = AutoModelForCausalLM.from_config(config).to(args.device)
    model.train()
    val = fixed_batches(args)

    def loss_fn(batch: Batch):
        logits = model(input_ids=batch.inputs, use_cache=False).logits
        return masked_ce(logits, batch.labels, batch.loss_mask), {}

    @torch.no_grad()
    def eval_fn() -> dict:
        model.eval()
        sums: dict[str, list[float]] = {"text": [], "chat": []}
        for tag, batch in val:
            batch = batch.to(args.device)
            with autocast(args.device):
                sums[tag].append(float(loss_fn(batch)[0]))
        model.train()
        return {f"val_{k}_loss": round(float(np.mean(v)), 4) for k, v in sums.items() if v}

    params = [p for p in model.parameters() if p.requires_grad]
    record = run_loop(args, model, params, loss_fn, eval_fn, args.out / "backbone_state")
    model.save_pretrained(str(args.out / "backbone"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy2(tokenizer_dir / name, args.out / "backbone" / name)
    record.update(preset=preset_name, family=preset.family, parameters=sum(p.numel() for p in params))
    if init_from is not None:
        previous = json.loads((init_from / "cantata.json").read_text()) if (init_from / "cantata.json").is_file() else {}
        prior = previous.get("backbone", {})
        record.update(init_from=str(init_from), prior_steps=prior.get("steps"), prior_tokens_seen=prior.get("tokens_seen"))
        record["tokens_seen_total"] = record["tokens_seen"] + (prior.get("tokens_seen_total") or prior.get("tokens_seen") or 0)
    return record


# ---- drafter ---------------------------------------------------------------------------------


def bigram_table(stream: np.ndarray, vocab: int) -> torch.Tensor:
    """[V] most frequent next token after each token: the trivial drafter the MTP must beat. Counted
    over the distinct pairs only (a dense V x V table of a 49k vocabulary would take 19 GB); ties go
    to the smaller token id, a token never seen first predicts token 0."""
    pairs = stream[:-1].astype(np.int64) * vocab + stream[1:].astype(np.int64)
    keys, counts = np.unique(pairs, return_counts=True)  # sorted by (first, next)
    first, nxt = keys // vocab, keys % vocab
    order = np.lexsort((nxt, -counts, first))  # per first token: most counted, then smallest next id
    first, nxt = first[order], nxt[order]
    lead = np.ones(len(first), dtype=bool)
    lead[1:] = first[1:] != first[:-1]
    table = np.zeros(vocab, dtype=np.int64)
    table[first[lead]] = nxt[lead]
    return torch.from_numpy(table)


def drafter_losses(drafter: MTPDrafter, backbone: PreTrainedModel, batch: Batch, k: int, bigram: torch.Tensor | None = None,
                   replies_only: bool = False, anchor: tuple[MTPDrafter, float] | None = None) -> tuple[torch.Tensor, dict]:
    """Soft cross-entropy of each depth against the frozen backbone's distribution, at every position
    (replies_only: only where the predicted token carries loss in the batch: raw text, a chat's replies);
    anchor (drafter, weight): plus weight x KL(anchor's distribution || this drafter's) on raw-text rows."""
    with torch.no_grad():
        hidden = backbone.model(input_ids=batch.inputs, use_cache=False).last_hidden_state  # [B, L, d]
        target_logits = backbone.lm_head(hidden)[:, 1:].float()  # [B, L-1, V]: predicts x_{t+2}
        target = target_logits.softmax(-1)
        greedy = target_logits.argmax(-1)
    embed = backbone.get_input_embeddings().weight
    head = backbone.get_output_embeddings().weight
    outs = drafter.forward_chains(hidden, batch.inputs, embed, k)
    held = _anchor_logp(anchor, hidden, batch, embed, head, k)
    text = (batch.loss_mask.min(dim=1).values == 1).float()[:, None]  # raw-text rows: no masked position
    weights = depth_weights(drafter.cfg, k)
    where = batch.loss_mask[:, 1:] if replies_only else None  # [B, L-1], aligned with target (x_{t+2})
    total = torch.zeros((), device=hidden.device)
    metrics: dict[str, float] = {}
    agree = None
    for depth, (out, w) in enumerate(zip(outs, weights), start=1):
        logp = drafter.logits(out, head).float().log_softmax(-1)
        valid = slice(depth - 1, None)
        ce = -(target[:, valid] * logp[:, valid]).sum(-1)
        loss = ce.mean() if where is None else (ce * where[:, valid]).sum() / where[:, valid].sum().clamp(min=1)
        total = total + w * loss
        if held is not None:  # raw-text rows stay near the anchor drafter
            kl = (held[depth - 1].exp() * (held[depth - 1] - logp)).sum(-1)[:, valid]
            total = total + anchor[1] * w * (kl * text).sum() / (text.sum() * kl.shape[1]).clamp(min=1)
        hit = (logp.argmax(-1) == greedy).long()  # agreement with the backbone's greedy token
        # the chain that reaches depth k at t passed depth k-1 at t-1 (teacher-forced on the data)
        agree = hit if agree is None else F.pad(agree, (1, 0))[:, :-1] * hit
        metrics[f"a{depth}_tf"] = agree[:, valid].float().mean()
    if bigram is not None:
        metrics["bigram_a1"] = (bigram.to(greedy.device)[batch.inputs[:, 1:]] == greedy).float().mean()
    return total, metrics


def _anchor_logp(anchor: tuple[MTPDrafter, float] | None, hidden: torch.Tensor, batch: Batch, embed: torch.Tensor,
                 head: torch.Tensor, k: int) -> list[torch.Tensor] | None:
    """The anchor drafter's log-probabilities per depth ([B, L-1, V] each), or None."""
    if anchor is None or anchor[1] <= 0:
        return None
    with torch.no_grad():
        return [anchor[0].logits(o, head).float().log_softmax(-1) for o in anchor[0].forward_chains(hidden, batch.inputs, embed, k)]


def _load_anchor(init_drafter: Path | None, weight: float, device: str) -> tuple[MTPDrafter, float] | None:
    if weight <= 0:
        return None
    if init_drafter is None:
        raise ValueError("--anchor-weight needs --init-drafter (the drafter to stay near on raw text)")
    return load_drafter(init_drafter).to(device).eval().requires_grad_(False), weight


def train_mtp(args: RunArgs, k: int, intermediate_size: int | None, sanity_steps: int, init_drafter: Path | None = None,
              backbone_dir: Path | None = None, replies_only: bool = False, anchor_weight: float = 0.0) -> dict:
    backbone_dir = backbone_dir or args.out / "backbone"  # the frozen checkpoint; the drafter is saved into it
    backbone = AutoModelForCausalLM.from_pretrained(str(backbone_dir), dtype=torch.float32).to(args.device).eval().requires_grad_(False)
    bc, result = backbone.config, args.out / "backbone_result.json"
    preset_name = json.loads(result.read_text())["preset"] if result.exists() else None
    inter = intermediate_size or (PRESETS[preset_name].mtp_intermediate_size if preset_name else bc.hidden_size)
    cfg = MTPConfig(hidden_size=bc.hidden_size, intermediate_size=inter, num_attention_heads=bc.num_attention_heads,
                    num_key_value_heads=bc.num_key_value_heads, vocab_size=bc.vocab_size, num_speculative_tokens=k,
                    rms_norm_eps=bc.rms_norm_eps)
    torch.manual_seed(args.seed)
    drafter = MTPDrafter(cfg)
    if init_drafter is not None:  # continue training a shipped drafter
        drafter.load_state_dict(load_drafter(init_drafter).state_dict())
    drafter = drafter.to(args.device).train()
    train = TokenStreams.load(args.data / args.domain / "train")
    bigram = bigram_table(np.asarray(train.text[:20_000_000]), bc.vocab_size)
    val = fixed_batches(args)

    anchor = _load_anchor(init_drafter, anchor_weight, args.device)

    def loss_fn(batch: Batch):
        return drafter_losses(drafter, backbone, batch, k, replies_only=replies_only, anchor=anchor)

    @torch.no_grad()
    def eval_fn() -> dict:
        drafter.eval()
        acc: dict[str, list[float]] = {}
        for _, batch in val:
            with autocast(args.device):
                _, m = drafter_losses(drafter, backbone, batch.to(args.device), k, bigram)
            for key, value in m.items():
                acc.setdefault(key, []).append(float(value))
        drafter.train()
        return {f"val_{key}": round(float(np.mean(v)), 4) for key, v in acc.items()}

    sanity_file = args.out / "mtp_sanity.json"  # kept across resumes
    sanity: dict = json.loads(sanity_file.read_text()) if sanity_file.is_file() else {}

    def check(step: int) -> None:
        """The short sanity run before the long one: the drafter must beat the bigram drafter."""
        if sanity or not sanity_steps or step < sanity_steps:
            return
        sanity.update(step=step, **eval_fn())
        sanity_file.write_text(json.dumps(sanity) + "\n")
        log.info("%s/mtp sanity at step %d: %s", args.domain, step, sanity)
        if sanity["val_a1_tf"] <= sanity["val_bigram_a1"]:
            raise RuntimeError(f"drafter does not beat the bigram baseline after {step} steps: {sanity}")

    params = list(drafter.parameters())
    record = run_loop(args, drafter, params, loss_fn, eval_fn, args.out / "mtp_state", check)
    save_drafter(drafter, backbone_dir)
    record.update(k=k, parameters=sum(p.numel() for p in params), sanity=sanity)
    if init_drafter is not None:
        prior = json.loads((init_drafter / "cantata.json").read_text()).get("mtp", {}) if (init_drafter / "cantata.json").is_file() else {}
        record.update(init_from=str(init_drafter), prior_steps=prior.get("steps"), prior_tokens_seen=prior.get("tokens_seen"))
    final = record["final"]
    record["beats_bigram"] = final.get("val_a1_tf", 0.0) > final.get("val_bigram_a1", 1.0)
    return record


def cli(argv: list[str]) -> int:
    kind, rest = argv[0], argv[1:]
    parser = argparse.ArgumentParser(prog=f"python -m specialists.train {kind}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", required=True, choices=DOMAINS if kind == "backbone" else None,
                        help="the packed data's folder under --data" + ("" if kind == "backbone" else " (a domain, or e.g. general)"))
    parser.add_argument("--data", type=Path, default=Path("data/packed"))
    parser.add_argument("--out", type=Path, help="run folder (default runs/<domain>)")
    parser.add_argument("--steps", type=int, default=4000 if kind == "backbone" else 2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-3 if kind == "backbone" else 2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--floor-ratio", type=float, default=0.1)
    parser.add_argument("--time-budget-s", type=float, default=None, help="finish the schedule within this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--chat-fraction", type=float, default=0.5)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=500)
    if kind == "backbone":
        parser.add_argument("--tokenizer", type=Path, default=Path("data/tokenizer"))
        parser.add_argument("--preset", choices=sorted(PRESETS), help="default: the domain's preset")
        parser.add_argument("--init-from", type=Path, default=None, help="continue from this checkpoint's weights")
    else:
        parser.add_argument("--k", type=int, default=3, help="drafting depth trained (depths 1..K)")
        parser.add_argument("--intermediate-size", type=int, default=None)
        parser.add_argument("--sanity-steps", type=int, default=200, help="abort unless the drafter beats the bigram baseline by then")
        parser.add_argument("--init-drafter", type=Path, default=None, help="continue from this directory's mtp.safetensors")
        parser.add_argument("--backbone", type=Path, default=None, help="the frozen checkpoint (default <out>/backbone); the drafter is saved into it")
        parser.add_argument("--loss-on", choices=["all", "replies"], default="all",
                            help="chat rows: every position (all) or only the replies' tokens (raw text: always all)")
        parser.add_argument("--anchor-weight", type=float, default=0.0,
                            help="> 0: add this x KL(--init-drafter's distribution || the drafter's) on raw-text rows")
    ns = parser.parse_args(rest)
    if ns.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        # before transformers imports its Bamba modeling code, which binds the kernels it finds
        log.info("mamba-ssm Triton ops: %s", "on" if load_triton_ssd() else "off (torch reference)")
    out = ns.out or Path("runs") / ns.domain
    args = RunArgs(kind, ns.domain, ns.data, out, ns.steps, ns.batch_size, ns.seq_len, ns.lr, ns.warmup, ns.floor_ratio,
                   ns.time_budget_s, ns.seed, ns.device, ns.chat_fraction, ns.eval_every, ns.eval_batches, ns.save_every)
    out.mkdir(parents=True, exist_ok=True)
    if kind == "backbone":
        record = train_backbone(args, ns.tokenizer, ns.preset or DEFAULT_PRESET[ns.domain], ns.init_from)
    else:
        record = train_mtp(args, ns.k, ns.intermediate_size, ns.sanity_steps, ns.init_drafter, ns.backbone,
                           ns.loss_on == "replies", ns.anchor_weight)
        record.update(loss_on=ns.loss_on, anchor_weight=ns.anchor_weight)
    record.update(domain=ns.domain, device=torch.cuda.get_device_name() if ns.device.startswith("cuda") else "cpu", seed=ns.seed,
                  batch_size=ns.batch_size, seq_len=ns.seq_len, lr=ns.lr)
    (out / f"{kind}_result.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("domain", "steps", "tokens_seen", "seconds", "final")}))
    return 0
