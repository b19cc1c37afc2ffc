"""Warm the autotune cache ahead of training: ``python -m rope_dispatch.tune``, or
``rope_dispatch.tune(t, freqs, spec)`` for one call of a program.

Tuning measures every candidate, those that compile for seconds (the ``compile`` backend)
included, which a first ``apply`` of a key leaves out (docs/autotune.md).

Each shape is built with random data on the chosen device, every backend that can serve it is
measured (unless the cache already holds its key; ``--retune`` measures again) and the choice is
written to the cache that ``apply`` reads. Run it once per machine type with
``ROPE_DISPATCH_CACHE_DIR`` on a shared filesystem and every node of that type reads the result.

    python -m rope_dispatch.tune --layout sbhd --dtype bf16 --shape 4096,4,32,128 --grad
    python -m rope_dispatch.tune --specs shapes.json

A specs file is a JSON list of objects with the same names as the options: ``layout``, ``dtype``,
``shape`` (a list), and optionally ``rotary_dim``, ``interleaved``, ``grad``, ``device``,
``cos_sin_cache``, ``start_positions``, ``cu_seqlens`` (a list), ``max_seqlen`` (thd: the
spec says the longest sequence, as varlen training code passes it), ``cp_size``, ``cp_rank``,
``qkv_slice``.
Exit status: 0 when every shape was tuned (or needed no tuning), 1 when one failed, 2 for bad
arguments or when ``ROPE_AUTOTUNE`` is off (``0``) or neither on nor off, 130 when
interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from . import autotune, dispatch
from .call import check_call
from .errors import NoBackendError, RoPEError, RoPETypeError
from .spec import RoPESpec
from .tables import cos_sin_cache
from .tracing import distributed


@dataclass(frozen=True)
class Job:
    """One shape to tune, with the options that change its key."""

    layout: str
    dtype: str
    shape: tuple[int, ...]
    rotary_dim: int | None = None
    interleaved: bool = False
    grad: bool = False
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    cos_sin_cache: bool = False
    start_positions: bool = False
    cu_seqlens: tuple[int, ...] | None = None
    max_seqlen: bool = False
    cp_size: int = 1
    cp_rank: int = 0
    qkv_slice: bool = False

    def describe(self) -> str:
        extras = [
            name for name, on in (
                ("interleaved", self.interleaved), ("grad", self.grad),
                ("cos_sin_cache", self.cos_sin_cache), ("start_positions", self.start_positions),
                ("qkv_slice", self.qkv_slice), ("max_seqlen", self.max_seqlen),
            ) if on
        ]
        if self.rotary_dim is not None:
            extras.insert(0, f"rotary_dim={self.rotary_dim}")
        if self.cp_size > 1:
            extras.append(f"cp {self.cp_rank}/{self.cp_size}")
        shape = "x".join(str(n) for n in self.shape)
        return " ".join([self.layout, self.dtype, shape, self.device, *extras])


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{what} must be comma-separated integers such as 4096,4,32,128; got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"{what} must not be empty")
    return values


def _job_from_json(item: Any, where: str) -> Job:
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object, got {type(item).__name__}")
    known = {f.name for f in fields(Job)}
    unknown = sorted(set(item) - known)
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; known keys are {sorted(known)}")
    missing = [k for k in ("layout", "dtype", "shape") if k not in item]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    values = dict(item)
    for name in ("shape", "cu_seqlens"):
        if values.get(name) is not None:
            if not isinstance(values[name], list) or not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in values[name]):
                raise ValueError(f"{where}: {name} must be a list of integers, got {values[name]!r}")
            values[name] = tuple(values[name])
    for name, value in values.items():  # JSON's types exactly (a bool is no integer here)
        kind = _KEY_TYPES.get(name)
        if kind is not None and type(value) is not kind and not (
                value is None and name == "rotary_dim"):
            raise ValueError(f"{where}: {name} must be {_TYPE_NAMES[kind]}, got {value!r}")
    job = Job(**values)
    problem = job_problem(job, lambda option: option)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return job


_KEY_TYPES = {
    **dict.fromkeys(("layout", "dtype", "device"), str),
    **dict.fromkeys(("interleaved", "grad", "cos_sin_cache", "start_positions", "qkv_slice",
                     "max_seqlen"), bool),
    **dict.fromkeys(("rotary_dim", "cp_size", "cp_rank"), int),
}
_TYPE_NAMES = {str: "a string", bool: "true or false", int: "an integer"}


def job_problem(job: Job, named: Any) -> str | None:
    """What is wrong with ``job``'s values, the option or key named by ``named(key)``; ``None``
    when they make a call (checked before any shape is tuned: a bad argument, not a failed
    shape)."""
    if not job.shape:
        return f"{named('shape')} must not be empty"
    if any(n < 1 for n in job.shape):
        return f"{named('shape')} {job.shape}: every size must be a positive integer"
    if job.cu_seqlens is not None and job.layout != "thd":
        return f"{named('cu_seqlens')} is only for layout thd, got layout {job.layout!r}"
    if job.max_seqlen and job.layout != "thd":
        return f"{named('max_seqlen')} is only for layout thd, got layout {job.layout!r}"
    if job.cu_seqlens is not None and len(job.cu_seqlens) < 2:
        return (f"{named('cu_seqlens')} {list(job.cu_seqlens)}: give every sequence's start "
                "and the end of the last, at least two offsets such as 0,4096")
    try:  # a name torch does not know, or a device this machine lacks ("cuda" on a CPU build)
        torch.empty(0, device=torch.device(job.device))
    except Exception as exc:
        first = (str(exc).strip() or type(exc).__name__).splitlines()[0].split(". ")[0]
        return f"{named('device')} {job.device!r} cannot be used here: {first}"
    if torch.device(job.device).type not in ("cuda", "cpu"):  # meta: no data, nothing to time
        return (f"{named('device')} {job.device!r} cannot be used here: tuning times calls on "
                "cuda or cpu (a meta tensor has no data to time)")
    layout = "sbhd" if job.layout == "thd" else job.layout
    for name, args in (
        ("layout", {"layout": job.layout} if job.layout != "thd" else {}),
        ("dtype", {"dtype": job.dtype}),
        ("rotary_dim", {"rotary_dim": job.rotary_dim}),
        ("cp_size", {"cp_size": job.cp_size}),
        ("cp_rank", {"cp_size": job.cp_size, "cp_rank": job.cp_rank}),
    ):
        try:
            RoPESpec(**{"layout": layout, "dtype": "fp32", **args})
        except RoPEError as exc:
            return f"{named(name)}: {exc}"
    rank = 3 if job.layout == "thd" else 4
    if len(job.shape) != rank:
        return (f"{named('shape')} {list(job.shape)}: layout {job.layout} needs {rank} sizes "
                f"([{', '.join(job.layout)}])")
    try:  # the call's own checks: head dim, cu_seqlens' values, cp chunks
        build(job, check_only=True)
    except (ValueError, TypeError, RuntimeError, MemoryError) as exc:  # ours; torch: too large
        first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        return f"{named('shape')} {list(job.shape)} makes no valid {job.layout} call: {first}"
    return None


def load_specs(path: str) -> list[Job]:
    """The jobs of a JSON specs file (a list of objects, see the module docstring)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON list of shape objects, got {type(data).__name__}")
    return [_job_from_json(item, f"{path} item {i}") for i, item in enumerate(data)]


