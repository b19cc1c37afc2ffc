"""One training step of a small transformers model, timed with its RoPE served three ways in the
same run: transformers' own, rope-dispatch's patch (``rope_dispatch.integrations.hf.patch``) and
Liger-Kernel's, when Liger is installed.

``--model llama`` (default): a Llama-shaped model; Liger's is ``apply_liger_kernel_to_llama`` with
only ``rope=True``. ``--model qwen3``: a Qwen3-shaped model, whose attention applies q_norm and
k_norm right before RoPE: our patch fuses both norms into the RoPE call, and Liger's is
``apply_liger_kernel_to_qwen3`` with only ``rope=True`` and ``rms_norm=True`` (LigerRMSNorm for
every RMSNorm of the model, the layer norms too), in a copy of the model built under its patch;
``Liger + rope-dispatch`` is that copy with our patch on top (its q_norm and k_norm, Liger's,
fused into our RoPE call; Liger's layer norms stay).

A step is forward + backward + AdamW step on random token ids with random weights (no
download). The variants take turns step block by step block, in a rotating order, so clock and
thermal drift fall on all of them alike; each reports its median block. Before timing, each
variant's logits of one fixed sequence are compared with a float32 copy of the model: a variant
agrees when its error is within twice transformers' own bf16 error (plus 1e-3).

    python -m benchmarks.hf_train_step               # 4 layers, hidden 1024, 16/4 heads, 4 x 2048
    python -m benchmarks.hf_train_step --model qwen3 # 4 layers, hidden 2048, 16/4 heads of 128, 2 x 4096
    python -m benchmarks.hf_train_step --device cpu --layers 1 --hidden 64 --heads 4 --kv-heads 2 \\
        --seq 32 --batch 2 --vocab 256 --repeats 2 --steps 1 --warmup 1 --dtype float32   # smoke

(the smoke with ``--model qwen3 --head-dim 16`` for Qwen3). Prints a markdown table (ms per
step, speedup over transformers) and the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import inspect
import statistics
import time
import types
from collections.abc import Callable

import torch
import transformers
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

import rope_dispatch as rd
from rope_dispatch.integrations import hf


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family the step is timed on, and how Liger patches it."""

    label: str
    module: types.ModuleType  # its modeling module, whose globals the patches rebind
    config: type
    causal_lm: str  # the model class's name in ``module``, looked up at each build
    defaults: dict  # shape defaults; ``intermediate`` is a multiple of hidden
    liger: str  # Liger's patch function in ``liger_kernel.transformers``
    liger_flags: tuple[str, ...]  # its flags turned on; every other bool flag is off
    qk_norm: bool  # q_norm and k_norm before RoPE: Liger's model is a copy built under its patch
    column: str  # the table's first header


FAMILIES = {
    "llama": Family(
        "Llama", modeling_llama, transformers.LlamaConfig, "LlamaForCausalLM",
        dict(layers=4, hidden=1024, heads=16, kv_heads=4, head_dim=None, intermediate=2.75,
             seq=2048, batch=4),
        "apply_liger_kernel_to_llama", ("rope",), False, "RoPE",
    ),
    "qwen3": Family(
        "Qwen3", modeling_qwen3, transformers.Qwen3Config, "Qwen3ForCausalLM",
        dict(layers=4, hidden=2048, heads=16, kv_heads=4, head_dim=128, intermediate=3.0,
             seq=4096, batch=2),
        "apply_liger_kernel_to_qwen3", ("rope", "rms_norm"), True, "QK norm + RoPE",
    ),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", choices=sorted(FAMILIES))
    p.add_argument("--layers", type=int, default=None, help="default: 4")
    p.add_argument("--hidden", type=int, default=None, help="default: 1024 (qwen3: 2048)")
    p.add_argument("--heads", type=int, default=None, help="default: 16")
    p.add_argument("--kv-heads", type=int, default=None, help="default: 4")
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads (qwen3: 128)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="default: 2.75 x hidden (qwen3: 3 x hidden)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=None, help="default: 2048 (qwen3: 4096)")
    p.add_argument("--batch", type=int, default=None, help="default: 4 (qwen3: 2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, ...)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true",
                   help="run each variant's model under torch.compile (compiled before timing)")
    p.add_argument("--warmup", type=int, default=3, help="steps per variant before timing")
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=10, help="timed blocks per variant")
    args = p.parse_args()
    defaults = FAMILIES[args.model].defaults
    for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "seq", "batch"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    args.head_dim = args.head_dim or args.hidden // args.heads
    args.intermediate = args.intermediate or int(args.hidden * defaults["intermediate"])
    return args


def build_model(args: argparse.Namespace, family: Family) -> transformers.PreTrainedModel:
    """The family's causal LM of the requested shape, seeded, on the device in the dtype; its
    class (and the classes it builds its modules from) as the modeling module holds them now."""
    config = family.config(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        attn_implementation=args.attn,
    )
    torch.manual_seed(0)
    model = getattr(family.module, family.causal_lm)(config)
    return model.to(device=args.device, dtype=getattr(torch, args.dtype)).train()


