"""One training step of a small Llama-shaped transformers model, timed with its RoPE served three
ways in the same run: transformers' own function, rope-dispatch's patch
(``rope_dispatch.integrations.hf.patch``) and Liger-Kernel's (``apply_liger_kernel_to_llama``
with only ``rope=True``), when Liger is installed.

A step is forward + backward + AdamW step on random token ids with random weights (no
download). The variants take turns step block by step block, in a rotating order, so clock and
thermal drift fall on all of them alike; each reports its median block. Before timing, each
variant's logits of one fixed sequence are compared with a float32 copy of the model: a variant
agrees when its error is within twice transformers' own bf16 error (plus 1e-3).

    python -m benchmarks.hf_train_step               # 4 layers, hidden 1024, 16/4 heads, 4 x 2048
    python -m benchmarks.hf_train_step --device cpu --layers 1 --hidden 64 --heads 4 --kv-heads 2 \\
        --seq 32 --batch 2 --vocab 256 --repeats 2 --steps 1 --warmup 1 --dtype float32   # smoke

Prints a markdown table (ms per step, speedup over transformers) and the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from transformers.models.llama import modeling_llama

import rope_dispatch as rd
from rope_dispatch.integrations import hf


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=None, help="default: 2.75 x hidden")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, ...)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=3, help="steps per variant before timing")
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=10, help="timed blocks per variant")
    return p.parse_args()


def build_model(args: argparse.Namespace) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        attn_implementation=args.attn,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    return model.to(device=args.device, dtype=getattr(torch, args.dtype)).train()


def liger_rope() -> tuple[Callable | None, str]:
    """Liger's ``apply_rotary_pos_emb`` for Llama, as its patch installs it, and a note; the
    patch is undone at once (every other Liger kernel is turned off, and anything else it
    changed in transformers' module is put back and reported)."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except Exception as exc:  # noqa: BLE001  (not installed, or not importable with this transformers)
        return None, f"Liger-Kernel not available ({type(exc).__name__}: {exc}); skipped"
    flags = {
        name: name == "rope"
        for name, param in inspect.signature(apply_liger_kernel_to_llama).parameters.items()
        if isinstance(param.default, bool)
    }
    before = dict(vars(modeling_llama))
    try:
        apply_liger_kernel_to_llama(**flags)
        installed = modeling_llama.apply_rotary_pos_emb
    except Exception as exc:  # noqa: BLE001
        return None, f"apply_liger_kernel_to_llama failed ({type(exc).__name__}: {exc}); skipped"
    finally:
        changed = sorted(k for k, v in vars(modeling_llama).items() if before.get(k, object()) is not v)
        for name in changed:
            if name in before:
                setattr(modeling_llama, name, before[name])
            else:
                delattr(modeling_llama, name)
    others = [n for n in changed if n != "apply_rotary_pos_emb"]
    if installed is before["apply_rotary_pos_emb"]:
        return None, "apply_liger_kernel_to_llama(rope=True) left apply_rotary_pos_emb alone; skipped"
    try:
        import liger_kernel

        version = getattr(liger_kernel, "__version__", None)
        if version is None:
            from importlib.metadata import version as dist_version

            version = dist_version("liger-kernel")
    except Exception:  # noqa: BLE001
        version = "unknown"
    note = f"Liger-Kernel {version}: {', '.join(f'{k}={v}' for k, v in flags.items())}"
    if others:
        note += f" (it also changed {', '.join(others)}; undone for the measurement)"
    return installed, note


def variants(model: torch.nn.Module, liger: Callable | None) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """Each variant as a context that installs its RoPE in transformers' Llama module and
    restores transformers' own on exit."""

    @contextlib.contextmanager
    def transformers_rope():
        yield

    @contextlib.contextmanager
    def rope_dispatch_rope():
        hf.patch(model)
        try:
            yield
        finally:
            hf.unpatch(model)

    @contextlib.contextmanager
    def liger_rope_installed():
        original = modeling_llama.apply_rotary_pos_emb
        modeling_llama.apply_rotary_pos_emb = liger
        try:
            yield
        finally:
            modeling_llama.apply_rotary_pos_emb = original

    chosen = {"transformers": transformers_rope, "rope-dispatch": rope_dispatch_rope}
    if liger is not None:
        chosen["Liger"] = liger_rope_installed
    return chosen


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_step(model, optimizer, ids) -> None:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def logit_errors(model, reference, variant_list, ids) -> dict[str, float]:
    """Max |logits - float32 logits| of one sequence, per variant (no gradients)."""
    with torch.no_grad():
        exact = reference(input_ids=ids).logits.float()
        errors = {}
        for name, installed in variant_list.items():
            with installed():
                logits = model(input_ids=ids).logits.float()
            errors[name] = (logits - exact).abs().max().item()
    return errors


def rope_backend(args: argparse.Namespace) -> str:
    """Which rope-dispatch backend serves this model's RoPE call, and why."""
    head_dim = args.hidden // args.heads
    dtype = getattr(torch, args.dtype)
    q = torch.empty(args.batch, args.heads, args.seq, head_dim, device=args.device, dtype=dtype)
    k = torch.empty(args.batch, args.kv_heads, args.seq, head_dim, device=args.device, dtype=dtype)
    cos = torch.ones(1, args.seq, head_dim, device=args.device, dtype=dtype)
    explanation = rd.explain(
        q.transpose(1, 2), hf._token_table(cos, cos), hf._spec(dtype), k=k.transpose(1, 2)
    )
    return f"{explanation.chosen} ({explanation.why})"


def main() -> None:
    args = parse_args()
    model = build_model(args)
    reference = copy.deepcopy(model).float()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-5, fused=args.device.startswith("cuda")
    )
    liger, liger_note = liger_rope()
    variant_list = variants(model, liger)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)

    errors = logit_errors(model, reference, variant_list, ids[:1])
    del reference

    for name, installed in variant_list.items():
        with installed():
            for _ in range(args.warmup):
                train_step(model, optimizer, ids)
    synchronize(args.device)

    blocks: dict[str, list[float]] = {name: [] for name in variant_list}
    names = list(variant_list)
    for repeat in range(args.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            with variant_list[name]():
                synchronize(args.device)
                start = time.perf_counter()
                for _ in range(args.steps):
                    train_step(model, optimizer, ids)
                synchronize(args.device)
            blocks[name].append((time.perf_counter() - start) * 1e3 / args.steps)

    baseline = statistics.median(blocks["transformers"])
    limit = 2 * errors["transformers"] + 1e-3
    device_name = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    )
    print(
        f"Llama-shaped: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / "
        f"{args.kv_heads} kv heads, batch {args.batch} x seq {args.seq}, {args.dtype}, "
        f"attention {args.attn}; {device_name}\n"
    )
    print("| RoPE | ms / step (median) | spread | speedup | max abs logit error vs float32 | agrees |")
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
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, rope-dispatch "
        f"{rd.__version__}; rope-dispatch backend: {rope_backend(args)}"
    )
    print(liger_note)


if __name__ == "__main__":
    main()
