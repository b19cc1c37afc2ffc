"""The serving prologue: ``rope_to_cache`` (rotate q and k, write k and v into a KV cache, FP8
or not, in one launch) against ``apply_qk_`` alone and the composition it replaces, and
FlashInfer's fused call where FlashInfer is installed.

    python -m benchmarks.serving_cache [--tokens 1 16 64 256] [--prefill 4096 16384 32768]
                                       [--mla-tokens 1 64 256] [--mla-prefill 4096 16384]

Decode (q 32 heads, k and v 8, d 128, bf16, pages of 16, positions and slots on the GPU; q
new, rotated in place as ``apply_qk_`` does, or into a buffer the engine keeps): end
to end us per call on the host clock (the larger of host and GPU time; every call's turn
interleaved in each round, :func:`benchmarks.bench.host_us_interleaved`), and each call's ratio
to ``apply_qk_`` alone. Prefill: the launch's GPU time (``do_bench``, L2 flushed) against a
device copy of the bytes it must move (read q, k, v; write q out and k, v into the cache), for
each table kind: angles (made under inference mode, so read as rows), a cos/sin cache, rates.

MLA (DeepSeek-V3's shapes: q's rope part 128 heads x 64, one shared 64-channel key part and a
512-channel compressed kv per token, bf16 in, FP8 e4m3 out and caches, FlashInfer's pages of
16): FlashInfer's door (rotate q and k, write the key part and the compressed kv, quantize q's
rope and nope parts) on the fused Triton launch against the same call composed by the eager
backend; end to end at decode, and the launch's share of a copy at prefill.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

import rope_dispatch as rd
from benchmarks.bench import bench_ms, device_copy_ms, host_us_interleaved, serving_inputs
from rope_dispatch.compat import flashinfer as doors

PAGE = 16
FP8 = torch.float8_e4m3fn


def _flashinfer() -> Any | None:
    try:
        from flashinfer import rope  # noqa: PLC0415

        return rope.rope_quantize_fp8_append_paged_kv_cache
    except Exception:  # noqa: BLE001 (not installed, or its JIT build failed)
        return None


def decode_calls(tokens: int, cache_dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """The calls of one decode step of ``tokens`` tokens (one request each) into a paged cache
    of ``cache_dtype``."""
    d = serving_inputs(tokens)
    q, k, pos, freqs, spec = d["q"], d["k"], d["positions"], d["freqs"], d["thd"]
    gen = torch.Generator().manual_seed(2)
    v = torch.randn(k.shape, generator=gen).to(k.dtype).cuda()
    pages = 4 * tokens + 4
    k_cache = torch.zeros(pages, PAGE, *k.shape[1:], dtype=cache_dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(pages * PAGE, generator=gen)[:tokens].cuda()
    scale = 0.05 if cache_dtype == FP8 else 1.0
    cache = rd.PagedKVCache(k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
    flat_k, flat_v = k_cache.view(-1, *k.shape[1:]), v_cache.view(-1, *k.shape[1:])
    q_given = torch.empty_like(q)  # an engine's q buffer, reused every step

    def composed() -> None:  # what rope_to_cache replaces: rotate, then the engine's writes
        rd.apply_qk_(q, k, freqs, spec, positions=pos)
        if cache_dtype == FP8:  # torch has no FP8 index_copy_: through the bytes
            flat_k.view(torch.uint8).index_copy_(0, slots, (k / scale).to(FP8).view(torch.uint8))
            flat_v.view(torch.uint8).index_copy_(0, slots, (v / scale).to(FP8).view(torch.uint8))
        else:
            flat_k.index_copy_(0, slots, k)
            flat_v.index_copy_(0, slots, v)

    calls: dict[str, Callable[[], Any]] = {
        "apply_qk_ alone": lambda: rd.apply_qk_(q, k, freqs, spec, positions=pos),
        "apply_qk_ + index_copy_ (k, v)": composed,
        "rope_to_cache": lambda: rd.rope_to_cache(q, k, v, freqs, spec, positions=pos, cache=cache),
        "rope_to_cache (q in place)": lambda: rd.rope_to_cache(
            q, k, v, freqs, spec, positions=pos, cache=cache, q_out=q),
        "rope_to_cache (q_out given)": lambda: rd.rope_to_cache(
            q, k, v, freqs, spec, positions=pos, cache=cache, q_out=q_given),
        "rope_to_cache (descriptor per call)": lambda: rd.rope_to_cache(
            q, k, v, freqs, spec, positions=pos,
            cache=rd.PagedKVCache(k_cache, v_cache, slots, k_scale=scale, v_scale=scale)),
    }
    if cache_dtype != FP8:
        return calls
    # FlashInfer's paged cache: request i owns 4 pages, its token at a random place in them
    indices = torch.randperm(pages, generator=gen)[: 4 * tokens].int().cuda()
    indptr = (torch.arange(tokens + 1) * 4).int().cuda()
    batch = torch.arange(tokens).int().cuda()
    place = torch.randint(0, 4 * PAGE, (tokens,), generator=gen).int().cuda()
    cos_sin = d["pair_cache"].table
    q_out = torch.empty(q.shape, dtype=FP8, device="cuda")
    args = (q, k, None, None, v, cos_sin, pos, (k_cache, v_cache), indices, indptr, batch, place)
    options = dict(quantize_dtype=FP8, quant_scale_q=1.0, quant_scale_kv=1 / scale,
                   page_size=PAGE, q_rope_out=q_out)
    calls["compat.flashinfer.rope_quantize_fp8_append_paged_kv_cache"] = (
        lambda: doors.rope_quantize_fp8_append_paged_kv_cache(*args, **options))
    peer = _flashinfer()
    if peer is not None:
        contiguous = (q.contiguous(), k.contiguous())  # FlashInfer's kernel asks for them
        peer_args = (*contiguous, None, None, v, cos_sin, pos, (k_cache, v_cache), indices,
                     indptr, batch, place)
        calls["FlashInfer rope_quantize_fp8_append_paged_kv_cache (peer)"] = (
            lambda: peer(*peer_args, **options))
    return calls


def print_interleaved(calls: dict[str, Callable[[], Any]], base: str, label: str,
                      rounds: int, width: int) -> None:
    """Each call once (one that fails is reported and dropped: a peer's failure is not
    fatal), then end to end us per call interleaved (:func:`host_us_interleaved`), with each
    call's ratio to ``base``'s."""
    for name, fn in list(calls.items()):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            print(f"  {name}: {type(exc).__name__}: {exc}")
            del calls[name]
    torch.cuda.synchronize()
    times = host_us_interleaved(calls, calls=100, rounds=rounds)
    for name, (host, total) in times.items():
        print(f"  {label} {name:<{width}} {total:7.1f} us (host {host:5.1f}) "
              f"{total / times[base][1]:5.2f}x")


def run_decode(token_counts: list[int], rounds: int) -> None:
    print(f"decode, end to end us per call (ratio to apply_qk_ alone), {torch.cuda.get_device_name()}")
    for cache_dtype in (torch.bfloat16, FP8):
        for tokens in token_counts:
            print_interleaved(decode_calls(tokens, cache_dtype), "apply_qk_ alone",
                              f"{str(cache_dtype)[6:]:>13} T{tokens:<4}", rounds, 62)


def run_prefill(token_counts: list[int]) -> None:
    """Prefill into a paged cache, each table kind an engine passes: the angle table (made
    here under inference mode, as an engine's would be, so read as rows), the cos/sin cache
    (vLLM's ``cos_sin_cache``) and a rate table."""
    print("prefill, GPU time (do_bench, L2 flushed) against a copy of the bytes moved")
    for tokens in token_counts:
        d = serving_inputs(tokens)
        q, k, pos, spec = d["q"].contiguous(), d["k"].contiguous(), d["positions"], d["thd"]
        v = torch.randn_like(k)
        tables = {"angles": d["freqs"], "cos/sin cache": d["pair_cache"],
                  "rates": d["rate_table"]}
        for cache_dtype in (torch.bfloat16, FP8):
            k_cache = torch.zeros(tokens // PAGE + 1, PAGE, *k.shape[1:], dtype=cache_dtype,
                                  device="cuda")
            v_cache = torch.zeros_like(k_cache)
            slots = torch.randperm(k_cache.shape[0] * PAGE)[:tokens].cuda()
            scale = 0.05 if cache_dtype == FP8 else 1.0
            cache = rd.PagedKVCache(k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
            read = (q.numel() + k.numel() + v.numel()) * q.element_size()
            written = q.numel() * q.element_size() + 2 * k.numel() * k_cache.element_size()
            copy = device_copy_ms(read + written)
            row = []
            for name, table in tables.items():
                ms = bench_ms(lambda t=table: rd.rope_to_cache(q, k, v, t, spec, positions=pos,
                                                               cache=cache))
                row.append(f"{name} {ms * 1e3:6.1f} us {100 * copy / ms:5.1f}%")
            print(f"  T{tokens:<6} {str(cache_dtype)[6:]:>13} copy of {(read + written) / 1e6:.0f} MB "
                  f"{copy * 1e3:6.1f} us | " + " | ".join(row))


MLA_HEADS, MLA_ROPE, MLA_KV = 128, 64, 512


def mla_inputs(tokens: int) -> dict[str, Any]:
    """One MLA step of ``tokens`` tokens (one request each) into FlashInfer's MLA caches."""
    gen = torch.Generator().manual_seed(3)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).cuda()

    pages = 4 * tokens + 4
    rot = MLA_ROPE // 2
    angles = rd.tables.angle_table(rd.tables.inverse_frequencies(MLA_ROPE, 10000.0), 4096)
    pair = angles.view(4096, MLA_ROPE)[:, :rot]
    return dict(
        q_rope=rand(tokens, MLA_HEADS, MLA_ROPE), q_nope=rand(tokens, MLA_HEADS, MLA_KV),
        k_rope=rand(tokens, MLA_ROPE), k_nope=rand(tokens, MLA_KV),
        cos_sin=torch.cat((pair.cos(), pair.sin()), -1).cuda(),
        positions=torch.randint(0, 4096, (tokens,), generator=gen).cuda(),
        ckv=torch.zeros(pages, PAGE, MLA_KV, dtype=FP8, device="cuda"),
        kpe=torch.zeros(pages, PAGE, MLA_ROPE, dtype=FP8, device="cuda"),
        indices=torch.randperm(pages, generator=gen)[: 4 * tokens].int().cuda(),
        indptr=(torch.arange(tokens + 1) * 4).int().cuda(),
        batch=torch.arange(tokens).int().cuda(),
        place=torch.randint(0, 4 * PAGE, (tokens,), generator=gen).int().cuda())


def mla_call(m: dict[str, Any], backend: str | None) -> Callable[[], Any]:
    """FlashInfer's MLA door on ``m`` (``backend``: forced for the call, else dispatch's)."""
    q_rope_out = torch.empty(m["q_rope"].shape, dtype=FP8, device="cuda")
    q_nope_out = torch.empty(m["q_nope"].shape, dtype=FP8, device="cuda")
    args = (m["q_rope"], m["k_rope"], m["q_nope"], m["k_nope"], None, m["cos_sin"],
            m["positions"], (m["ckv"], m["kpe"]), m["indices"], m["indptr"], m["batch"],
            m["place"])
    options = dict(quantize_dtype=FP8, quant_scale_q=1.0, quant_scale_kv=1.0, page_size=PAGE,
                   q_rope_out=q_rope_out, q_nope_out=q_nope_out)

    def call() -> None:
        with rd.use_backend(backend):  # None: dispatch chooses
            doors.rope_quantize_fp8_append_paged_kv_cache(*args, **options)
    return call


def run_mla(token_counts: list[int], prefill: list[int], rounds: int) -> None:
    print(f"MLA decode, end to end us per call (ratio to the eager composition), "
          f"{torch.cuda.get_device_name()}")
    for tokens in token_counts:
        m = mla_inputs(tokens)
        calls = {"door, fused (dispatch)": mla_call(m, None),
                 "door, eager composition": mla_call(m, "eager")}
        print_interleaved(calls, "door, eager composition", f"T{tokens:<5}", rounds, 28)
    print("MLA prefill, GPU time (do_bench, L2 flushed) against a copy of the bytes moved")
    for tokens in prefill:
        m = mla_inputs(tokens)
        cache = rd.FlashInferPagedKVCache(
            (m["kpe"].unsqueeze(2), m["ckv"].unsqueeze(2)), m["indices"], m["indptr"],
            m["batch"], m["place"], page_size=PAGE)
        table, spec = rd.PairCosSinCache(m["cos_sin"]), rd.RoPESpec(layout="thd",
                                                                    dtype=torch.bfloat16)
        q_out = torch.empty(m["q_rope"].shape, dtype=FP8, device="cuda")
        k, v = m["k_rope"].unsqueeze(1), m["k_nope"].unsqueeze(1)
        read = (m["q_rope"].numel() + k.numel() + v.numel()) * 2
        written = m["q_rope"].numel() + k.numel() + v.numel()  # FP8 q and caches
        copy = device_copy_ms(read + written)
        ms = bench_ms(lambda: rd.rope_to_cache(m["q_rope"], k, v, table, spec,
                                               positions=m["positions"], cache=cache,
                                               q_out=q_out))
        print(f"  T{tokens:<6} rope_to_cache (q rope part, key part, compressed kv) "
              f"{ms * 1e3:8.1f} us, copy of {(read + written) / 1e6:.0f} MB {copy * 1e3:8.1f} us: "
              f"{100 * copy / ms:5.1f}% of copy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 64, 256])
    parser.add_argument("--prefill", type=int, nargs="*", default=[4096, 16384, 32768])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--mla-tokens", type=int, nargs="*", default=[1, 64, 256])
    parser.add_argument("--mla-prefill", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--only-mla", action="store_true", help="the MLA section alone")
    args = parser.parse_args()
    with torch.inference_mode():
        if not args.only_mla:
            run_decode(args.tokens, args.rounds)
            run_prefill(args.prefill)
        run_mla(args.mla_tokens, args.mla_prefill, args.rounds)


if __name__ == "__main__":
    main()