def liger_patch(
    family: Family, build: Callable[[], torch.nn.Module], device: str
) -> tuple[Callable | None, torch.nn.Module | None, str]:
    """Liger's ``apply_rotary_pos_emb`` for the family, as its patch installs it; for a QK-norm
    family also a model from ``build`` made while the patch is in place (its norms are Liger's);
    and a note. The patch is undone at once: every other Liger kernel is turned off, and what it
    changed in the modeling module is put back (and reported). Not on a CPU ``device``: Liger's
    Triton kernels need a GPU."""
    if not device.startswith("cuda"):
        return None, None, f"Liger-Kernel runs on CUDA only; skipped on {device}"
    try:
        import liger_kernel.transformers as liger_transformers

        apply_liger = getattr(liger_transformers, family.liger)
    except Exception as exc:  # noqa: BLE001  (not installed, or not importable with this transformers)
        return None, None, f"Liger-Kernel not available ({type(exc).__name__}: {exc}); skipped"
    params = inspect.signature(apply_liger).parameters
    missing = [name for name in family.liger_flags if name not in params]
    if missing:
        return None, None, f"{family.liger} takes no {', '.join(missing)}; skipped"
    flags = {
        name: name in family.liger_flags
        for name, param in params.items()
        if isinstance(param.default, bool)
    }
    module = family.module
    before = dict(vars(module))
    liger_model = None
    try:
        apply_liger(**flags)
        installed = module.apply_rotary_pos_emb
        if family.qk_norm:
            liger_model = build()
    except Exception as exc:  # noqa: BLE001
        return None, None, f"{family.liger} failed ({type(exc).__name__}: {exc}); skipped"
    finally:
        changed = sorted(k for k, v in vars(module).items() if before.get(k, object()) is not v)
        for name in changed:
            if name in before:
                setattr(module, name, before[name])
            else:
                delattr(module, name)
    others = [n for n in changed if n != "apply_rotary_pos_emb"]
    if installed is before["apply_rotary_pos_emb"]:
        return None, None, f"{family.liger}(rope=True) left apply_rotary_pos_emb alone; skipped"
    try:
        import liger_kernel

        version = getattr(liger_kernel, "__version__", None)
        if version is None:
            from importlib.metadata import version as dist_version

            version = dist_version("liger-kernel")
    except Exception:  # noqa: BLE001
        version = "unknown"
    note = f"Liger-Kernel {version}: {', '.join(f'{k}={v}' for k, v in flags.items())}"
    if liger_model is not None:
        norms = sorted({type(m).__name__ for m in liger_model.modules() if "Norm" in type(m).__name__})
        note += (
            f"; its model is a copy built under the patch ({', '.join(others) or 'nothing else'} "
            f"changed; norms: {', '.join(norms)}), with the same weights"
        )
    elif others:
        note += f" (it also changed {', '.join(others)}; undone for the measurement)"
    return installed, liger_model, note


Variant = tuple[Callable[[], contextlib.AbstractContextManager], torch.nn.Module]


def variants(
    family: Family, model: torch.nn.Module, patched: torch.nn.Module, liger: Callable | None,
    liger_model: torch.nn.Module | None, liger_patched: torch.nn.Module | None,
) -> dict[str, Variant]:
    """Each variant as a context that installs its ``apply_rotary_pos_emb`` in the family's
    modeling module (and restores transformers' own on exit), and the model it trains. Ours
    trains ``patched``, a copy patched once (its fused attention and norm forwards stay, so a
    compiled step is not invalidated by patching again), and only the module's global changes."""
    original = family.module.apply_rotary_pos_emb

    def installs(function: Callable) -> Callable[[], contextlib.AbstractContextManager]:
        @contextlib.contextmanager
        def installed():
            family.module.apply_rotary_pos_emb = function
            try:
                yield
            finally:
                family.module.apply_rotary_pos_emb = original

        return installed

    chosen = {
        "transformers": (installs(original), model),
        "rope-dispatch": (installs(hf.apply_rotary_pos_emb), patched),
    }
    if liger is not None:
        chosen["Liger"] = (installs(liger), liger_model if liger_model is not None else model)
    if liger_patched is not None:
        chosen["Liger + rope-dispatch"] = (installs(hf.apply_rotary_pos_emb), liger_patched)
    return chosen


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_step(model, optimizer, ids) -> None:
    # no KV cache, as training runs (under torch.compile a new cache a step recompiled its code)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def logit_errors(reference, variant_list, ids) -> dict[str, float]:
    """Max |logits - float32 logits| of one sequence, per variant (no gradients)."""
    with torch.no_grad():
        exact = reference(input_ids=ids).logits.float()
        errors = {}
        for name, (installed, model) in variant_list.items():
            with installed():
                logits = model(input_ids=ids).logits.float()
            errors[name] = (logits - exact).abs().max().item()
    return errors


