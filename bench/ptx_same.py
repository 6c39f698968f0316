"""Whether a change to decode_fused's product kernel keeps its instructions, without a GPU: compiles
`_mma_kernel` for sm_90 (Triton's bundled ptxas) from the working tree (or --new) and from a revision, for a
set of kinds, splits and SwiGLU ends, and compares the PTX without its debug information:

  python -m bench.ptx_same [--rev HEAD] [--new REV] [--cases all|quick]

Prints one line per case ("same" or "differs") and exits 1 if any differs. Constexprs the revision's
kernel has and the tree's lacks (or the reverse) are given their defaults.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = "specialists/ops/decode_fused.py"
BASE = dict(K=2048, RES=False, BIAS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PDL=False, ROPE=False, HQ=0, HKV=0)
CASES = [(0, 1, False), (0, 4, False), (1, 1, False), (1, 2, False), (2, 8, False), (3, 1, False), (3, 4, False),
         (3, 1, True), (1, 1, True)]  # (PRO, SPLIT, GLU)
POINTERS = {"ws_ptr": "*fp32", "ss_ptr": "*fp32", "lock_ptr": "*i32", "slot_ptr": "*i64"}


def _module(path: Path, name: str):
    """The file as a module, its kernels compiled ones even where TRITON_INTERPRET=1 (the CPU tests)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        spec.loader.exec_module(mod)
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    return mod


def tree_kernel():
    """The working tree's decode_fused._mma_kernel as a compilable kernel."""
    return _module(ROOT / PATH, "tree_decode_fused")._mma_kernel


def kernel_ptx(fn, constexprs: dict) -> str:
    """fn (a @triton.jit kernel with decode_fused._mma_kernel's parameters) compiled for sm_90 -> its PTX
    code: the debug sections, locations and their labels dropped."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items() if p.default is not p.empty}
    sig, consts = {}, {}
    for i, n in enumerate(names):
        if n in constexprs or n in defaults:
            sig[n] = "constexpr"
            consts[(i,)] = constexprs.get(n, defaults.get(n))
        else:
            sig[n] = POINTERS.get(n, "*bf16" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32")
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if sig[n].startswith("*") or n in ("stride_x", "stride_w", "stride_out")}
    compiled = triton.compile(ASTSource(fn, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 3})
    code = compiled.asm["ptx"].split(".section\t.debug")[0].split(".section .debug")[0]
    return "\n".join(line for line in code.splitlines()
                     if not line.strip().startswith((".loc", ".file", "//")) and "$L__tmp" not in line)


def _at(rev: str, tmp: str, name: str):
    path = Path(tmp) / f"{name}.py"
    path.write_text(subprocess.run(["git", "show", f"{rev}:{PATH}"], cwd=ROOT, check=True, capture_output=True,
                                   text=True).stdout)
    return _module(path, name)


def compare(rev: str, cases: list[tuple[int, int, bool]], new_rev: str | None = None) -> list[tuple[tuple, bool]]:
    """-> [(case, same)] for the kernel of new_rev (None: the working tree) against rev's."""
    with tempfile.TemporaryDirectory() as tmp:
        old = _at(rev, tmp, "old_decode_fused")
        new = _module(ROOT / PATH, "new_decode_fused") if new_rev is None else _at(new_rev, tmp, "new_decode_fused")
        out = []
        for pro, split, glu in cases:
            cx = {**BASE, "PRO": pro, "SPLIT": split, "KS": BASE["K"] // split, "GLU": glu}
            kinds = [{k: v for k, v in cx.items() if k in m._mma_kernel.arg_names} for m in (old, new)]
            if glu and "GLU" not in kinds[0]:
                continue  # a revision before the SwiGLU end
            out.append(((pro, split, glu), kernel_ptx(old._mma_kernel, kinds[0]) == kernel_ptx(new._mma_kernel, kinds[1])))
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--new", default=None, help="a revision instead of the working tree")
    p.add_argument("--cases", choices=["all", "quick"], default="all")
    args = p.parse_args(argv)
    results = compare(args.rev, CASES if args.cases == "all" else CASES[5:6], args.new)
    for (pro, split, glu), same in results:
        print(f"PRO {pro} SPLIT {split} GLU {glu}: {'same' if same else 'differs'}")
    return 0 if all(same for _, same in results) else 1


if __name__ == "__main__":
    sys.exit(main())