def build(job: Job, check_only: bool = False):
    """A checked call for ``job``: random input, an angle table long enough for every position.
    ``check_only`` builds it on the CPU from one-element tensors expanded to the sizes (no
    memory of the shape's size; the angle table stands for a cos/sin cache, which would be
    computed), to check the job before anything is tuned."""
    device = torch.device("cpu" if check_only else job.device)
    spec_args: dict[str, Any] = {
        "layout": job.layout, "dtype": job.dtype, "rotary_dim": job.rotary_dim,
        "interleaved": job.interleaved, "cp_size": job.cp_size, "cp_rank": job.cp_rank,
    }
    shape = job.shape
    if job.layout == "thd":
        tokens = shape[0]
        cu = job.cu_seqlens or (0, tokens * job.cp_size)
        spec_args["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
        positions = max(1, *(b - a for a, b in zip(cu, cu[1:])))  # checked in check_call
        sequences = len(cu) - 1
        if job.max_seqlen:  # keyed only as set: any value stands for a loop's every step
            spec_args["max_seqlen"] = positions
    else:
        seq = shape[0] if job.layout == "sbhd" else shape[1]
        positions = seq * job.cp_size
        sequences = shape[1] if job.layout == "sbhd" else shape[0]
    spec = RoPESpec(**spec_args)
    rotary_dim = job.rotary_dim or shape[-1]

    def random(size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if check_only:
            return torch.zeros((), dtype=dtype).expand(size)
        return torch.randn(size, dtype=dtype, device=device)

    if check_only:
        freqs = random((positions, 1, 1, rotary_dim), torch.float32)
    else:
        freqs = torch.rand(positions, 1, 1, rotary_dim, device=device) * 100
    table = cos_sin_cache(freqs) if job.cos_sin_cache and not check_only else freqs
    if job.qkv_slice:  # the q of a fused qkv projection: heads strided, channels packed
        fused = (*shape[:-2], 3 * shape[-2], shape[-1])
        t = random(fused, spec.dtype)[..., : shape[-2], :]
    else:
        t = random(shape, spec.dtype)
    t.requires_grad_(job.grad)
    starts = (
        torch.zeros(sequences, dtype=torch.int32, device=device) if job.start_positions else None
    )
    return check_call(t, table, spec, starts)


def _file_identity(path: Any) -> tuple[int, int] | None:
    """``path``'s inode and modification time (a write through ``os.replace`` changes both);
    ``None`` when it cannot be found."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def tune_job(job: Job, retune: bool = False) -> str:
    """Tune one job; the line that reports what was chosen and why."""
    with torch.enable_grad():
        call = build(job)
        supported, rejected = dispatch.capable_backends(call)
        if not supported:
            reasons = "; ".join(f"{name}: {' '.join(r)}" for name, r in rejected.items())
            raise RuntimeError(f"no backend can serve it ({reasons})")
        if len(supported) == 1:
            return f"{supported[0].name} (the only backend that can serve it; nothing to measure)"
        key = autotune._call_key(call, supported)
        # a complete choice this process remembers (a shape given twice) is not stored again
        remembered = (not retune and key.digest in autotune._memory
                      and key.digest not in autotune._pending)
        before = _file_identity(key.path)
        chosen, why = autotune.tune(call, supported, retune=retune)
    after = _file_identity(key.path)
    measured = not remembered and not why.startswith("cached measurement")
    if after is None or (measured and after == before):
        # the cache could not be written (one warning said why): a file there is an earlier
        # measurement (--retune, or a first call's pending entry), not this one
        held = "" if after is None else "; it holds an earlier measurement"
        raise RuntimeError(
            f"chose {chosen.name} ({why}), but the choice was not stored in the cache ({key.path} "
            f"was not written{held}), so later processes will not read it"
        )
    return f"{chosen.name} ({why})"


def tune_call(
    t: torch.Tensor,
    freqs: Any,
    spec: RoPESpec,
    *,
    start_positions: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    retune: bool = False,
) -> tuple[str, str]:
    """Measure every backend that can serve ``apply(t, freqs, spec, ...)`` now, those that
    compile included, and store the choice that later calls of its key read; ``(backend name,
    why)``. Called as ``rope_dispatch.tune(...)``. Like a first call, it measures on private
    copies: ``t`` is not touched. A key already measured in full is read, not measured again,
    unless ``retune``. Tunes forward+backward where ``t`` requires grad (under grad mode), as
    a training step's call does. A DTensor call tunes the plain call its rank's shard runs."""
    if type(retune) is not bool:  # a truthy "no" would measure again and overwrite the entry
        raise RoPETypeError(f"retune must be True or False, got {retune!r}")
    if not autotune.autotune_enabled():
        raise RoPEError(
            "ROPE_AUTOTUNE is off (got "
            f"{os.environ.get('ROPE_AUTOTUNE')!r}); unset it to tune"
        )
    if distributed(t):  # the plain call this rank's shard runs, as explain does
        t, freqs, spec, positions, _, _ = dispatch._dtensor().shard_call(
            t, freqs, spec, start_positions, positions)
        start_positions = None
    call = check_call(t, freqs, spec, start_positions, positions=positions)
    supported, rejected = dispatch.capable_backends(call)
    if not supported:
        reasons = "; ".join(f"{name}: {' '.join(r)}" for name, r in rejected.items())
        raise NoBackendError(f"no backend can serve this call ({reasons})")
    if len(supported) == 1:
        return supported[0].name, "the only backend that supports this call; nothing to measure"
    chosen, why = autotune.tune(call, supported, retune=retune)
    return chosen.name, why


def _progress(jobs: list[Job]) -> Iterator[tuple[int, Job]]:
    try:
        from tqdm import tqdm
    except ImportError:
        for i, job in enumerate(jobs, 1):
            print(f"[{i}/{len(jobs)}] tuning {job.describe()}", file=sys.stderr, flush=True)
            yield i, job
        return
    bar = tqdm(jobs, desc="rope-dispatch tune", unit="shape", file=sys.stderr)
    for i, job in enumerate(bar, 1):
        bar.set_postfix_str(job.describe())
        yield i, job


def _emit(text: str) -> None:
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    try:
        if tqdm is None:
            print(text, flush=True)
        else:
            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()  # each shape's line as it is tuned, piped too
    except BrokenPipeError:  # the reader left (`| head`): tune the other shapes all the same
        _drop_stdout()


def _drop_stdout() -> None:
    """Point stdout at the null device, so later writes (and the flush at exit) go nowhere."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, sys.stdout.fileno())
    finally:
        os.close(null)


def parse_args(argv: Iterable[str] | None = None) -> tuple[argparse.Namespace, list[Job]]:
    """The options and the jobs they describe (``--shape`` jobs, then those of ``--specs``)."""
    parser = argparse.ArgumentParser(
        prog="python -m rope_dispatch.tune",
        description="Measure the backends for a list of RoPE shapes and store the choices in the "
        "autotune cache (ROPE_DISPATCH_CACHE_DIR or the user cache directory).",
    )
    parser.add_argument("--layout", choices=("sbhd", "bshd", "thd"), help="layout of --shape")
    parser.add_argument("--dtype", default="bf16", help="fp32, fp16 or bf16 (default bf16)")
    parser.add_argument(
        "--shape", action="append", default=[], type=lambda s: _ints(s, "--shape"),
        help="a tensor shape in the layout's order, e.g. 4096,4,32,128; repeat for more",
    )
    parser.add_argument("--rotary-dim", type=int, help="rotated channels (default: head dim)")
    parser.add_argument("--interleaved", action="store_true", help="pairwise (GPT-J) rotation")
    parser.add_argument("--grad", action="store_true", help="tune forward+backward (training)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--cos-sin-cache", action="store_true", help="pass a CosSinCache table")
    parser.add_argument("--start-positions", action="store_true", help="pass start_positions")
    parser.add_argument(
        "--qkv-slice", action="store_true",
        help="t is a head slice of a fused qkv buffer (non-contiguous heads, packed channels)",
    )
    parser.add_argument(
        "--cu-seqlens", type=lambda s: _ints(s, "--cu-seqlens"),
        help="thd: global sequence offsets, e.g. 0,1000,4096 (default: one sequence)",
    )
    parser.add_argument(
        "--max-seqlen", action="store_true",
        help="thd: the spec gives max_seqlen (the longest sequence), as varlen training does",
    )
    parser.add_argument("--cp-size", type=int, default=1, help="context-parallel size")
    parser.add_argument("--cp-rank", type=int, default=0, help="context-parallel rank")
    parser.add_argument("--specs", action="append", default=[], help="a JSON file of shapes")
    parser.add_argument("--retune", action="store_true", help="measure again keys already cached")
    args = parser.parse_args(None if argv is None else list(argv))
    if args.shape and args.layout is None:
        parser.error("--shape needs --layout")
    if not args.shape and not args.specs:
        parser.error("give at least one --shape (with --layout) or --specs FILE")
    jobs = []
    for shape in args.shape:
        extra = {} if args.device is None else {"device": args.device}
        job = Job(
            layout=args.layout, dtype=args.dtype, shape=shape, rotary_dim=args.rotary_dim,
            interleaved=args.interleaved, grad=args.grad, cos_sin_cache=args.cos_sin_cache,
            start_positions=args.start_positions, cu_seqlens=args.cu_seqlens,
            max_seqlen=args.max_seqlen, cp_size=args.cp_size, cp_rank=args.cp_rank,
            qkv_slice=args.qkv_slice, **extra,
        )
        problem = job_problem(job, lambda key: "--" + key.replace("_", "-"))
        if problem is not None:
            parser.error(problem)
        jobs.append(job)
    for path in args.specs:
        try:
            loaded = load_specs(path)
        except (OSError, ValueError, TypeError) as exc:
            parser.error(f"--specs {path}: {exc}")
        if not loaded:  # a file emptied by mistake must not pass as a cache warmed
            parser.error(f"--specs {path}: the list holds no shapes, so there is nothing to tune")
        jobs.extend(loaded)
    return args, jobs


def main(argv: Iterable[str] | None = None) -> int:
    """Tune every job; 0 when all succeeded, 1 when one failed, 2 when measuring is off or
    ``ROPE_AUTOTUNE`` is not valid."""
    args, jobs = parse_args(argv)
    try:
        enabled = autotune.autotune_enabled()
    except RoPEError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not enabled:
        print(f"ROPE_AUTOTUNE={os.environ.get('ROPE_AUTOTUNE')!r} turns measuring off; unset it "
              "to tune", file=sys.stderr)
        return 2
    if forced := os.environ.get("ROPE_BACKEND"):  # tuned all the same: the job may not set it
        print(f"note: ROPE_BACKEND={forced!r} is set here; the calls it forces neither read nor "
              "write this cache, so the choices stored serve processes without it",
              file=sys.stderr)
    failures = done = 0
    job = None
    try:
        for done, job in _progress(jobs):
            try:
                line = tune_job(job, retune=args.retune)
            except Exception as exc:  # report every shape, then fail at the end
                failures += 1
                _emit(f"{job.describe()}: FAILED: {type(exc).__name__}: {exc}")
            else:
                _emit(f"{job.describe()}: {line}")
    except KeyboardInterrupt:  # Ctrl-C: what was stored stays (every write is whole or none)
        where = ("before the first shape" if job is None
                 else f"while tuning shape {done} of {len(jobs)} ({job.describe()})")
        print(f"\ninterrupted {where}; the shapes tuned before it are kept in the cache, "
              f"{autotune.cache_dir()}", file=sys.stderr)
        return 130
    _emit(f"cache: {autotune.cache_dir()} ({len(autotune.cache_entries())} entries)")
    if failures:
        print(f"{failures} of {len(jobs)} shapes failed", file=sys.stderr)
    return 1 if failures else 0


class _CallableModule(types.ModuleType):
    """``rope_dispatch.tune`` is this module, and calling it is :func:`tune_call`."""

    def __call__(
        self, t: torch.Tensor, freqs: Any, spec: RoPESpec, **options: Any
    ) -> tuple[str, str]:
        return tune_call(t, freqs, spec, **options)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