def rope_backend(args: argparse.Namespace, family: Family, eps: float) -> str:
    """Which rope-dispatch backend serves this model's RoPE call (with its q and k norms for a
    QK-norm family), and why."""
    dtype = getattr(torch, args.dtype)
    q = torch.empty(args.batch, args.heads, args.seq, args.head_dim, device=args.device, dtype=dtype)
    k = torch.empty(args.batch, args.kv_heads, args.seq, args.head_dim, device=args.device, dtype=dtype)
    cos = torch.ones(1, args.seq, args.head_dim, device=args.device, dtype=dtype)
    norms = {}
    if family.qk_norm:
        weight = torch.ones(args.head_dim, device=args.device, dtype=dtype)
        norms = {"q_norm": rd.HeadNorm(weight, eps), "k_norm": rd.HeadNorm(weight, eps)}
    explanation = rd.explain(
        q.transpose(1, 2), hf._token_table(cos, cos), hf._spec(dtype), k=k.transpose(1, 2), **norms
    )
    return f"{explanation.chosen} ({explanation.why})"


def main() -> None:
    args = parse_args()
    family = FAMILIES[args.model]
    model = build_model(args, family)
    reference = copy.deepcopy(model).float()
    liger, liger_model, liger_note = liger_patch(
        family, lambda: build_model(args, family), args.device)
    if liger_model is not None:
        liger_model.load_state_dict(model.state_dict())
    original = family.module.apply_rotary_pos_emb
    patched = hf.patch(copy.deepcopy(model))
    # Liger's model with ours on top: its q_norm and k_norm (Liger's) fused into our call
    liger_patched = None if liger_model is None else hf.patch(copy.deepcopy(liger_model))
    family.module.apply_rotary_pos_emb = original  # each variant installs its own (variants)
    variant_list = variants(family, model, patched, liger, liger_model, liger_patched)
    optimizers = {
        id(m): torch.optim.AdamW(m.parameters(), lr=1e-5, fused=args.device.startswith("cuda"))
        for m in {id(m): m for _, m in variant_list.values()}.values()
    }
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)

    errors = logit_errors(reference, variant_list, ids[:1])
    del reference
    runs = {name: torch.compile(m) if args.compile else m for name, (_, m) in variant_list.items()}

    for name, (installed, m) in variant_list.items():
        with installed():
            for _ in range(args.warmup):
                train_step(runs[name], optimizers[id(m)], ids)
    synchronize(args.device)

    blocks: dict[str, list[float]] = {name: [] for name in variant_list}
    names = list(variant_list)
    for repeat in range(args.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            installed, m = variant_list[name]
            with installed():
                synchronize(args.device)
                start = time.perf_counter()
                for _ in range(args.steps):
                    train_step(runs[name], optimizers[id(m)], ids)
                synchronize(args.device)
            blocks[name].append((time.perf_counter() - start) * 1e3 / args.steps)

    baseline = statistics.median(blocks["transformers"])
    limit = 2 * errors["transformers"] + 1e-3
    device_name = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    )
    head_dim = "" if args.head_dim * args.heads == args.hidden and not family.qk_norm else (
        f" of dim {args.head_dim}"
    )
    print(
        f"{family.label}-shaped: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / "
        f"{args.kv_heads} kv heads{head_dim}, batch {args.batch} x seq {args.seq}, {args.dtype}, "
        f"attention {args.attn}{', torch.compile' if args.compile else ''}; {device_name}\n"
    )
    print(
        f"| {family.column} | ms / step (median) | spread | speedup | "
        "max abs logit error vs float32 | agrees |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name, times in blocks.items():
        median = statistics.median(times)
        spread = f"{min(times):.2f}-{max(times):.2f}"
        agrees = "yes" if errors[name] <= limit else "NO"
        print(
            f"| {name} | {median:.2f} | {spread} | {baseline / median:.3f}x | "
            f"{errors[name]:.3g} | {agrees} |"
        )
    print(
        f"\n{args.repeats} blocks of {args.steps} steps per variant, interleaved, after "
        f"{args.warmup} warm-up steps each. Agrees: error <= 2 x transformers' own + 1e-3 "
        f"= {limit:.3g}."
    )
    if family.qk_norm:
        print(
            "transformers: its RMSNorm on q and k, then its RoPE; rope-dispatch: q_norm + k_norm + "
            "RoPE in one call (the other RMSNorms transformers'); Liger: its RMSNorm for every "
            "RMSNorm (layer norms too), then its RoPE; Liger + rope-dispatch: Liger's model, its "
            "q_norm + k_norm + RoPE in our one call."
        )
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, rope-dispatch "
        f"{rd.__version__}; rope-dispatch backend: "
        f"{rope_backend(args, family, getattr(model.config, 'rms_norm_eps', 1e-6))}"
    )
    print(liger_note)


if __name__ == "__main__":
    main()
